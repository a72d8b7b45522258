"""
Triton kernels for overlap_engine: paged KV store, decode attention and extend (prefill) attention; and
CPU kernels in C: decode attention (`decode_attention_cpu`, the same spec as `decode_attention_ref`), a
quantized matmul with integer dot products (`q_matmul_cpu`, its spec `q_matmul_ref`), and a GGUF file's own
blocks times float32 activations (`gguf_matmul_cpu`, its spec `gguf_matmul_ref`) with one request's whole
decode step on them (`gguf_decode_step`), and float32 or bf16 weights in the same family's tiles
(`float_matmul_cpu`, its spec `float_matmul_ref`), each row's sums in one order whatever the batch.

Every op comes in three parts: `<op>_ref()`, plain torch and the spec; `_<op>_kernel`, the Triton
kernel; `<op>()`, the launcher that checks shapes, allocates the output and builds the grid.
The KV pool is token-paged (page size 1), as in SGLang: per layer `k_cache` and `v_cache` of shape
(num_slots, n_kv_heads, head_dim), slot 0 a reserved dummy, and `req_to_token[row, pos]` the slot
holding position `pos` of the request that owns pool row `row`. Attention reads K/V through it.

What this is not: a tuned library. One launch config per kernel (explained at the launcher), no
autotune, no paging larger than one token, no sliding window, soft-cap or custom masks.
References: Triton tutorial 06 (fused attention), Flash-Decoding (Dao et al. 2023), SGLang's
`decode_attention.py` / `extend_attention.py` (same ideas, written from scratch here).

Without CUDA the kernels run on CPU tensors under TRITON_INTERPRET=1 (slow; set below, before any
kernel is decorated). Run the tests with `python -m pytest test_overlap_engine.py -k kernel`
(CPU: fp32 and fp64 only, the interpreter has no 16-bit dot).
"""

import contextlib
import importlib.machinery
import importlib.util
import math
import os
import sys
import time

# overlap_engine loads this file under a private name (overlap_engine_kernels). Imported as plain `kernels`,
# from a program that has this folder on sys.path, it is the Hugging Face Hub's package that is asked for
# (transformers imports it by that name): it takes this module's place in sys.modules, so the importer
# gets it. The rest of this file still runs, in a module nobody keeps.
HANDED_OVER = False
if __name__ == "kernels":
    _here = os.path.dirname(os.path.realpath(__file__))
    _elsewhere = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != _here]
    _hub = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _hub is not None:
        sys.modules["kernels"] = importlib.util.module_from_spec(_hub)
        _hub.loader.exec_module(sys.modules["kernels"])
        HANDED_OVER = True

import torch  # noqa: E402

if not torch.cuda.is_available() and not HANDED_OVER:
    # the interpreter runs kernels with numpy on CPU tensors; triton reads this at decoration time
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


# ----------------------------------------------------------------------------------------------
# shared helpers


# Numerics of every kernel: accumulate in fp32 (fp64 for fp64 data, the engine's exact-equality tests);
# tl.dot(..., input_precision="ieee") keeps fp32 products exact instead of tf32 (16-bit inputs ignore it).
def _acc_dtype(dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _check_pool(k_cache, v_cache, head_dim):
    assert k_cache.shape == v_cache.shape, f"k/v cache shapes differ: {k_cache.shape} vs {v_cache.shape}"
    assert k_cache.dim() == 3 and k_cache.shape[2] == head_dim, \
        f"cache must be (num_slots, n_kv_heads, {head_dim}), got {tuple(k_cache.shape)}"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache rows must be contiguous in head_dim"


@triton.jit
def _online_softmax_block(q, K, V, slot, kv_h, offs_d, mask_kv, visible, m_i, l_i, acc, sm_scale,
                          stride_kn, stride_kh, stride_vn, stride_vh, ACC: tl.constexpr):
    """One KV block of flash attention for a tile of query rows: returns the updated (m_i, l_i, acc).
    slot: (BLOCK_N,) KV slots; visible: (rows, BLOCK_N) which scores count (padding, causality)."""
    # -- compute qk --
    k = tl.load(K + slot[:, None] * stride_kn + kv_h * stride_kh + offs_d[None, :], mask=mask_kv, other=0.0)
    qk = tl.dot(q, tl.trans(k), input_precision="ieee").to(ACC) * sm_scale  # (rows, BLOCK_N)
    qk = tl.where(visible, qk, float("-inf"))
    # -- online softmax: rescale what we have so far to the new max --
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # -- accumulate p v --
    v = tl.load(V + slot[:, None] * stride_vn + kv_h * stride_vh + offs_d[None, :], mask=mask_kv, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee").to(ACC)
    return m_new, l_i, acc


# ----------------------------------------------------------------------------------------------
# store_kv: write one step's K and V into the pool at its slots


def store_kv_ref(k_cache, v_cache, loc, k, v):
    """k_cache[loc] = k; v_cache[loc] = v (in place). loc (N,) slots, k and v (N, n_kv_heads, head_dim)."""
    k_cache[loc] = k
    v_cache[loc] = v


@triton.jit
def _store_kv_kernel(
    K_cache, V_cache, loc, K, V,
    stride_kcn, stride_kch, stride_vcn, stride_vch,
    stride_kn, stride_kh, stride_vn, stride_vh,
    H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # one program copies all heads of one token
    i = tl.program_id(0)
    slot = tl.load(loc + i).to(tl.int64)  # int64: slot * stride can pass 2**31 in a big pool
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < H) & (offs_d[None, :] < D)
    # -- k --
    k = tl.load(K + i * stride_kn + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    tl.store(K_cache + slot * stride_kcn + offs_h[:, None] * stride_kch + offs_d[None, :], k, mask=mask)
    # -- v --
    v = tl.load(V + i * stride_vn + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(V_cache + slot * stride_vcn + offs_h[:, None] * stride_vch + offs_d[None, :], v, mask=mask)


def store_kv(k_cache, v_cache, loc, k, v):
    """Triton version of store_kv_ref. No host sync; loc may be int32 or int64."""
    N, H, D = k.shape
    _check_pool(k_cache, v_cache, D)
    assert v.shape == k.shape and loc.shape == (N,), \
        f"k {tuple(k.shape)}, v {tuple(v.shape)}, loc {tuple(loc.shape)}"
    assert k.dtype == k_cache.dtype and v.dtype == v_cache.dtype, "k/v dtype must match the cache dtype"
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "k and v must be contiguous in head_dim"
    if N == 0:
        return
    # a (heads x head_dim) tile per token: at most a few thousand elements, one warp group is plenty
    _store_kv_kernel[(N,)](
        k_cache, v_cache, loc, k, v,
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        H=H, D=D, BLOCK_H=triton.next_power_of_2(H), BLOCK_D=triton.next_power_of_2(D),
        num_warps=4,
    )


# ----------------------------------------------------------------------------------------------
# decode_attention: one query token per request over its whole context (flash-decoding, split-K)


def decode_attention_ref(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, sm_scale):
    """o[b] = softmax(q[b] K_b^T * sm_scale) V_b, with K_b, V_b the first seq_lens[b] slots of row
    req_pool_indices[b] of req_to_token. q (B, Hq, D) -> o (B, Hq, D); query head h reads kv head h // G."""
    B, Hq, _ = q.shape
    G = Hq // k_cache.shape[1]  # query heads per kv head
    acc = torch.promote_types(q.dtype, torch.float32)  # compute in fp32 (fp64 stays fp64)
    o = torch.empty_like(q)
    for b in range(B):
        slots = req_to_token[req_pool_indices[b], : seq_lens[b]].long()  # (S,)
        k = k_cache[slots].to(acc).repeat_interleave(G, dim=1)  # (S, Hq, D)
        v = v_cache[slots].to(acc).repeat_interleave(G, dim=1)  # (S, Hq, D)
        s = torch.einsum("hd,shd->hs", q[b].to(acc), k) * sm_scale  # (Hq, S)
        o[b] = torch.einsum("hs,shd->hd", s.softmax(dim=-1), v).to(q.dtype)
    return o


@triton.jit
def _decode_attention_stage1_kernel(
    Q, K, V, req_to_token, req_pool_indices, seq_lens, Mid_O, Mid_LSE, sm_scale,
    stride_qb, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_rr,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    G: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr, ACC: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # one program = (request b, kv head, split): the G query heads of that kv head over one chunk
    b = tl.program_id(0)
    kv_h = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(req_pool_indices + b)
    seq_len = tl.load(seq_lens + b)
    # the context is cut into NUM_SPLITS chunks of split_len positions; trailing chunks may be empty
    split_len = tl.cdiv(seq_len, NUM_SPLITS)
    n_start = split * split_len
    n_end = tl.minimum(n_start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_H)  # query heads of this kv head, padded to BLOCK_H >= 16 for tl.dot
    offs_h = kv_h * G + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_h = offs_g < G
    mask_d = offs_d < D

    if n_end > n_start:  # subtle: an empty split writes nothing; stage 2 skips it the same way
        q = tl.load(Q + b * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_h[:, None] & mask_d[None, :], other=0.0)  # (BLOCK_H, BLOCK_D)
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=ACC)  # running max of the scores
        l_i = tl.zeros([BLOCK_H], dtype=ACC)  # running softmax denominator
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=ACC)  # running unnormalised output
        for n0 in range(n_start, n_end, BLOCK_N):
            # -- gather this block's slots through req_to_token --
            n = n0 + offs_n
            mask_n = n < n_end
            slot = tl.load(req_to_token + row * stride_rr + n, mask=mask_n, other=0).to(tl.int64)
            # -- scores of the G heads against this block, then the online-softmax update --
            m_i, l_i, acc = _online_softmax_block(q, K, V, slot, kv_h, offs_d,
                                                  mask_n[:, None] & mask_d[None, :], mask_n[None, :],
                                                  m_i, l_i, acc, sm_scale,
                                                  stride_kn, stride_kh, stride_vn, stride_vh, ACC)
        # -- store this split's normalised output and log-sum-exp --
        mid = b * stride_ob + offs_h[:, None] * stride_oh + split * stride_os + offs_d[None, :]
        tl.store(Mid_O + mid, acc / l_i[:, None], mask=mask_h[:, None] & mask_d[None, :])
        tl.store(Mid_LSE + b * stride_lb + offs_h * stride_lh + split, m_i + tl.log(l_i), mask=mask_h)


@triton.jit
def _decode_attention_stage2_kernel(
    Mid_O, Mid_LSE, O, seq_lens,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_Ob, stride_Oh,
    D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # one program = (request b, query head h): merge the splits, weighting each by exp(lse)
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens + b)
    split_len = tl.cdiv(seq_len, NUM_SPLITS)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    # same rule as stage 1: split s holds positions [s * split_len, ...) and is empty past seq_len
    mask_s = (offs_s < NUM_SPLITS) & (offs_s * split_len < seq_len)
    mask_d = offs_d < D
    # -- softmax over the splits' log-sum-exps --
    lse = tl.load(Mid_LSE + b * stride_lb + h * stride_lh + offs_s, mask=mask_s, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, 0))  # (BLOCK_S,), 0 on empty splits
    # -- weighted sum of the partial outputs --
    o_s = tl.load(Mid_O + b * stride_ob + h * stride_oh + offs_s[:, None] * stride_os + offs_d[None, :],
                  mask=mask_s[:, None] & mask_d[None, :], other=0.0)  # (BLOCK_S, BLOCK_D)
    o = tl.sum(w[:, None] * o_s, 0) / tl.sum(w, 0)
    tl.store(O + b * stride_Ob + h * stride_Oh + offs_d, o.to(O.dtype.element_ty), mask=mask_d)


def decode_attention(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, sm_scale,
                     num_kv_splits=8):
    """Triton version of decode_attention_ref, two launches, no host sync. seq_lens >= 1 (0 gives NaN).
    Index tensors (req_to_token, req_pool_indices, seq_lens) may be int32 or int64, on q's device."""
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    _check_pool(k_cache, v_cache, D)
    assert Hq % Hkv == 0, f"{Hq} query heads do not group onto {Hkv} kv heads"
    assert q.stride(-1) == 1 and req_to_token.stride(-1) == 1, \
        "q and req_to_token must be contiguous in the last dim"
    assert req_pool_indices.shape == (B,) and seq_lens.shape == (B,), \
        "one pool row and one length per request"
    G = Hq // Hkv
    acc = torch.promote_types(q.dtype, torch.float32)
    # split outputs are kept normalised, in the accumulation dtype, with their log-sum-exp
    mid_o = torch.empty(B, Hq, num_kv_splits, D, dtype=acc, device=q.device)  # (B, Hq, S, D)
    mid_lse = torch.empty(B, Hq, num_kv_splits, dtype=acc, device=q.device)  # (B, Hq, S)
    o = torch.empty_like(q)
    if B == 0:
        return o
    # Launch config. Stage 1: B * Hkv * num_kv_splits programs (4096 at B=64, Hkv=8, 8 splits,
    # enough to fill a GPU even at small batch). Each holds a 16-row query tile (the G heads padded
    # to the tensor-core minimum) and streams 64 positions of K and V per step: with D=128 in fp16
    # that is 2 x 16 KiB per step, double-buffered (num_stages=2) by 4 warps.
    BLOCK_D = max(16, triton.next_power_of_2(D))
    _decode_attention_stage1_kernel[(B, Hkv, num_kv_splits)](
        q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse, sm_scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        G=G, D=D, NUM_SPLITS=num_kv_splits, ACC=_acc_dtype(q.dtype),
        BLOCK_H=max(16, triton.next_power_of_2(G)), BLOCK_N=64, BLOCK_D=BLOCK_D,
        num_warps=4, num_stages=2,
    )
    # Stage 2: one small program per (request, query head) reads num_kv_splits x D partials.
    _decode_attention_stage2_kernel[(B, Hq)](
        mid_o, mid_lse, o, seq_lens,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        o.stride(0), o.stride(1),
        D=D, NUM_SPLITS=num_kv_splits, BLOCK_S=triton.next_power_of_2(num_kv_splits), BLOCK_D=BLOCK_D,
        num_warps=4,
    )
    return o


# ----------------------------------------------------------------------------------------------
# extend_attention: each request's new tokens attend to its cached prefix and causally to themselves


def extend_attention_ref(q, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, extend_lens,
                         sm_scale):
    """Prefill with a cached prefix. q (N_total, Hq, D) holds the new tokens of all requests in batch
    order; with P = prefix_lens[b] and E = extend_lens[b], their K/V are already in the pool at
    positions P .. P + E - 1. New token i of request b (position P + i) attends to positions 0 .. P + i."""
    Hq = q.shape[1]
    G = Hq // k_cache.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    o = torch.empty_like(q)
    start = 0
    for b in range(len(extend_lens)):
        P, E = int(prefix_lens[b]), int(extend_lens[b])
        slots = req_to_token[req_pool_indices[b], : P + E].long()  # (P + E,)
        k = k_cache[slots].to(acc).repeat_interleave(G, dim=1)  # (P + E, Hq, D)
        v = v_cache[slots].to(acc).repeat_interleave(G, dim=1)
        s = torch.einsum("ihd,jhd->hij", q[start : start + E].to(acc), k) * sm_scale  # (Hq, E, P + E)
        # key j is visible to new token i iff j <= P + i
        j = torch.arange(P + E, device=q.device)
        i = torch.arange(E, device=q.device)
        visible = j[None, :] <= P + i[:, None]  # (E, P + E)
        s = s.masked_fill(~visible, float("-inf"))
        o[start : start + E] = torch.einsum("hij,jhd->ihd", s.softmax(dim=-1), v).to(q.dtype)
        start += E
    return o


@triton.jit
def _extend_attention_kernel(
    Q, K, V, O, req_to_token, req_pool_indices, prefix_lens, extend_lens, extend_start, sm_scale,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh, stride_rr,
    G: tl.constexpr, D: tl.constexpr, ACC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # one program = (request b, query head h, block of BLOCK_M new tokens)
    b = tl.program_id(0)
    h = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    E = tl.load(extend_lens + b)
    if m0 < E:  # the grid is sized for the longest request; shorter ones leave blocks idle
        row = tl.load(req_pool_indices + b)
        P = tl.load(prefix_lens + b)
        q_start = tl.load(extend_start + b)
        kv_h = h // G  # GQA: the G heads of a group re-read the same K/V tiles (from L2)

        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        mask_m = offs_m < E
        mask_d = offs_d < D
        q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qn + h * stride_qh + offs_d[None, :],
                    mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)
        q_pos = P + offs_m  # position of each new token in its sequence
        # causal: no key past the last token of this block is visible to any row of it
        n_end = P + tl.minimum(m0 + BLOCK_M, E)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=ACC)
        l_i = tl.zeros([BLOCK_M], dtype=ACC)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC)
        # subtle: key 0 is visible to every row, so after the first block every m_i is finite
        for n0 in range(0, n_end, BLOCK_N):
            # -- gather this block's slots (prefix and new tokens alike) through req_to_token --
            n = n0 + offs_n
            mask_n = n < n_end
            slot = tl.load(req_to_token + row * stride_rr + n, mask=mask_n, other=0).to(tl.int64)
            # -- causal scores against this block, then the online-softmax update --
            causal = mask_n[None, :] & (n[None, :] <= q_pos[:, None])
            m_i, l_i, acc = _online_softmax_block(q, K, V, slot, kv_h, offs_d,
                                                  mask_n[:, None] & mask_d[None, :], causal,
                                                  m_i, l_i, acc, sm_scale,
                                                  stride_kn, stride_kh, stride_vn, stride_vh, ACC)
        # -- normalise and store --
        o = acc / l_i[:, None]
        tl.store(O + (q_start + offs_m)[:, None] * stride_on + h * stride_oh + offs_d[None, :],
                 o.to(O.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def extend_attention(q, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, extend_lens, sm_scale,
                     max_extend_len=None):
    """Triton version of extend_attention_ref. The grid needs the longest extend length on the host:
    pass it as `max_extend_len` (the scheduler knows it) or the launcher reads it with a host sync."""
    N, Hq, D = q.shape
    B = extend_lens.shape[0]
    Hkv = k_cache.shape[1]
    _check_pool(k_cache, v_cache, D)
    assert Hq % Hkv == 0, f"{Hq} query heads do not group onto {Hkv} kv heads"
    assert q.stride(-1) == 1 and req_to_token.stride(-1) == 1, \
        "q and req_to_token must be contiguous in the last dim"
    assert req_pool_indices.shape == (B,) and prefix_lens.shape == (B,), \
        "one pool row and one prefix per request"
    o = torch.empty_like(q)
    if N == 0:
        return o
    # where each request's tokens start in q: exclusive cumsum, computed on the device
    extend_start = torch.cumsum(extend_lens, 0) - extend_lens  # (B,)
    if max_extend_len is None:
        max_extend_len = int(extend_lens.max())  # sync point: waits for the device to reach this step
    # Launch config: 64 x 64 tiles of (new tokens x keys), the shape of Triton tutorial 06 that fits
    # registers and shared memory with 4 warps up to D=128; halve the key tile above that.
    BLOCK_D = max(16, triton.next_power_of_2(D))
    BLOCK_M = 64
    BLOCK_N = 64 if BLOCK_D <= 128 else 32
    _extend_attention_kernel[(B, Hq, triton.cdiv(max_extend_len, BLOCK_M))](
        q, k_cache, v_cache, o,
        req_to_token, req_pool_indices, prefix_lens, extend_lens, extend_start, sm_scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        o.stride(0), o.stride(1), req_to_token.stride(0),
        G=Hq // Hkv, D=D, ACC=_acc_dtype(q.dtype),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        num_warps=4, num_stages=2,
    )
    return o


# ----------------------------------------------------------------------------------------------
# decode_attention on a CPU: the same op as decode_attention_ref, in C, for bf16 and fp32 pools
#
# A decode step reads each request's whole context once per layer, so on a CPU the op is a stream
# through memory: every K and V row is loaded once, converted to fp32 and used by the G query heads
# that share it. Keys go in chunks of 32: a chunk's scores, their maximum, the running sum rescaled
# when the maximum grows (flash attention's online softmax), then the chunk's values. With AVX2 (and a
# head_dim that is a multiple of 8) 8 keys' dot products are reduced together and the values pass keeps
# its running sums in registers: half the instructions a token of the plain loops below; with AVX512 (a
# head_dim that is a multiple of 16) both passes take 16 floats a vector (on the Xeon with AMX, a layer of
# 64 requests at context 442 in bf16: 0.79x the AVX2 path's time, docs/results.md). Its column slices
# of V rows are a pattern the hardware prefetcher follows badly, so a chunk's V rows are first read whole,
# in order (on an AVX2 EPYC: 4-7% off the op at batch 64; software prefetch changed nothing). OpenMP splits
# the (request, kv head) pairs over torch's threads; the .so links the libgomp that torch has loaded.
# Compiled once per machine (head_dim and G are compile-time constants, so the inner loops are
# vector code) with the C compiler Inductor would use, and cached under cpu_kernel_cache().

CPU_DECODE_SRC = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>
#define D %(D)d
#define G %(G)d
#define HKV %(HKV)d
#define E %(E)d          /* queries a request: 1 (decode) or a verify's last token and its drafts */
#define QR (E * G)       /* query rows sharing a KV head: E positions times G heads */
#define ROW (HKV * D)
#define CHUNK 32

static inline float load(const ELEM *p, int64_t i) {
#ifdef BF16
    uint32_t u = (uint32_t)p[i] << 16; float f; memcpy(&f, &u, 4); return f;
#else
    return p[i];
#endif
}

#if defined(__AVX2__) && defined(__FMA__) && D %% 8 == 0
#include <immintrin.h>
#define AVX2_PATH 1
/* the values pass holds the sums of VR query rows over NV vectors of columns in registers (12 of AVX2's
   16) */
#define VR (QR %% 3 == 0 ? 3 : QR %% 2 == 0 ? 2 : 1)
#define NV (D %% (4 * VW) == 0 ? 4 : D %% (2 * VW) == 0 ? 2 : 1)

/* one load from each cache line of heads h0 .. h1 - 1 of a row: the values pass reads a chunk's V rows
   in column slices, which the hardware prefetcher follows badly; read whole rows in order first */
static inline void touch_row(const ELEM *row, int h0, int h1) {
    for (int c = h0 * D * (int)sizeof(ELEM); c < h1 * D * (int)sizeof(ELEM); c += 64)
        (void)*(volatile const char *)((const char *)row + c);
}

static inline __m256 load8(const ELEM *p) {
#ifdef BF16
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#else
    return _mm256_loadu_ps(p);
#endif
}

/* lane i of the result: the sum of the 8 lanes of a[i], in three rounds of pairwise sums */
static inline __m256 sum8(const __m256 *a) {
    __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}

/* the vectors both passes run on: AVX512's 16 floats where the CPU has them (half the instructions a
   token), else AVX2's 8 */
#if defined(__AVX512F__) && defined(__AVX512DQ__) && D %% 16 == 0
typedef __m512 vec;
#define VW 16
static inline vec vload(const ELEM *p) {
#ifdef BF16
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#else
    return _mm512_loadu_ps(p);
#endif
}
#define vloadf _mm512_loadu_ps
#define vstoref _mm512_storeu_ps
#define vmul _mm512_mul_ps
#define vfma _mm512_fmadd_ps
#define vset1 _mm512_set1_ps
/* a dot product's 16 lanes folded to 8 for sum8 */
static inline __m256 fold8(vec v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
}
#else
typedef __m256 vec;
#define VW 8
#define vload load8
#define vloadf _mm256_loadu_ps
#define vstoref _mm256_storeu_ps
#define vmul _mm256_mul_ps
#define vfma _mm256_fmadd_ps
#define vset1 _mm256_set1_ps
#define fold8(v) (v)
#endif
#endif

static inline ELEM store(float f) {
#ifdef BF16
    uint32_t u; memcpy(&u, &f, 4); u += 0x7FFF + ((u >> 16) & 1); return (ELEM)(u >> 16);
#else
    return f;
#endif
}

/* q, out: (B * E, HKV * G, D), request b's queries at rows b * E + e; kb, vb: (slots, HKV, D); the slot
   of position l of request b is req_to_token[rows[b] * ctx + l]; query e sees l < lens[b] - E + 1 + e
   (lens[b] >= E). A thread takes a request, or with fewer requests than threads one of its kv heads
   (one request alone: 1.1-1.6x faster on 2 cores; a batch of 64 reads whole rows, 1.2-1.9x faster so). */
void decode_attention(const ELEM *q, const ELEM *kb, const ELEM *vb, const int32_t *req_to_token,
                      const int64_t *rows, const int64_t *lens, int64_t B, int64_t ctx, float scale,
                      ELEM *out, int threads) {
    const int split = B < threads;  /* a unit of work: request b, kv heads h0 .. h1 - 1 */
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t u = 0; u < (split ? B * HKV : B); u++) {
        const int64_t b = split ? u / HKV : u;
        const int h0 = split ? (int)(u %% HKV) : 0, h1 = split ? h0 + 1 : HKV;
        float qf[HKV][QR][D], acc[HKV][QR][D], s[HKV][QR][CHUNK], m[HKV][QR], sum[HKV][QR];
        const int32_t *slots = req_to_token + rows[b] * ctx;
        const int64_t n_all = lens[b];
        for (int h = h0; h < h1; h++)
            for (int g = 0; g < QR; g++) {  /* row g: position g / G, head h * G + g %% G */
                for (int d = 0; d < D; d++) {
                    qf[h][g][d] = load(q, ((b * E + g / G) * HKV * G + h * G + g %% G) * D + d) * scale;
                    acc[h][g][d] = 0.0f;
                }
                m[h][g] = -INFINITY;
                sum[h][g] = 0.0f;
            }
        for (int64_t l0 = 0; l0 < n_all; l0 += CHUNK) {
            int n = n_all - l0 < CHUNK ? (int)(n_all - l0) : CHUNK;
            int j = 0;
#ifdef AVX2_PATH
            for (; j + 8 <= n; j += 8) {  /* 8 K rows in order, their dot products reduced together */
                __m256 dots[HKV][QR][8];
                for (int i = 0; i < 8; i++) {
                    const ELEM *k = kb + (int64_t)slots[l0 + j + i] * ROW;
                    for (int h = h0; h < h1; h++)
                        for (int g = 0; g < QR; g++) {
                            vec x = vmul(vloadf(qf[h][g]), vload(k + h * D));
                            for (int d = VW; d < D; d += VW)
                                x = vfma(vloadf(qf[h][g] + d), vload(k + h * D + d), x);
                            dots[h][g][i] = fold8(x);
                        }
                }
                for (int h = h0; h < h1; h++)
                    for (int g = 0; g < QR; g++) _mm256_storeu_ps(&s[h][g][j], sum8(dots[h][g]));
            }
#endif
            for (; j < n; j++) {  /* the chunk's (other) scores: one K row (heads h0 .. h1 - 1) at a time */
                const ELEM *k = kb + (int64_t)slots[l0 + j] * ROW;
                for (int h = h0; h < h1; h++) {
                    float kf[D];
                    for (int d = 0; d < D; d++) kf[d] = load(k, h * D + d);
                    for (int g = 0; g < QR; g++) {
                        float dot = 0.0f;
                        for (int d = 0; d < D; d++) dot += qf[h][g][d] * kf[d];
                        s[h][g][j] = dot;
                    }
                }
            }
#ifdef AVX2_PATH
            for (int j = 0; j < n; j++) touch_row(vb + (int64_t)slots[l0 + j] * ROW, h0, h1);
#endif
            for (int h = h0; h < h1; h++)  /* online softmax: rescale what is there to the new max */
                for (int g = 0; g < QR; g++) {
                    int64_t seen = n_all - E + 1 + g / G - l0;  /* keys of the chunk row g sees (causal) */
                    int nv = seen < n ? (seen > 0 ? (int)seen : 0) : n;
                    float mx = m[h][g], total = 0.0f;
                    for (int j = 0; j < nv; j++) mx = s[h][g][j] > mx ? s[h][g][j] : mx;
                    float alpha = expf(m[h][g] - mx);  /* the first chunk has a key every row sees */
                    for (int j = 0; j < nv; j++) { s[h][g][j] = expf(s[h][g][j] - mx); total += s[h][g][j]; }
                    for (int j = nv; j < n; j++) s[h][g][j] = 0.0f;
                    sum[h][g] = sum[h][g] * alpha + total;
                    m[h][g] = mx;
                    for (int d = 0; d < D; d++) acc[h][g][d] *= alpha;
                }
#ifdef AVX2_PATH
            for (int h = h0; h < h1; h++)  /* the chunk's values, VR rows' sums on NV vectors at a time */
                for (int g0 = 0; g0 < QR; g0 += VR)
                    for (int d0 = 0; d0 < D; d0 += NV * VW) {
                        vec a[VR][NV];
                        for (int r = 0; r < VR; r++)
                            for (int i = 0; i < NV; i++)
                                a[r][i] = vloadf(&acc[h][g0 + r][d0 + VW * i]);
                        for (int j = 0; j < n; j++) {
                            const ELEM *v = vb + (int64_t)slots[l0 + j] * ROW + h * D + d0;
                            for (int i = 0; i < NV; i++) {
                                vec x = vload(v + VW * i);
                                for (int r = 0; r < VR; r++)
                                    a[r][i] = vfma(vset1(s[h][g0 + r][j]), x, a[r][i]);
                            }
                        }
                        for (int r = 0; r < VR; r++)
                            for (int i = 0; i < NV; i++)
                                vstoref(&acc[h][g0 + r][d0 + VW * i], a[r][i]);
                    }
#else
            for (int j = 0; j < n; j++) {  /* the chunk's values */
                const ELEM *v = vb + (int64_t)slots[l0 + j] * ROW;
                for (int h = h0; h < h1; h++) {
                    float vf[D];
                    for (int d = 0; d < D; d++) vf[d] = load(v, h * D + d);
                    for (int g = 0; g < QR; g++)
                        for (int d = 0; d < D; d++) acc[h][g][d] += s[h][g][j] * vf[d];
                }
            }
#endif
        }
        for (int h = h0; h < h1; h++)
            for (int g = 0; g < QR; g++)
                for (int d = 0; d < D; d++)
                    out[((b * E + g / G) * HKV * G + h * G + g %% G) * D + d] =
                        store(acc[h][g][d] / sum[h][g]);
    }
}
"""

CPU_KERNEL_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC"]


def cpu_kernel_cache() -> str:
    """Where built kernels are kept: overlap_engine's cache folder ($OVERLAP_ENGINE_CACHE, else
    ~/.cache/overlap_engine), read at each build so that a process may point it elsewhere."""
    root = os.environ.get("OVERLAP_ENGINE_CACHE") or os.path.expanduser("~/.cache/overlap_engine")
    return os.path.join(root, "kernels")

_cpu_kernels: dict = {}
# each library loaded once a process, whatever cpu_kernel_cache() says later: a second copy of the ops
# library (built in another cache folder) would register its kernels with torch over the first's, and its
# function pointers were never handed over
_libraries: dict = {}


def _cpu_flags() -> str:
    """This CPU's model and flags (-march=native builds for them: a cache shared with another CPU must
    not hand its kernel over)."""
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(line for line in f if line.startswith(("model name", "flags")))[:4096]
    except OSError:
        import platform
        return platform.processor()


def build_c(stem: str, src: str, flags: list, compiler: str, symbol: str, argtypes: list, lang: str = "c",
            libs: tuple = ("-lm",)):
    """The function `symbol` of `src` (C, or `lang`) compiled with `flags` and linked with `libs` into
    cpu_kernel_cache()/<stem>_<hash>.so (once per source, flags, compiler and CPU), or None where it cannot
    be built here."""
    import ctypes
    import hashlib
    import subprocess
    tag = hashlib.sha256((src + " ".join(flags) + compiler + _cpu_flags()).encode()).hexdigest()[:16]
    name = f"{stem}_{tag}.so"
    so = os.path.join(cpu_kernel_cache(), name)
    try:
        if name not in _libraries:
            if not os.path.exists(so):
                os.makedirs(os.path.dirname(so), exist_ok=True)
                with build_lock(so):
                    if not os.path.exists(so):  # another process may have built it while this one waited
                        _compile(compiler, flags, lang, src, so, libs)
            _libraries[name] = ctypes.CDLL(so)
        fn = getattr(_libraries[name], symbol)
    except (OSError, AttributeError, subprocess.CalledProcessError):
        return None
    fn.argtypes, fn.restype = argtypes, None
    return fn


def _compile(compiler: str, flags: list, lang: str, src: str, so: str, libs: tuple):
    import subprocess
    c_path = so[:-3] + f".{os.getpid()}.{lang}"
    with open(c_path, "w") as f:
        f.write(src)
    try:
        subprocess.run([compiler, *flags, "-x", lang, c_path, "-o", so + f".{os.getpid()}", *libs],
                       check=True, capture_output=True)
        os.replace(so + f".{os.getpid()}", so)  # atomic: another process sees all of it or none
    finally:  # a CPU that cannot build it leaves nothing behind
        os.remove(c_path)


@contextlib.contextmanager
def build_lock(path: str):
    """Held while this process builds `path`: processes starting together (a parallel test run, tensor-
    parallel ranks) build it once, the others waiting, rather than each compiling the same source."""
    try:
        import fcntl
    except ImportError:  # Windows: they build it side by side, each ending in an atomic rename
        yield
        return
    with open(path + ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when f closes
        yield


def cpu_kernel(dtype, D: int, Hkv: int, G: int, compiler: str, E: int = 1):
    """The compiled decode_attention for (dtype, head_dim, kv heads, G, queries a request), or None where it
    cannot be built."""
    key = ("attention", dtype, D, Hkv, G, E)
    if key not in _cpu_kernels:
        import ctypes
        elem = {torch.bfloat16: ("uint16_t", ["-DBF16"]), torch.float32: ("float", [])}[dtype]
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        _cpu_kernels[key] = build_c("decode_attention", CPU_DECODE_SRC % {"D": D, "G": G, "HKV": Hkv, "E": E},
                                    CPU_KERNEL_FLAGS + [f"-DELEM={elem[0]}"] + elem[1], compiler,
                                    "decode_attention", [p, p, p, p, p, p, i64, i64, ctypes.c_float, p,
                                                         ctypes.c_int])
    return _cpu_kernels[key]


def decode_attention_cpu(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, sm_scale,
                         compiler: str = "cc"):
    """decode_attention_ref in C on CPU tensors (bf16 or fp32 pools, int32 req_to_token, contiguous);
    None where the kernel cannot be built here (the caller falls back to torch). seq_lens >= 1. With E
    = len(q) / len(req_pool_indices) > 1 it is a verify's: request b's queries are rows b * E + e, and
    query e is a decode of length seq_lens[b] - E + 1 + e (its position's keys and those before)."""
    N, Hq, D = q.shape
    B, Hkv = len(req_pool_indices), k_cache.shape[1]
    _check_pool(k_cache, v_cache, D)
    assert q.dtype == k_cache.dtype == v_cache.dtype and q.is_contiguous() and k_cache.is_contiguous()
    assert v_cache.is_contiguous() and req_to_token.dtype == torch.int32 and req_to_token.is_contiguous()
    assert N % B == 0, f"{N} queries for {B} requests"
    fn = cpu_kernel(q.dtype, D, Hkv, Hq // Hkv, compiler, E=N // B)
    if fn is None:
        return None
    rows = req_pool_indices.to(torch.int64).contiguous()
    lens = seq_lens.to(torch.int64).contiguous()
    o = torch.empty_like(q)
    fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), req_to_token.data_ptr(), rows.data_ptr(),
       lens.data_ptr(), B, req_to_token.shape[1], float(sm_scale), o.data_ptr(), torch.get_num_threads())
    return o


# ----------------------------------------------------------------------------------------------
# CPU: quantized matmul with integer dot products (C, AVX512-VNNI or AVX2)
#
# One request decodes at the speed the weights stream from memory, and torch's weight-only int4/int8
# kernels read them at a third of it and cost M times one token for M tokens (a verify's 1 + k). This is
# llama.cpp's way (Q4_1 / Q8_0 weights times rounded activations): each block of 32 activations is
# rounded to Q_STEPS steps of its own scale, 15 bits kept as two int8 halves (llama.cpp's 8 bits moved
# SmolLM2's answers), and vpdpbusd multiplies 64 unsigned weight codes by 64 signed bytes of a half and
# adds them in fours, 16 int32 sums at once. The weights sit in tiles of 16 output rows by 32 inputs, in
# the order they are read: lane n of a 64-byte vector holds row n's codes of four consecutive inputs, so
# one broadcast of four activation bytes feeds all 16 rows, and no sum crosses lanes. After the codes
# come the tile's 16 scales and 16 minimums in fp16: weight = code * scale + minimum, so a block's dot
# product is d * (scale * sum(code * xq) + minimum * sum(xq)), d the activations' scale. A tile is read
# once for up to 8 tokens; OpenMP splits the 16-row tiles over torch's threads. With AVX512 a thread asks
# the cache for the tile AHEAD tiles on as it reads one: the hardware's prefetch alone leaves the
# multiplies waiting on memory. Without VNNI, AVX2 makes the same int32 sums: vpmaddubsw and vpmaddwd from
# 4-bit codes, vpmaddwd from 8-bit codes widened to int16 times the whole 15-bit activations; the float
# steps after them are the same, and so are the bits (its kernels do not prefetch).

Q_BLOCK = 32  # inputs per weight scale and per activation scale
Q_STEPS = 127 * 254  # an activation block's steps from 0 to its largest |x|: 15 bits, two int8 halves
Q_MATMUL_FLAGS = [f for f in CPU_KERNEL_FLAGS if f != "-ffast-math"]  # the rounding of x is the spec's

CPU_MATMUL_SRC = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <immintrin.h>
#define BITS %(BITS)d
#define CODES (BITS * 64)  /* a tile's codes: 16 rows x 32 inputs of BITS bits (4: two codes a byte) */
#define TILE (CODES + 64)  /* then its 16 scales and 16 minimums, fp16 */
#define MMAX 8             /* tokens a read of a tile serves */
#define AHEAD 4            /* tiles ahead of the one it reads that a thread asks the cache for */
#define STEPS %(STEPS)d.0f     /* Q_STEPS */
#define ALWAYS_INLINE __attribute__((always_inline))

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
static inline __m256i to_bf16(__m512 f) {  /* round to nearest even */
    __m512i u = _mm512_castps_si512(f);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}

/* rows 16 rb .. 16 rb + 15 of tokens m0 .. m0 + mn - 1: vpdpbusd, 16 rows at once */
static inline ALWAYS_INLINE void row_block(const int8_t *xq, const int16_t *xw, const float *d,
                                           const float *dsum, const uint8_t *w, int64_t rb, int64_t m0,
                                           int mn, int64_t N, int64_t KB, uint16_t *out) {
    __m512 acc[MMAX];
    for (int m = 0; m < mn; m++) acc[m] = _mm512_setzero_ps();
    const uint8_t *t = w + rb * KB * TILE;
    for (int64_t kb = 0; kb < KB; kb++, t += TILE) {
        for (int l = 0; l < TILE; l += 64) __builtin_prefetch(t + AHEAD * TILE + l);
        __m512i c[8];  /* c[v], lane n: row n's codes of inputs 4v .. 4v + 3 */
#if BITS == 4
        for (int p = 0; p < 4; p++) {  /* low nibbles: inputs 0-15, high: 16-31 */
            __m512i packed = _mm512_loadu_si512(t + 64 * p);
            c[p] = _mm512_and_si512(packed, _mm512_set1_epi8(0x0F));
            c[p + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), _mm512_set1_epi8(0x0F));
        }
#else
        for (int v = 0; v < 8; v++) c[v] = _mm512_loadu_si512(t + 64 * v);
#endif
        __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(t + CODES)));
        __m512 minimum = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(t + CODES + 32)));
        for (int m = 0; m < mn; m++) {
            const int64_t i = (m0 + m) * KB + kb;
            const int32_t *hi = (const int32_t *)(xq + i * 64), *lo = hi + 8;
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
            for (int v = 0; v < 8; v++) {
                s0 = _mm512_dpbusd_epi32(s0, c[v], _mm512_set1_epi32(hi[v]));
                s1 = _mm512_dpbusd_epi32(s1, c[v], _mm512_set1_epi32(lo[v]));
            }
            __m512 dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_set1_ps(254.0f),
                                         _mm512_cvtepi32_ps(s1));
            acc[m] = _mm512_fmadd_ps(dot, _mm512_mul_ps(scale, _mm512_set1_ps(d[i])), acc[m]);
            acc[m] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(dsum[i]), acc[m]);
        }
    }
    for (int m = 0; m < mn; m++)
        _mm256_storeu_si256((__m256i *)(out + (m0 + m) * N + rb * 16), to_bf16(acc[m]));
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
static inline __m128i to_bf16(__m256 f) {  /* round to nearest even */
    __m256i u = _mm256_castps_si256(f);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
}

#if BITS == 4
/* sum over v of lane n's four codes of c[v] times the four bytes x[v]: vpmaddubsw multiplies pairs into
   int16 (|a pair| <= 2 * 15 * 127, |8 of them| <= 30480: no saturation) and vpmaddwd adds the int16
   pairs of a lane, the int32 sums vpdpbusd gives */
static inline __m256i nibble_dot(const __m256i c[8], const int32_t *x) {
    __m256i s = _mm256_setzero_si256();
    for (int v = 0; v < 8; v++) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(c[v], _mm256_set1_epi32(x[v])));
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
}

/* 4-bit codes: the AVX512 path's integers, 8 rows (half a tile's vector) at a time */
static inline ALWAYS_INLINE void row_block(const int8_t *xq, const int16_t *xw, const float *d,
                                           const float *dsum, const uint8_t *w, int64_t rb, int64_t m0,
                                           int mn, int64_t N, int64_t KB, uint16_t *out) {
    for (int h = 0; h < 2; h++) {  /* rows 16 rb + 8 h .. + 7: bytes 32 h .. 32 h + 31 of each vector */
        __m256 acc[MMAX];
        for (int m = 0; m < mn; m++) acc[m] = _mm256_setzero_ps();
        const uint8_t *t = w + rb * KB * TILE;
        for (int64_t kb = 0; kb < KB; kb++, t += TILE) {
            __m256i c[8];  /* c[v], lane n: row n's codes of inputs 4v .. 4v + 3 */
            for (int p = 0; p < 4; p++) {
                __m256i packed = _mm256_loadu_si256((const __m256i *)(t + 64 * p + 32 * h));
                c[p] = _mm256_and_si256(packed, _mm256_set1_epi8(0x0F));
                c[p + 4] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), _mm256_set1_epi8(0x0F));
            }
            __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + CODES + 16 * h)));
            __m256 minimum = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + CODES + 32 + 16 * h)));
            for (int m = 0; m < mn; m++) {
                const int64_t i = (m0 + m) * KB + kb;
                const int32_t *hi = (const int32_t *)(xq + i * 64), *lo = hi + 8;
                __m256i s0 = nibble_dot(c, hi), s1 = nibble_dot(c, lo);
                __m256 dot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_set1_ps(254.0f),
                                             _mm256_cvtepi32_ps(s1));
                acc[m] = _mm256_fmadd_ps(dot, _mm256_mul_ps(scale, _mm256_set1_ps(d[i])), acc[m]);
                acc[m] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(dsum[i]), acc[m]);
            }
        }
        for (int m = 0; m < mn; m++)
            _mm_storeu_si128((__m128i *)(out + (m0 + m) * N + rb * 16 + 8 * h), to_bf16(acc[m]));
    }
}

#else
#define WHOLE_STEPS  /* x rounded as int16, not as two bytes */
/* 8-bit codes: vpmaddwd on the codes widened to int16 and the activations' whole 15-bit steps (xw), pairs
   summed into int32 (|32 * 255 * 32258| < 2^31). A group of 4 rows: its 16 bytes of a vector, widened, are
   those rows' codes of 4 inputs, times the 4 activations broadcast; vphaddd then adds each row's two pair
   sums, at the end of the tile. One token widens each group's codes as it goes; more widen a group's 8
   vectors once and take the tokens through them (SmolLM2's 121 matrices from memory, 2-core AMD EPYC:
   5 tokens 12.9 against 16.0 ms, 8 tokens 19.3 against 24.7) */
static inline __m256i codes16(const uint8_t *t, int v, int g) {  /* rows 4g .. 4g + 3, inputs 4v .. 4v + 3 */
    return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(t + 64 * v + 16 * g)));
}

static inline __m256i four_steps(const int16_t *x) {  /* x[0 .. 3] in each 64-bit lane */
    int64_t four;
    memcpy(&four, x, 8);
    return _mm256_set1_epi64x(four);
}

static inline ALWAYS_INLINE void row_block(const int8_t *xq, const int16_t *xw, const float *d,
                                           const float *dsum, const uint8_t *w, int64_t rb, int64_t m0,
                                           int mn, int64_t N, int64_t KB, uint16_t *out) {
    __m256 acc[MMAX][2];  /* rows 16 rb .. + 7 and 16 rb + 8 .. + 15 */
    for (int m = 0; m < mn; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    const uint8_t *t = w + rb * KB * TILE;
    for (int64_t kb = 0; kb < KB; kb++, t += TILE) {
        __m256i s[MMAX][4];  /* s[m][g], lane 2r + p: row 4g + r, inputs 2p, 2p + 1 of each four */
        if (mn == 1) {
            for (int g = 0; g < 4; g++) s[0][g] = _mm256_setzero_si256();
            for (int v = 0; v < 8; v++) {
                const __m256i x = four_steps(xw + (m0 * KB + kb) * 32 + 4 * v);
                for (int g = 0; g < 4; g++)
                    s[0][g] = _mm256_add_epi32(s[0][g], _mm256_madd_epi16(codes16(t, v, g), x));
            }
        } else {
            for (int g = 0; g < 4; g++) {
                __m256i c[8];
                for (int v = 0; v < 8; v++) c[v] = codes16(t, v, g);
                for (int m = 0; m < mn; m++) {
                    const int16_t *x = xw + ((m0 + m) * KB + kb) * 32;
                    s[m][g] = _mm256_setzero_si256();
                    for (int v = 0; v < 8; v++)
                        s[m][g] = _mm256_add_epi32(s[m][g], _mm256_madd_epi16(c[v], four_steps(x + 4 * v)));
                }
            }
        }
        for (int m = 0; m < mn; m++) {
            const int64_t i = (m0 + m) * KB + kb;
            for (int h = 0; h < 2; h++) {  /* vphaddd's rows 0 1 4 5 | 2 3 6 7, put in order */
                __m256i dot = _mm256_hadd_epi32(s[m][2 * h], s[m][2 * h + 1]);
                dot = _mm256_permute4x64_epi64(dot, 0xD8);
                __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + CODES + 16 * h)));
                __m256 minimum = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + CODES + 32 + 16 * h)));
                __m256 step = _mm256_mul_ps(scale, _mm256_set1_ps(d[i]));
                acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), step, acc[m][h]);
                acc[m][h] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(dsum[i]), acc[m][h]);
            }
        }
    }
    for (int m = 0; m < mn; m++)
        for (int h = 0; h < 2; h++)
            _mm_storeu_si128((__m128i *)(out + (m0 + m) * N + rb * 16 + 8 * h), to_bf16(acc[m][h]));
}
#endif

#else
#error "the integer dot products need AVX512-VNNI or AVX2"
#endif

/* out (M, N) bf16 = x (M, K) bf16 times w's transpose; w: (N / 16, K / 32) tiles of TILE bytes */
void q_matmul(const uint16_t *x, const uint8_t *w, int64_t M, int64_t N, int64_t K, uint16_t *out,
              int threads) {
    const int64_t KB = K / 32;
    /* x rounded: xq = round(x / d), d = max |x| / STEPS of its block, as two bytes, xq = 254 * high + low,
       both in [-127, 127]; or whole, xw, where WHOLE_STEPS (AVX2's 8-bit codes) */
#ifdef WHOLE_STEPS
    int8_t *xq = NULL;
    int16_t *xw = malloc(2 * M * K);
#else
    int8_t *xq = malloc(2 * M * K);
    int16_t *xw = NULL;
#endif
    float *d = malloc(M * KB * sizeof(float));
    float *dsum = malloc(M * KB * sizeof(float));  /* d * sum(xq) */
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < M * KB; i++) {
            /* loops the compiler vectorizes (fmaxf kept them scalar: 1.1 ms of 5 tokens' 17 through the
               EPYC's int8 matrices): the bits of the largest |x|, as finite floats order as their bits do */
            uint16_t top = 0;
            for (int j = 0; j < 32; j++) {
                const uint16_t a = x[i * 32 + j] & 0x7FFF;
                top = a > top ? a : top;
            }
            const float amax = bf16_to_float(top), inv = amax > 0.0f ? STEPS / amax : 0.0f;
            int sum = 0;
            for (int j = 0; j < 32; j++) {
                int v = (int)nearbyintf(bf16_to_float(x[i * 32 + j]) * inv);
#ifdef WHOLE_STEPS
                xw[i * 32 + j] = (int16_t)v;
#else
                int high = (int)nearbyintf(v / 254.0f);
                xq[i * 64 + j] = (int8_t)high;
                xq[i * 64 + 32 + j] = (int8_t)(v - 254 * high);
#endif
                sum += v;
            }
            d[i] = amax / STEPS;
            dsum[i] = d[i] * (float)sum;
        }
        #pragma omp for schedule(static)
        for (int64_t rb = 0; rb < N / 16; rb++)
            for (int64_t m0 = 0; m0 < M; m0 += MMAX)
                /* a copy of row_block for each count of tokens, its loops over them unrolled: one token
                   1.4x faster (AVX2, 8-bit codes from the cache; 4-bit 1.2x), the same bits */
                switch (M - m0 < MMAX ? (int)(M - m0) : MMAX) {
#define TOKENS(mn) case mn: row_block(xq, xw, d, dsum, w, rb, m0, mn, N, KB, out); break;
                TOKENS(1) TOKENS(2) TOKENS(3) TOKENS(4) TOKENS(5) TOKENS(6) TOKENS(7) TOKENS(8)
                }
    }
    free(xq); free(xw); free(d); free(dsum);
}
"""


def q_matmul_kernel(bits: int, compiler: str):
    """The compiled q_matmul for 4- or 8-bit codes, or None where it cannot be built (no AVX512-VNNI,
    no AVX2)."""
    key = ("matmul", bits)
    if key not in _cpu_kernels:
        import ctypes
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        src = CPU_MATMUL_SRC % {"BITS": bits, "STEPS": Q_STEPS}
        _cpu_kernels[key] = build_c(f"q{bits}_matmul", src, Q_MATMUL_FLAGS, compiler, "q_matmul",
                                    [p, p, i64, i64, i64, p, ctypes.c_int])
    return _cpu_kernels[key]


def pack_q_tiles(codes, scale, minimum, bits: int):
    """codes (N, K) in [0, 2**bits), scale and minimum (N, K / Q_BLOCK) -> the kernel's (N / 16, K / 32,
    TILE) uint8 tiles, for the weights codes * scale + minimum (scale and minimum kept in fp16)."""
    N, K = codes.shape
    assert N % 16 == 0 and K % Q_BLOCK == 0 and bits in (4, 8), (N, K, bits)
    c = codes.to(torch.uint8)
    if bits == 4:  # byte (p, n, t): input 4p + t of row n in the low nibble, input 16 + 4p + t in the high
        c = c.view(N // 16, 16, K // 32, 2, 4, 4).permute(0, 2, 3, 4, 1, 5)
        c = c[:, :, 0] | (c[:, :, 1] << 4)
    else:  # byte (v, n, t): input 4v + t of row n
        c = c.view(N // 16, 16, K // 32, 8, 4).permute(0, 2, 3, 1, 4)
    def fp16(a):  # (N, K / 32) -> (N / 16, K / 32, 16 rows) fp16, as bytes
        return a.view(N // 16, 16, K // 32).transpose(1, 2).half().contiguous().view(torch.uint8)
    c = c.reshape(N // 16, K // 32, bits * 64)
    return torch.cat([c, fp16(scale), fp16(minimum)], dim=-1).contiguous()


def q_matmul_ref(x, codes, scale, minimum):
    """q_matmul's spec in x's dtype: x rounded per block of 32 to Q_STEPS steps from 0 to the block's
    largest |x| (half to even, x * (Q_STEPS / max |x|) in fp32 as the kernel computes it), times the
    weights codes * scale + minimum with scale and minimum rounded to fp16."""
    M, K = x.shape
    blocks = x.view(M, K // Q_BLOCK, Q_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inv = torch.full_like(amax, Q_STEPS, dtype=torch.float32) / amax.float()  # (c / t is 1 / t * c in torch)
    steps = torch.where(amax > 0, torch.round(blocks.float() * inv), 0).to(x.dtype)
    w = codes.to(x.dtype).view(len(codes), K // Q_BLOCK, Q_BLOCK) * scale.half().to(x.dtype)[..., None]
    return (steps * amax / Q_STEPS).view(M, K) @ (w + minimum.half().to(x.dtype)[..., None]).view(-1, K).T


def q_matmul_cpu(x, tiles, bits: int, compiler: str = "cc"):
    """x (M, K) bf16 times the weights that pack_q_tiles packed into `tiles`: (M, N) bf16; None where the
    kernel cannot be built here (the caller falls back to torch)."""
    fn = q_matmul_kernel(bits, compiler)
    if fn is None:
        return None
    M, K = x.shape
    assert x.dtype == torch.bfloat16 and x.is_contiguous() and tiles.shape[1] * Q_BLOCK == K, tiles.shape
    out = torch.empty(M, tiles.shape[0] * 16, dtype=torch.bfloat16)
    fn(x.data_ptr(), tiles.data_ptr(), M, out.shape[1], K, out.data_ptr(), torch.get_num_threads())
    return out


# ----------------------------------------------------------------------------------------------
# CPU: a GGUF file's own blocks times float32 activations (C, AVX2)
#
# A GGUF stores a linear layer's weights in blocks of 32 inputs: Q4_1 as 4-bit codes q with a scale d and
# a minimum m (weight = d * q + m), Q4_0 as d * (q - 8), Q8_0 as d * q with signed 8-bit q; d and m in fp16.
# These are the float model's weights, exactly. gguf_matmul multiplies them in float32, activations and
# sums, reading each block once for all of a call's rows: a block's dot product is d * sum(q * x) + m *
# sum(x), sum(q * x) from the codes converted to float (exact) and sum(x) once per block and row. Each row's
# sums go in one order, whatever the number of rows beside it: a row's result has the same bits alone or
# in a batch. One token reads 20 bytes a block (Q4_0: 18, Q8_0: 34), as llama.cpp does, at about the speed
# memory streams them.
#
# The layout (pack_gguf_tiles), "lanes are rows": tiles of 8 output rows, and per tile and block of 32
# inputs, 8 vectors of 8 lanes where lane n is row n, so one broadcast activation feeds 8 rows and no sum
# crosses lanes. 4-bit: 4 vectors of int32 lanes, vector g holding row n's codes of inputs 8g .. 8g + 7
# (input 8g + k in bits 4k .. 4k + 3), then the 8 rows' d and m in fp16 (Q4_0: m = -8 d, exact). A code is
# taken out with one AND (0xF << 4k) and converted as it sits, q * 16^k, against an activation pre-scaled
# by 16^-k (both exact); the top one with a shift. 8-bit: 32 groups of 8 signed bytes, group i the 8 rows'
# codes of input i (vpmovsxbd widens them), then d.

GGUF_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}  # ggml's type numbers of the blocks gguf_matmul reads
GGUF_BLOCK_BYTES = {2: 18, 3: 20, 8: 34}  # a block of 32 weights in the file, by type number
GGUF_ROWS = 8  # output rows a tile
GGUF_TILE = {2: 160, 3: 160, 8: 272}  # bytes a tile's block takes: its codes, d (and m)
GGUF_FLAGS = [f for f in CPU_KERNEL_FLAGS if f != "-ffast-math"]  # every sum in the order written

GGUF_MATMUL_SRC = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>
#if !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#error "gguf_matmul needs AVX2, FMA and F16C"
#endif
#include <omp.h>
#define INLINE static inline __attribute__((always_inline))
#define ROWS 8
#define AHEAD 2048  /* bytes ahead of the block it reads that a thread asks the cache for */
#define CHUNK 32    /* rows of x a pass over a tile serves, their sums kept on the stack */

/* Each function that takes `bits` (4 or 8) is inlined where it is called with a constant: one copy a
   width, no branch on it in a loop. */
INLINE int64_t tile_bytes(int bits) { return bits == 4 ? 160 : 272; }  /* a tile's block: codes, d (, m) */
INLINE int64_t file_block_bytes(int type) { return type == 8 ? 34 : type == 3 ? 20 : 18; }  /* in the file */

/* x (M, K) -> xs: each row's copy, for 4-bit codes scaled (input 8g + k times 16^-k, k < 7), and sx
   (M, K / 32), the sum of each block of 32 inputs, in a fixed order */
INLINE void prepare(int bits, const float *x, int64_t M, int64_t K, float *xs, float *sx) {
    const __m256 scale = bits == 4 ? _mm256_setr_ps(1.0f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f,
                                                    0x1p-24f, 1.0f) : _mm256_set1_ps(1.0f);
    for (int64_t i = 0; i < M * K; i += 8)
        _mm256_storeu_ps(xs + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), scale));
    for (int64_t i = 0; i < M * K / 32; i++) {
        const float *b = x + 32 * i;
        __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(b), _mm256_loadu_ps(b + 8)),
                                 _mm256_add_ps(_mm256_loadu_ps(b + 16), _mm256_loadu_ps(b + 24)));
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        sx[i] = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
    }
}

/* code i of a block t (of the tile's 8 rows) as floats: 4-bit, times 16^(i % 8) for i % 8 < 7 */
INLINE __m256 code(int bits, const uint8_t *t, int i) {
    if (bits == 8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(t + 8 * i))));
    const __m256i v = _mm256_loadu_si256((const __m256i *)(t + 32 * (i / 8)));
    const int k = i % 8;
    return _mm256_cvtepi32_ps(k < 7 ? _mm256_and_si256(v, _mm256_set1_epi32(15 << (4 * k)))
                                    : _mm256_srli_epi32(v, 28));
}

/* s[g], the sum over group g of block t's 32 inputs (inputs 8g .. 8g + 7) of code * x for the 8 rows: one
   chain a group, in input order, the four groups side by side (four chains in flight: the loop runs at
   the rate it issues instructions, not at the latency of one), each code converted as it is used */
INLINE void block_dot(int bits, const uint8_t *t, const float *x, __m256 *s) {
    for (int g = 0; g < 4; g++) s[g] = _mm256_mul_ps(code(bits, t, 8 * g), _mm256_broadcast_ss(x + 8 * g));
    for (int k = 1; k < 8; k++)
        for (int g = 0; g < 4; g++)
            s[g] = _mm256_fmadd_ps(code(bits, t, 8 * g + k), _mm256_broadcast_ss(x + 8 * g + k), s[g]);
}

/* block b's m (the 8 rows' minimum, 4-bit codes) times its sum of x, into the running sums of rows 0 ..
   mn - 1 (sx: KB sums a row) */
INLINE void add_m(const uint8_t *t, const float *sx, int64_t KB, int64_t b, int mn, __m256 *macc) {
    const __m256 mb = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + 144)));
    for (int m = 0; m < mn; m++) macc[m] = _mm256_fmadd_ps(mb, _mm256_broadcast_ss(sx + m * KB + b), macc[m]);
}

/* a row's running sums (acc: a group's, across blocks, each times its block's d; macc: m times the block's
   sum of x) -> its 8 outputs */
INLINE __m256 row_sum(const __m256 *acc, __m256 macc) {
    return _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])), macc);
}

#ifdef __AVX512F__
/* codes k of groups h and h + 1 of block t as 16 floats (lanes 0-7 group h's 8 rows, 8-15 group h + 1's):
   code(bits, t, 8h + k) beside code(bits, t, 8h + 8 + k); v: the two groups' 4-bit codes */
INLINE __m512 code2(int bits, const uint8_t *t, __m512i v, int h, int k) {
    if (bits == 8) {
        const uint8_t *c = t + 8 * (8 * h + k);
        const __m128i two = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)c),
                                               _mm_loadl_epi64((const __m128i *)(c + 64)));
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(two));
    }
    return _mm512_cvtepi32_ps(k < 7 ? _mm512_and_si512(v, _mm512_set1_epi32(15 << (4 * k)))
                                    : _mm512_srli_epi32(v, 28));
}

/* lane[k]: for each half's 8 lanes, the index of its group's input k in 16 inputs (groups 2h, 2h + 1) */
INLINE void group_lanes(__m512i *lane) {
    for (int k = 0; k < 8; k++)
        lane[k] = _mm512_add_epi32(_mm512_set1_epi32(k),
                                   _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 8, 8, 8, 8, 8, 8));
}

/* block t's d (the 8 rows' scales) in both halves of a vector */
INLINE __m512 d_twice(int bits, const uint8_t *t) {
    const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + 32 * bits)));
    const __m512 d = _mm512_castps256_ps512(d8);
    return _mm512_shuffle_f32x4(d, d, 0x44);
}

/* row_sum of sums held two groups a vector: (acc0 + acc1) + (acc2 + acc3), then + macc */
INLINE __m256 pair_sum(const __m512 *acc, __m256 macc) {
    __m256 a[2];
    for (int h = 0; h < 2; h++)
        a[h] = _mm256_add_ps(_mm512_castps512_ps256(acc[h]),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[h]), 1)));
    return _mm256_add_ps(_mm256_add_ps(a[0], a[1]), macc);
}

/* one_row with two groups a vector: each lane's operations are one_row's, in its order (the same bits) */
INLINE void one_row(int bits, const float *xs, const float *sx, const uint8_t *t, int64_t KB, float *y) {
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    __m256 macc = _mm256_setzero_ps();
    __m512i lane[8];
    group_lanes(lane);
    for (int64_t b = 0; b < KB; b++, t += tile_bytes(bits)) {
        for (int l = 0; l < tile_bytes(bits); l += 64) _mm_prefetch((const char *)t + AHEAD + l, _MM_HINT_T0);
        const __m512 d = d_twice(bits, t);
        for (int h = 0; h < 2; h++) {  /* groups 2h and 2h + 1 */
            const __m512 x = _mm512_loadu_ps(xs + 32 * b + 16 * h);
            const __m512i v = bits == 4 ? _mm512_loadu_si512(t + 64 * h) : _mm512_setzero_si512();
            __m512 s = _mm512_mul_ps(code2(bits, t, v, 2 * h, 0), _mm512_permutexvar_ps(lane[0], x));
            for (int k = 1; k < 8; k++)
                s = _mm512_fmadd_ps(code2(bits, t, v, 2 * h, k), _mm512_permutexvar_ps(lane[k], x), s);
            acc[h] = _mm512_fmadd_ps(s, d, acc[h]);
        }
        if (bits == 4) add_m(t, sx, KB, b, 1, &macc);
    }
    _mm256_storeu_ps(y, pair_sum(acc, macc));
}
#else
/* one row of x through one tile: its 8 outputs into y, the sums held in registers */
INLINE void one_row(int bits, const float *xs, const float *sx, const uint8_t *t, int64_t KB, float *y) {
    __m256 acc[4], macc = _mm256_setzero_ps(), s[4];
    for (int g = 0; g < 4; g++) acc[g] = _mm256_setzero_ps();
    for (int64_t b = 0; b < KB; b++, t += tile_bytes(bits)) {
        for (int l = 0; l < tile_bytes(bits); l += 64) _mm_prefetch((const char *)t + AHEAD + l, _MM_HINT_T0);
        block_dot(bits, t, xs + 32 * b, s);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + 32 * bits)));
        for (int g = 0; g < 4; g++) acc[g] = _mm256_fmadd_ps(s[g], d, acc[g]);
        if (bits == 4) add_m(t, sx, KB, b, 1, &macc);
    }
    _mm256_storeu_ps(y, row_sum(acc, macc));
}
#endif

#ifdef __AVX512F__
/* many_rows with two groups a vector, as one_row here: each lane's operations are the AVX2 path's */
INLINE void many_rows(int bits, const float *xs, const float *sx, const uint8_t *t, int64_t K, int mn,
                      float *y) {
    const int64_t KB = K / 32;
    __m512 acc[CHUNK][2];
    __m256 macc[CHUNK];
    __m512i lane[8];
    group_lanes(lane);
    for (int m = 0; m < mn; m++) {
        macc[m] = _mm256_setzero_ps();
        acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < KB; b++, t += tile_bytes(bits)) {
        const __m512 d = d_twice(bits, t);
        for (int h = 0; h < 2; h++) {
            const __m512i v = bits == 4 ? _mm512_loadu_si512(t + 64 * h) : _mm512_setzero_si512();
            __m512 c[8];
            for (int k = 0; k < 8; k++) c[k] = code2(bits, t, v, 2 * h, k);
            for (int m = 0; m < mn; m++) {
                const __m512 x = _mm512_loadu_ps(xs + m * K + 32 * b + 16 * h);
                __m512 s = _mm512_mul_ps(c[0], _mm512_permutexvar_ps(lane[0], x));
                for (int k = 1; k < 8; k++) s = _mm512_fmadd_ps(c[k], _mm512_permutexvar_ps(lane[k], x), s);
                acc[m][h] = _mm512_fmadd_ps(s, d, acc[m][h]);
            }
        }
        if (bits == 4) add_m(t, sx, KB, b, mn, macc);
    }
    for (int m = 0; m < mn; m++) _mm256_storeu_ps(y + ROWS * m, pair_sum(acc[m], macc[m]));
}
#else
/* rows 0 .. mn - 1 of x through one tile, each group's 8 codes converted once for them all and held in
   registers while the rows pass: for each row the operations of one_row, in its order */
INLINE void many_rows(int bits, const float *xs, const float *sx, const uint8_t *t, int64_t K, int mn,
                      float *y) {
    const int64_t KB = K / 32;
    __m256 acc[CHUNK][4], macc[CHUNK];
    for (int m = 0; m < mn; m++) {
        macc[m] = _mm256_setzero_ps();
        for (int g = 0; g < 4; g++) acc[m][g] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < KB; b++, t += tile_bytes(bits)) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + 32 * bits)));
        for (int g = 0; g < 4; g++) {
            __m256 c[8];
            for (int k = 0; k < 8; k++) c[k] = code(bits, t, 8 * g + k);
            for (int m = 0; m < mn; m++) {  /* block_dot's chain of group g */
                const float *x = xs + m * K + 32 * b + 8 * g;
                __m256 s = _mm256_mul_ps(c[0], _mm256_broadcast_ss(x));
                for (int k = 1; k < 8; k++) s = _mm256_fmadd_ps(c[k], _mm256_broadcast_ss(x + k), s);
                acc[m][g] = _mm256_fmadd_ps(s, d, acc[m][g]);
            }
        }
        if (bits == 4) add_m(t, sx, KB, b, mn, macc);
    }
    for (int m = 0; m < mn; m++) _mm256_storeu_ps(y + ROWS * m, row_sum(acc[m], macc[m]));
}
#endif

/* tiles r0 .. r1 - 1 of w for the M rows of x prepared in xs and sx: out (M, N), N padded up to whole tiles
   in w, the padding left out of out */
INLINE void tiles(int bits, const float *xs, const float *sx, const uint8_t *w, int64_t M, int64_t N,
                  int64_t K, int64_t r0, int64_t r1, float *out) {
    const int64_t KB = K / 32;
    for (int64_t r = r0; r < r1; r++) {
        const int64_t n0 = r * ROWS, nn = N - n0 < ROWS ? N - n0 : ROWS;
        const uint8_t *t = w + r * KB * tile_bytes(bits);
        for (int64_t m0 = 0; m0 < M; m0 += CHUNK) {
            const int mn = M - m0 < CHUNK ? (int)(M - m0) : CHUNK;
            float y[CHUNK * ROWS];
            if (mn == 1)
                one_row(bits, xs + m0 * K, sx + m0 * KB, t, KB, y);
            else
                many_rows(bits, xs + m0 * K, sx + m0 * KB, t, K, mn, y);
            for (int m = 0; m < mn; m++) memcpy(out + (m0 + m) * N + n0, y + ROWS * m, nn * sizeof(float));
        }
    }
}

static void tiles4(const float *xs, const float *sx, const uint8_t *w, int64_t M, int64_t N, int64_t K,
                   int64_t r0, int64_t r1, float *out) { tiles(4, xs, sx, w, M, N, K, r0, r1, out); }
static void tiles8(const float *xs, const float *sx, const uint8_t *w, int64_t M, int64_t N, int64_t K,
                   int64_t r0, int64_t r1, float *out) { tiles(8, xs, sx, w, M, N, K, r0, r1, out); }

/* out (M, N) float32 = x (M, K) float32 times the weights in w's tiles of `bits`-bit codes */
void gguf_matmul(const float *x, const uint8_t *w, int64_t M, int64_t N, int64_t K, int bits, float *out,
                 int threads) {
    float *xs = malloc(M * K * sizeof(float)), *sx = malloc(M * K / 32 * sizeof(float));
    if (bits == 4) prepare(4, x, M, K, xs, sx); else prepare(8, x, M, K, xs, sx);
    const int64_t T = (N + ROWS - 1) / ROWS;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < T; r++)
        (bits == 4 ? tiles4 : tiles8)(xs, sx, w, M, N, K, r, r + 1, out);
    free(xs);
    free(sx);
}

/* -- float32 and bf16 weights in the same order: float_matmul --
   The weights in tiles of 8 outputs, input-major (a tile: K vectors of 8, bf16 or float32), two tiles a
   task. Every output is one chain of fused multiply-adds over its inputs in ascending order, begun at
   zero, whatever the number of rows: a row's bits do not depend on the rows beside it. Up to six rows
   share each vector of weights read (12 sums in registers); the inputs go in passes of FKC, the pass's
   weights staying in L1 over a task's rows, each sum continued where the last pass left it. A task takes
   FMC rows: a decode batch of up to 96 reads each weight once. */
#define FMR 6     /* rows of x a register block holds */
#define FKC 256   /* inputs a pass takes */
#define FMC 96    /* rows of x a task takes */
#define FG 16     /* outputs a task takes: two tiles */

/* weights i .. i + 7 of a tile, as floats */
INLINE __m256 fvec(int bf16, const void *w, int64_t i) {
    if (bf16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i))), 16));
    return _mm256_loadu_ps((const float *)w + i);
}

/* R rows (1 to 6, a constant where inlined) at x, K apart, times the two tiles at w, inputs k0 .. k1 - 1:
   each row's 16 sums (acc, 16 floats a row) continued, or begun at zero where k0 is 0; the same chain of
   operations for a row whatever R is */
INLINE void rows_block(int bf16, int R, const float *x, int64_t K, const void *w, int64_t k0, int64_t k1,
                       float *acc) {
#define LD(r, t) (r < R && k0 ? _mm256_loadu_ps(acc + FG * r + ROWS * t) : _mm256_setzero_ps())
#define FMA2(r) if (r < R) { b = _mm256_broadcast_ss(x + r * K + k); \
                a##r##0 = _mm256_fmadd_ps(b, w0, a##r##0); a##r##1 = _mm256_fmadd_ps(b, w1, a##r##1); }
#define ST(r) if (r < R) { _mm256_storeu_ps(acc + FG * r, a##r##0); _mm256_storeu_ps(acc + FG * r + ROWS, \
                                                                                     a##r##1); }
    __m256 a00 = LD(0, 0), a01 = LD(0, 1), a10 = LD(1, 0), a11 = LD(1, 1), a20 = LD(2, 0), a21 = LD(2, 1);
    __m256 a30 = LD(3, 0), a31 = LD(3, 1), a40 = LD(4, 0), a41 = LD(4, 1), a50 = LD(5, 0), a51 = LD(5, 1);
    for (int64_t k = k0; k < k1; k++) {
        const __m256 w0 = fvec(bf16, w, k * ROWS), w1 = fvec(bf16, w, (K + k) * ROWS);
        __m256 b;
        FMA2(0) FMA2(1) FMA2(2) FMA2(3) FMA2(4) FMA2(5)
    }
    ST(0) ST(1) ST(2) ST(3) ST(4) ST(5)
#undef LD
#undef FMA2
#undef ST
}

static void rows_any(int bf16, int R, const float *x, int64_t K, const void *w, int64_t k0, int64_t k1,
                     float *acc) {
#define CASE(r) case r: if (bf16) rows_block(1, r, x, K, w, k0, k1, acc); \
                        else rows_block(0, r, x, K, w, k0, k1, acc); break;
    switch (R) { CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) default: CASE(6) }
#undef CASE
}

/* task (mb, g): rows mb * FMC .. of x through tiles 2g and 2g + 1, into out's columns 16g .. */
static void float_task(int bf16, const float *x, const void *w, int64_t M, int64_t N, int64_t K,
                       int64_t mb, int64_t g, float *out) {
    float acc[FMC * FG];
    const int64_t m0 = mb * FMC, mn = M - m0 < FMC ? M - m0 : FMC;
    const void *wg = (const char *)w + g * 2 * K * ROWS * (bf16 ? 2 : 4);
    for (int64_t k0 = 0; k0 < K; k0 += FKC) {
        const int64_t k1 = K - k0 < FKC ? K : k0 + FKC;
        for (int64_t m = 0; m < mn; m += FMR)
            rows_any(bf16, mn - m < FMR ? (int)(mn - m) : FMR, x + (m0 + m) * K, K, wg, k0, k1,
                     acc + m * FG);
    }
    const int64_t n0 = g * FG, nn = N - n0 < FG ? N - n0 : FG;
    for (int64_t m = 0; m < mn; m++) memcpy(out + (m0 + m) * N + n0, acc + m * FG, nn * sizeof(float));
}

#if defined(__AVX512F__)
/* -- AVX512: float_matmul's wide tiles, float32 or bf16 pairs --
   The weights in tiles of 16 outputs, two tiles a task, each tile K units of 4 bytes a vector of 16: an
   input's float32 weights (wide tiles), or with AVX512-BF16 an input pair's two bf16 weights (pair tiles,
   K even; x rounded to bf16, exact where it is bf16 already, subnormals flushed to zero as vdpbf16ps
   does). Every output is one chain over its units in
   ascending order, begun at zero, whatever the number of rows: a fused multiply-add an input (float32: the
   8-wide tiles' chain, the same bits), or a dot-product-accumulate a pair (vdpbf16ps: the pair's two
   products added to the sum in float32). Up to twelve rows share each vector of weights read (24 sums in
   registers); passes and tasks as float_matmul's. */
#define PMR 12         /* rows of x a register block holds */
#define PG 32          /* outputs a task takes: two tiles of 16 */
#define PKC (FKC / 2)  /* units a pass takes */
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAIRS 1        /* vdpbf16ps, and bf16 stored 16 bits at a time */
#endif
#ifdef PAIRS
#define DPBF16(a, b, w) _mm512_dpbf16_ps(a, (__m512bh)(b), (__m512bh)(w))
#else
#define DPBF16(a, b, w) (a)  /* not reached: float_pairs() is 0 */
#endif

/* R rows (1 to 12, a constant where inlined) of units at x, KU apart, times the two tiles at w, units u0 ..
   u1 - 1: each row's 32 sums (acc) continued, or begun at zero where u0 is 0 */
INLINE void wide_block(int pairs, int R, const uint32_t *x, int64_t KU, const uint32_t *w, int64_t u0,
                       int64_t u1, float *acc) {
    __m512 a[PMR][2];
    #pragma GCC unroll 12
    for (int r = 0; r < R; r++)
        for (int t = 0; t < 2; t++)
            a[r][t] = u0 ? _mm512_loadu_ps(acc + PG * r + 16 * t) : _mm512_setzero_ps();
    for (int64_t u = u0; u < u1; u++) {
        const __m512i w0 = _mm512_loadu_si512(w + 16 * u), w1 = _mm512_loadu_si512(w + 16 * (KU + u));
        #pragma GCC unroll 12
        for (int r = 0; r < R; r++) {
            const __m512i b = _mm512_set1_epi32((int)x[r * KU + u]);
            if (pairs) {
                a[r][0] = DPBF16(a[r][0], b, w0);
                a[r][1] = DPBF16(a[r][1], b, w1);
            } else {
                a[r][0] = _mm512_fmadd_ps(_mm512_castsi512_ps(b), _mm512_castsi512_ps(w0), a[r][0]);
                a[r][1] = _mm512_fmadd_ps(_mm512_castsi512_ps(b), _mm512_castsi512_ps(w1), a[r][1]);
            }
        }
    }
    #pragma GCC unroll 12
    for (int r = 0; r < R; r++)
        for (int t = 0; t < 2; t++) _mm512_storeu_ps(acc + PG * r + 16 * t, a[r][t]);
}

static void wide_any(int pairs, int R, const uint32_t *x, int64_t KU, const uint32_t *w, int64_t u0,
                     int64_t u1, float *acc) {
#define CASE(r) case r: if (pairs) wide_block(1, r, x, KU, w, u0, u1, acc); \
                        else wide_block(0, r, x, KU, w, u0, u1, acc); break;
    switch (R) { CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11)
                 default: CASE(12) }
#undef CASE
}

/* task (mb, g): rows mb * FMC .. of x (KU units a row) through tiles 2g and 2g + 1, into out's columns
   32g .. (float32, or bf16 rounded to nearest even where out_bf16) */
static void wide_task(int pairs, const uint32_t *x, const uint32_t *w, int64_t M, int64_t N, int64_t KU,
                      int64_t mb, int64_t g, void *out, int out_bf16) {
    float acc[FMC * PG];
    const int64_t m0 = mb * FMC, mn = M - m0 < FMC ? M - m0 : FMC;
    const uint32_t *wg = w + g * 2 * KU * 16;
    for (int64_t u0 = 0; u0 < KU; u0 += PKC) {
        const int64_t u1 = KU - u0 < PKC ? KU : u0 + PKC;
        for (int64_t m = 0; m < mn; m += PMR)
            wide_any(pairs, mn - m < PMR ? (int)(mn - m) : PMR, x + (m0 + m) * KU, KU, wg, u0, u1,
                     acc + m * PG);
    }
    const int64_t n0 = g * PG, nn = N - n0 < PG ? N - n0 : PG;
    if (!out_bf16) {
        for (int64_t m = 0; m < mn; m++)
            memcpy((float *)out + (m0 + m) * N + n0, acc + m * PG, nn * sizeof(float));
        return;
    }
#ifdef PAIRS
    const __mmask16 lo = nn < 16 ? (__mmask16)((1u << nn) - 1) : 0xFFFF;
    const __mmask16 hi = nn <= 16 ? 0 : nn < 32 ? (__mmask16)((1u << (nn - 16)) - 1) : 0xFFFF;
    for (int64_t m = 0; m < mn; m++) {
        uint16_t *y = (uint16_t *)out + (m0 + m) * N + n0;
        _mm256_mask_storeu_epi16(y, lo, (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(acc + m * PG)));
        _mm256_mask_storeu_epi16(y + 16, hi, (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(acc + m * PG + 16)));
    }
#endif
}

/* out (M, N) = x (M, K) times wide tiles (mode 4: float32 x and out) or pair tiles (K even; mode 2: x
   float32, rounded to bf16, out float32; mode 3: x and out bf16) */
static void wide_matmul(const void *x, const void *w, int64_t M, int64_t N, int64_t K, int mode, void *out,
                        int threads) {
    uint16_t *xb = mode == 2 ? malloc(M * K * sizeof(uint16_t)) : NULL;
#ifdef PAIRS
    for (int64_t i = 0; mode == 2 && i < M * K; i += 16) {  /* to bf16, rounded to nearest even */
        const __mmask16 live = M * K - i < 16 ? (__mmask16)((1u << (M * K - i)) - 1) : (__mmask16)0xFFFF;
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(live, (const float *)x + i));
        _mm256_mask_storeu_epi16(xb + i, live, h);
    }
#endif
    const uint32_t *units = mode == 2 ? (const uint32_t *)xb : (const uint32_t *)x;
    const int64_t G = (N + PG - 1) / PG, MB = (M + FMC - 1) / FMC, KU = mode == 4 ? K : K / 2;
    #pragma omp parallel for collapse(2) num_threads(threads) schedule(static)
    for (int64_t mb = 0; mb < MB; mb++)
        for (int64_t g = 0; g < G; g++)
            wide_task(mode != 4, units, w, M, N, KU, mb, g, out, mode == 3);
    free(xb);
}
#endif

/* Whether float_matmul takes pair tiles here (modes 2 and 3) */
int float_pairs(void) {
#ifdef PAIRS
    return 1;
#else
    return 0;
#endif
}

/* Whether float_matmul takes wide float32 tiles here (mode 4) */
int float_wide(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* out (M, N) float32 = x (M, K) float32 times w, kernels.pack_float_tiles' tiles (mode): float32 (0), bf16
   (1), bf16 pairs (where float_pairs(): 2, or 3 with x and out in bf16) or wide float32 (4, float_wide()) */
void float_matmul(const float *x, const void *w, int64_t M, int64_t N, int64_t K, int mode, float *out,
                  int threads) {
    if (mode >= 2) {
#if defined(__AVX512F__)
        if (mode == 4 || float_pairs()) {
            wide_matmul(x, w, M, N, K, mode, out, threads);
            return;
        }
#endif
        for (int64_t i = 0; i < M * N; i++) out[i] = NAN;  /* tiles this build cannot read (kernels.py */
        return;                                              /* packs them only where it can) */
    }
    const int64_t G = (N + FG - 1) / FG, MB = (M + FMC - 1) / FMC;
    #pragma omp parallel for collapse(2) num_threads(threads) schedule(static)
    for (int64_t mb = 0; mb < MB; mb++)
        for (int64_t g = 0; g < G; g++)
            float_task(mode, x, w, M, N, K, mb, g, out);
}

/* -- one request's decode step, the whole model in one parallel region --
   The matmuls' tiles are split between the threads. Each thread keeps its own copy of the residual stream
   and computes the few small parts (norms, rotary of the query, the attention's merge, SwiGLU) itself, in
   the same order as every other thread, so that no thread waits while one works: a barrier after each
   matmul and after the attention, five a layer. */

/* out (N) = x (K) times w's tiles, the team's threads taking them in runs that shrink as they go (guided:
   two cores rarely stream at one speed, and the faster takes more), each run read in order; xs and sx:
   this thread's own scratch */
static void team_matvec(int bits, const float *x, const uint8_t *w, int64_t N, int64_t K, float *xs,
                        float *sx, float *out) {
    const int64_t T = (N + ROWS - 1) / ROWS;
    if (bits == 4) {
        prepare(4, x, 1, K, xs, sx);
        #pragma omp for schedule(guided, 4) nowait
        for (int64_t r = 0; r < T; r++) tiles(4, xs, sx, w, 1, N, K, r, r + 1, out);
    } else {
        prepare(8, x, 1, K, xs, sx);
        #pragma omp for schedule(guided, 4) nowait
        for (int64_t r = 0; r < T; r++) tiles(8, xs, sx, w, 1, N, K, r, r + 1, out);
    }
}

static void rms_norm(const float *x, const float *w, int64_t n, float eps, float *h) {
    double ss = 0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
    const float inv = 1.0f / sqrtf((float)(ss / n) + eps);
    for (int64_t i = 0; i < n; i++) h[i] = w[i] * (x[i] * inv);
}

/* e^x of 8 floats (Cephes' expf: x = n ln 2 + r, a degree-7 polynomial in r, times 2^n; within 2 ulp),
   x in [-87.3, 88.7] */
INLINE __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.7f)), _mm256_set1_ps(-87.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* the dot products of a query (D floats, D a multiple of 8) with 8 keys: 8 sums, lane j key j's */
INLINE __m256 dots8(const float *q, const float *const k[8], int64_t D) {
    __m256 s[8];
    for (int j = 0; j < 8; j++) {
        s[j] = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k[j]));
        for (int64_t d = 8; d < D; d += 8)
            s[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k[j] + d), s[j]);
    }
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(s[0], s[1]), _mm256_hadd_ps(s[2], s[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(s[4], s[5]), _mm256_hadd_ps(s[6], s[7]));
    /* a: keys 0 1 2 3 (low halves) | 0 1 2 3 (high halves), b likewise for 4-7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

#define KEYS 32  /* keys a pass over the pool takes: their scores on the stack */

/* acc (w vectors of 8 columns) += the sum over keys j < nj of p[j] times key j's V row (at v + slots[j] *
   R): a chain a vector, keys in order, the vectors side by side */
INLINE void add_pv(int w, const float *p, int nj, const float *v, const int32_t *slots, int64_t R,
                   float *acc) {
    __m256 o[8];
    for (int i = 0; i < w; i++) o[i] = _mm256_loadu_ps(acc + 8 * i);
    for (int j = 0; j < nj; j++) {
        const __m256 pj = _mm256_set1_ps(p[j]);
        const float *vj = v + (int64_t)slots[j] * R;
        for (int i = 0; i < w; i++) o[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * i), o[i]);
    }
    for (int i = 0; i < w; i++) _mm256_storeu_ps(acc + 8 * i, o[i]);
}

/* this thread's part of one query's attention (q: H heads of D, D a multiple of 8) over keys a .. e - 1 of
   n (their K and V rows in the pool at slots[j]): per query head the running max m, the sum l of
   exp(score - m) and the sum of those times V, in part[head] (D values, then m and l). The G query heads
   of a KV head take its rows together */
static void team_attention(const float *q, const float *kb, const float *vb, const int32_t *slots, int64_t n,
                           int64_t H, int64_t Hkv, int64_t D, float *part) {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t a = n * t / nt, e = n * (t + 1) / nt, G = H / Hkv, R = Hkv * D;
    const float scale = 1.0f / sqrtf((float)D);
    float s[G * KEYS], m[G], l[G];
    for (int64_t kh = 0; kh < Hkv; kh++) {
        for (int64_t g = 0; g < G; g++) {
            memset(part + (kh * G + g) * (D + 2), 0, D * sizeof(float));
            m[g] = -INFINITY;
            l[g] = 0.0f;
        }
        for (int64_t j0 = a; j0 < e; j0 += KEYS) {
            const int nj = e - j0 < KEYS ? (int)(e - j0) : KEYS;
            for (int j = 0; j < nj; j += 8) {  /* scores, 8 keys at a time (past nj: repeats of the last) */
                const float *k[8];
                for (int i = 0; i < 8; i++)
                    k[i] = kb + (int64_t)slots[j0 + (j + i < nj ? j + i : nj - 1)] * R + kh * D;
                for (int64_t g = 0; g < G; g++)
                    _mm256_storeu_ps(s + g * KEYS + j, _mm256_mul_ps(dots8(q + (kh * G + g) * D, k, D),
                                                                     _mm256_set1_ps(scale)));
            }
            for (int64_t g = 0; g < G; g++) {
                float *sg = s + g * KEYS, *acc = part + (kh * G + g) * (D + 2), top = m[g];
                for (int j = 0; j < nj; j++) top = sg[j] > top ? sg[j] : top;
                const float f = expf(m[g] - top);  /* the sums so far, to the new max */
                l[g] *= f;
                for (int64_t d = 0; d < D; d++) acc[d] *= f;
                m[g] = top;
                for (int j = 0; j < nj; j += 8)
                    _mm256_storeu_ps(sg + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + j),
                                                                _mm256_set1_ps(top))));
                for (int64_t d = 0; d < D; d += D - d >= 64 ? 64 : 8)  /* acc += p V */
                    if (D - d >= 64)
                        add_pv(8, sg, nj, vb + kh * D + d, slots + j0, R, acc + d);
                    else
                        add_pv(1, sg, nj, vb + kh * D + d, slots + j0, R, acc + d);
                for (int j = 0; j < nj; j++) l[g] += sg[j];
            }
        }
        for (int64_t g = 0; g < G; g++) {
            part[(kh * G + g) * (D + 2) + D] = m[g];
            part[(kh * G + g) * (D + 2) + D + 1] = l[g];
        }
    }
}

/* the threads' parts of each query head merged, in thread order: o (H, D) */
static void merge_attention(const float *parts, int nt, int64_t H, int64_t D, float *o) {
    for (int64_t hq = 0; hq < H; hq++) {
        float top = -INFINITY, l = 0.0f;
        for (int t = 0; t < nt; t++) {
            const float mt = parts[(t * H + hq) * (D + 2) + D];
            top = mt > top ? mt : top;
        }
        memset(o + hq * D, 0, D * sizeof(float));
        for (int t = 0; t < nt; t++) {
            const float *p = parts + (t * H + hq) * (D + 2);
            if (p[D + 1] == 0.0f) continue;  /* no keys */
            const float f = expf(p[D] - top);
            l += p[D + 1] * f;
            for (int64_t d = 0; d < D; d++) o[hq * D + d] += p[d] * f;
        }
        for (int64_t d = 0; d < D; d++) o[hq * D + d] /= l;
    }
}

/* the n heads of D at v rotated by the angles whose cosines and sines cs holds: x cos + rotate_half(x) sin */
static void rope(float *v, int64_t n, int64_t D, const float *cs) {
    for (int64_t i = 0; i < n * D; i += D)
        for (int64_t d = 0; d < D / 2; d++) {
            const float x1 = v[i + d], x2 = v[i + d + D / 2];
            v[i + d] = x1 * cs[d] - x2 * cs[D / 2 + d];
            v[i + d + D / 2] = x2 * cs[d] + x1 * cs[D / 2 + d];
        }
}

/* rows ids[0 .. n - 1] of a GGUF tensor's blocks (raw: K / 32 blocks of `type` a row, as the file holds
   them) in float32 (out: n rows of K), the values gguf dequantizes them to: d q (Q8_0), d (q - 8) (Q4_0),
   d q + m (Q4_1). d q is exact in float32 (an fp16 times a code of at most 8 bits): only the sum rounds */
void gguf_rows(const uint8_t *raw, int type, const int64_t *ids, int64_t n, int64_t K, float *out) {
    const int64_t size = file_block_bytes(type);
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *b = raw + ids[r] * (K / 32) * size;
        for (float *y = out + r * K; y < out + (r + 1) * K; y += 32, b += size) {
            uint16_t h[2];
            memcpy(h, b, 4);
            const float d = _cvtsh_ss(h[0]), m = type == 3 ? _cvtsh_ss(h[1]) : 0.0f;
            for (int i = 0; i < 32 && type == 8; i++) y[i] = d * (float)(int8_t)b[2 + i];
            for (int j = 0; j < 16 && type != 8; j++) {  /* byte j: input j (low nibble), j + 16 (high) */
                const uint8_t q = b[size - 16 + j];
                y[j] = type == 2 ? d * (float)((q & 15) - 8) : d * (float)(q & 15) + m;
                y[j + 16] = type == 2 ? d * (float)((q >> 4) - 8) : d * (float)(q >> 4) + m;
            }
        }
    }
}

/* One token of one request through the model: the token's embedding row, then each of the L layers
   (layers[8 l ..]: its two norms' weights, its qkv, o, gate_up and down tiles of bits[4 l ..]-bit codes,
   its K and V pools), the final norm and the head's tiles: logits (V). The token's position, the slot it
   writes and the request's length come as the step holds them, through pointers; its row of req_to_token
   (ctx slots a row) gives the slots of its keys. The embedding: a float32 table (embed_type 0) or the
   file's blocks of that type. Rotary: HF's halves, angle position * inv_freq. */
void gguf_decode_step(const int64_t *token, const int64_t *position, const int64_t *slot,
                      const int32_t *req_to_token, const int64_t *row, int64_t ctx, const int64_t *length,
                      const void *embed, int embed_type, const float *inv_freq, void *const *layers,
                      const int32_t *bits,
                      int64_t L, int64_t E, int64_t H, int64_t Hkv, int64_t D, int64_t I, float eps,
                      const float *final_norm, const uint8_t *head, int head_bits, int64_t V, float *logits,
                      int threads) {
    const int64_t Q = (H + 2 * Hkv) * D, n = *length, S = *slot, R = Hkv * D;
    const int64_t KMAX = E > I ? (E > H * D ? E : H * D) : (I > H * D ? I : H * D);
    const int32_t *slots = req_to_token + *row * ctx;
    /* the matmuls' outputs, which every thread reads; then each thread's own: its residual stream, the row
       it feeds a matmul, its rotated query, its matmul's prepared input */
    float *qkv = malloc(Q * 4), *y = malloc(E * 4), *gu = malloc(2 * I * 4), *cs = malloc(D * 4);
    float *parts = malloc((int64_t)threads * H * (D + 2) * 4);
    const int64_t own = E + 2 * KMAX + H * D + KMAX / 32 + 1;
    float *mine = malloc((int64_t)threads * own * 4);
    for (int64_t d = 0; d < D / 2; d++) {  /* cos, then sin, of each angle */
        const float ang = (float)*position * inv_freq[d];
        cs[d] = cosf(ang);
        cs[D / 2 + d] = sinf(ang);
    }
    #pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        float *x = mine + t * own, *h = x + E, *q = h + KMAX, *xs = q + H * D, *sx = xs + KMAX;
        if (embed_type)
            gguf_rows(embed, embed_type, token, 1, E, x);
        else
            memcpy(x, (const float *)embed + *token * E, E * sizeof(float));
        for (int64_t li = 0; li < L; li++) {
            void *const *p = layers + 8 * li;
            const int32_t *b = bits + 4 * li;
            float *kb = p[6], *vb = p[7];
            rms_norm(x, p[0], E, eps, h);
            team_matvec(b[0], h, p[2], Q, E, xs, sx, qkv);
            #pragma omp barrier
            memcpy(q, qkv, H * D * sizeof(float));
            rope(q, H, D, cs);
            if (t == nt - 1) {  /* the thread whose keys end with the new one writes it */
                rope(qkv + H * D, Hkv, D, cs);
                memcpy(kb + S * R, qkv + H * D, R * sizeof(float));
                memcpy(vb + S * R, qkv + H * D + R, R * sizeof(float));
            }
            team_attention(q, kb, vb, slots, n, H, Hkv, D, parts + (int64_t)t * H * (D + 2));
            #pragma omp barrier
            merge_attention(parts, nt, H, D, h);
            team_matvec(b[1], h, p[3], E, H * D, xs, sx, y);
            #pragma omp barrier
            for (int64_t i = 0; i < E; i++) x[i] += y[i];
            rms_norm(x, p[1], E, eps, h);
            team_matvec(b[2], h, p[4], 2 * I, E, xs, sx, gu);
            #pragma omp barrier
            for (int64_t i = 0; i < I; i += 8) {  /* silu(gate) * up = gate / (1 + e^-gate) * up */
                const __m256 gate = _mm256_loadu_ps(gu + i), up = _mm256_loadu_ps(gu + I + i);
                const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gate));
                const __m256 silu = _mm256_div_ps(gate, _mm256_add_ps(e, _mm256_set1_ps(1.0f)));
                _mm256_storeu_ps(h + i, _mm256_mul_ps(silu, up));
            }
            team_matvec(b[3], h, p[5], E, I, xs, sx, y);
            #pragma omp barrier
            for (int64_t i = 0; i < E; i++) x[i] += y[i];
        }
        rms_norm(x, final_norm, E, eps, h);
        team_matvec(head_bits, h, head, V, E, xs, sx, logits);
    }
    free(qkv); free(y); free(gu); free(cs); free(parts); free(mine);
}

/* The step's matmuls and nothing else, as gguf_decode_step runs them (one parallel region, a barrier after
   each): x times each of the n matrices (tiles[i] of shape[3 i ..]: N, K, bits), into out. What one token's
   weights cost alone: bench.py single times it beside the step. */
void gguf_matmuls(void *const *tiles, const int64_t *shape, int64_t n, const float *x, float *out,
                  int threads) {
    int64_t KMAX = 32;
    for (int64_t i = 0; i < n; i++) KMAX = shape[3 * i + 1] > KMAX ? shape[3 * i + 1] : KMAX;
    float *scratch = malloc((int64_t)threads * (KMAX + KMAX / 32) * sizeof(float));
    #pragma omp parallel num_threads(threads)
    {
        float *xs = scratch + omp_get_thread_num() * (KMAX + KMAX / 32);
        for (int64_t i = 0; i < n; i++) {
            const int64_t *sh = shape + 3 * i;
            team_matvec((int)sh[2], x, tiles[i], sh[0], sh[1], xs, xs + KMAX, out);
            #pragma omp barrier
        }
    }
    free(scratch);
}

/* -- the deterministic mode's SwiGLU, vectorized: silu_mul --
   out (N, I) = silu(gate) * up of gate_up (N, 2I), float32 or bf16 (each product rounded to bf16 where
   overlap_engine's SwiGLU rounds), I a multiple of 8: every element by the same instructions, wherever
   its row is in the batch */

/* 8 floats to bf16, rounded to nearest even (finite values), as floats again */
INLINE __m256 round_bf16(__m256 v) {
    const __m256i b = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u)));
}

void silu_mul(const void *gu, int64_t N, int64_t I, int bf16, void *out, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < N; t++)
        for (int64_t i = 0; i < I; i += 8) {
            const __m256 gate = fvec(bf16, gu, t * 2 * I + i), up = fvec(bf16, gu, t * 2 * I + I + i);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gate));
            __m256 silu = _mm256_div_ps(gate, _mm256_add_ps(e, _mm256_set1_ps(1.0f)));
            if (bf16) {
                const __m256i y = _mm256_castps_si256(round_bf16(_mm256_mul_ps(round_bf16(silu), up)));
                const __m256i h = _mm256_srli_epi32(y, 16);  /* the 8 bf16 in the low halves */
                _mm_storeu_si128((__m128i *)((uint16_t *)out + t * I + i),
                                 _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
            } else
                _mm256_storeu_ps((float *)out + t * I + i, _mm256_mul_ps(silu, up));
        }
}

/* pack_gguf_tiles, straight from the file's bytes: a GGUF tensor's N rows of KB blocks (`raw`, as the file
   holds them) written into `tiles` (that layout, its other bytes left as they are) as its rows row0 ..
   row0 + N - 1: a fused layer's parts go in one after the other. A task is a tile: no two write one. */
void pack_tiles(const uint8_t *raw, int64_t N, int64_t KB, int type, uint8_t *tiles, int64_t row0,
                int threads) {
    const int64_t size = file_block_bytes(type), tb = tile_bytes(type == 8 ? 8 : 4);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t tile = row0 / ROWS; tile <= (row0 + N - 1) / ROWS; tile++)
        for (int64_t r = tile * ROWS > row0 ? tile * ROWS : row0; r < (tile + 1) * ROWS && r < row0 + N; r++)
            for (int64_t kb = 0; kb < KB; kb++) {
                const uint8_t *b = raw + ((r - row0) * KB + kb) * size;  /* d, (m,) the codes */
                uint8_t *t = tiles + (tile * KB + kb) * tb;
                const int lane = r % ROWS;
                if (type == 8) {  /* group i: the 8 rows' codes of input i */
                    for (int i = 0; i < 32; i++) t[8 * i + lane] = b[2 + i];
                    memcpy(t + 256 + 2 * lane, b, 2);
                    continue;
                }
                /* the file's byte j: inputs j (low nibble) and j + 16; the row's byte j: inputs 2j and
                   2j + 1, its bytes 4g .. 4g + 3 in lane `lane` of vector g */
                const uint8_t *q = b + size - 16;
                for (int j = 0; j < 16; j++) {
                    const uint8_t lo = q[2 * j % 16], hi = q[(2 * j + 1) % 16];
                    t[32 * (j / 4) + 4 * lane + j % 4] = j < 8 ? (lo & 15) | (hi << 4)
                                                               : (lo >> 4) | (hi & 0xF0);
                }
                memcpy(t + 128 + 2 * lane, b, 2);
                if (type == 3)
                    memcpy(t + 144 + 2 * lane, b + 2, 2);
                else {  /* Q4_0: m = -8 d, exact in fp16 */
                    uint16_t d, m;
                    memcpy(&d, b, 2);
                    m = _cvtss_sh(_cvtsh_ss(d) * -8.0f, 0);
                    memcpy(t + 144 + 2 * lane, &m, 2);
                }
            }
}
"""


def gguf_blocks(raw: torch.Tensor, type_: int) -> tuple:
    """A GGUF tensor's raw blocks (N, bytes a row) uint8 -> (codes (N, K) uint8, or int8 for Q8_0; d, m
    (N, K / 32) float32): weight = d * codes + m. Q4_1 as written; Q4_0's d * (q - 8) as codes q with
    m = -8 d; Q8_0's signed codes with m = 0."""
    N = raw.shape[0]
    size = GGUF_BLOCK_BYTES[type_]
    b = raw.view(N, -1, size)
    d = b[..., :2].contiguous().view(torch.float16).float().view(N, -1)
    if type_ == 8:
        return b[..., 2:].contiguous().view(torch.int8).view(N, -1), d, torch.zeros_like(d)
    qs = b[..., size - 16:]
    codes = torch.cat((qs & 15, qs >> 4), dim=-1).view(N, -1)  # byte j: input j (low), input j + 16 (high)
    m = b[..., 2:4].contiguous().view(torch.float16).float().view(N, -1) if type_ == 3 else -8 * d
    return codes, d, m


def gguf_weights_ref(raw: torch.Tensor, type_: int) -> torch.Tensor:
    """The float32 weights (N, K) a GGUF tensor's blocks stand for, computed as gguf (and llama.cpp)
    dequantize them: d * q + m (Q4_1), d * (q - 8) (Q4_0), d * q (Q8_0)."""
    codes, d, m = gguf_blocks(raw, type_)
    N, K = codes.shape
    q = codes.float().view(N, K // 32, 32)
    if type_ == 2:
        return (d[..., None] * (q - 8)).view(N, K)
    return (d[..., None] * q + m[..., None]).view(N, K) if type_ == 3 else (d[..., None] * q).view(N, K)


def gguf_matmul_ref(x, raw, type_: int):
    """gguf_matmul's spec: x (M, K) times the blocks' weights, in float64 (the kernel sums in float32)."""
    return x.double() @ gguf_weights_ref(raw, type_).double().T


def pack_gguf_tiles(raw: torch.Tensor, type_: int) -> torch.Tensor:
    """A GGUF tensor's raw blocks (N, bytes a row) -> gguf_matmul's tiles (ceil(N / 8), K / 32, bytes a
    tile's block) uint8 (the rows padded with zero blocks to a whole tile). The bytes move as they are:
    d and m stay the file's fp16, and a Q4 block's codes are regrouped nibble by nibble."""
    size = GGUF_BLOCK_BYTES[type_]
    N, KB = raw.shape[0], raw.shape[1] // size
    b = raw.view(N, KB, size)
    d = b[..., :2]
    if type_ == 8:
        parts = [b[..., 2:], d]
    else:  # file byte j: inputs j (low nibble) and j + 16 (high); tile byte j: inputs 2j (low), 2j + 1
        lo, hi = b[..., size - 16::2], b[..., size - 15::2]
        codes = torch.cat(((lo & 15) | (hi << 4), (lo >> 4) | (hi & 0xF0)), dim=-1)
        m = b[..., 2:4] if type_ == 3 else (d.contiguous().view(torch.float16) * -8).view(torch.uint8)
        parts = [codes, d, m]
    pad = -N % GGUF_ROWS
    T = (N + pad) // GGUF_ROWS
    tiles = []
    for i, p in enumerate(parts):
        p = torch.cat((p, p.new_zeros(pad, *p.shape[1:]))) if pad else p
        p = p.reshape(T, GGUF_ROWS, KB, -1).transpose(1, 2)  # (tile, block, row, bytes)
        if i == 0 and type_ == 8:  # group i: the 8 rows' codes of input i
            p = p.transpose(2, 3)
        elif i == 0:  # vector g, lane n: row n's codes of inputs 8g .. 8g + 7, input 8g + k in bits 4k ..
            p = p.reshape(T, KB, GGUF_ROWS, 4, 4).transpose(2, 3)
        tiles.append(p.reshape(T, KB, -1))
    return torch.cat(tiles, dim=-1)


def gguf_kernel(symbol: str, compiler: str):
    """GGUF_MATMUL_SRC's function `symbol` (gguf_matmul, float_matmul, gguf_decode_step...), built once, or
    None where it cannot be built here (no AVX2, FMA or F16C)."""
    key = ("gguf", symbol)
    if key not in _cpu_kernels:
        import ctypes
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        argtypes = {"gguf_matmul": [p, p, i64, i64, i64, i32, p, i32],
                    "float_matmul": [p, p, i64, i64, i64, i32, p, i32],
                    "float_pairs": [],
                    "float_wide": [],
                    "silu_mul": [p, i64, i64, i32, p, i32],
                    "gguf_matmuls": [p, p, i64, p, p, i32],
                    "pack_tiles": [p, i64, i64, i32, p, i64, i32],
                    "gguf_decode_step": [p, p, p, p, p, i64, p, p, i32, p, p, p, i64, i64, i64, i64, i64, i64,
                                         f32, p, p, i32, i64, p, i32],
                    "gguf_rows": [p, i32, p, i64, i64, p]}[symbol]
        _cpu_kernels[key] = build_c("gguf", GGUF_MATMUL_SRC, GGUF_FLAGS, compiler, symbol, argtypes)
    return _cpu_kernels[key]


def pack_gguf_tiles_cpu(raw: torch.Tensor, type_: int, tiles: torch.Tensor, row0: int = 0,
                        compiler: str = "cc"):
    """pack_gguf_tiles in C, from the file's bytes: raw's rows (N, bytes a row) written into `tiles` ((T, K /
    32, bytes a tile's block) uint8, zeroed where no row goes) as its rows row0 .. row0 + N - 1. Returns
    tiles, or None where the kernel cannot be built here."""
    fn = gguf_kernel("pack_tiles", compiler)
    if fn is None:
        return None
    N, KB = raw.shape[0], raw.shape[1] // GGUF_BLOCK_BYTES[type_]
    assert raw.dtype == tiles.dtype == torch.uint8 and tiles.is_contiguous(), (raw.dtype, tiles.dtype)
    assert tiles.shape[1:] == (KB, GGUF_TILE[type_]) and tiles.shape[0] * GGUF_ROWS >= row0 + N, tiles.shape
    raw = raw.contiguous()
    if N:
        fn(raw.data_ptr(), N, KB, type_, tiles.data_ptr(), row0, torch.get_num_threads())
    return tiles


def gguf_rows_cpu(raw: torch.Tensor, type_: int, ids: torch.Tensor, compiler: str = "cc"):
    """Rows `ids` of a GGUF tensor's blocks (raw (N, bytes a row)) in float32, (len(ids), K):
    gguf_weights_ref's values, computed in C as gguf_decode_step looks up its token; None where it cannot
    be built here."""
    fn = gguf_kernel("gguf_rows", compiler)
    if fn is None:
        return None
    ids, raw = ids.to(torch.int64).contiguous(), raw.contiguous()
    assert raw.dtype == torch.uint8 and ids.dim() == 1, (raw.dtype, ids.shape)
    assert len(ids) == 0 or 0 <= ids.min() <= ids.max() < len(raw), "a row outside the table"
    out = torch.empty(len(ids), raw.shape[1] // GGUF_BLOCK_BYTES[type_] * 32)
    fn(raw.data_ptr(), type_, ids.data_ptr(), len(ids), out.shape[1], out.data_ptr())
    return out


def gguf_matmul_cpu(x, tiles, type_: int, N: int, compiler: str = "cc"):
    """x (M, K) float32 times the weights pack_gguf_tiles packed into `tiles`: (M, N) float32; None where
    the kernel cannot be built here."""
    fn = gguf_kernel("gguf_matmul", compiler)
    if fn is None:
        return None
    M, K = x.shape
    assert x.dtype == torch.float32 and x.is_contiguous() and tiles.shape[1] * 32 == K, tiles.shape
    assert tiles.shape[2] == GGUF_TILE[type_] and tiles.shape[0] * GGUF_ROWS >= N, (tiles.shape, N)
    out = torch.empty(M, N, dtype=torch.float32)
    fn(x.data_ptr(), tiles.data_ptr(), M, N, K, gguf_bits(type_), out.data_ptr(), torch.get_num_threads())
    return out


def gguf_matmuls_cpu(mats: list, x: torch.Tensor, passes: int = 1, compiler: str = "cc"):
    """One token x (float32, as long as the widest matrix's K; each reads its first K) through the matrices
    `mats` ((tiles, type, N) each, pack_gguf_tiles' layout) as gguf_decode_step runs them, in one parallel
    region, `passes` times: (the last matrix's outputs, the best pass in ms), or None where it cannot be
    built here. bench.py single times a model's matmuls with it."""
    import ctypes
    fn = gguf_kernel("gguf_matmuls", compiler)
    if fn is None:
        return None
    assert x.dtype == torch.float32 and x.is_contiguous()
    assert len(x) >= max(t.shape[1] * 32 for t, _, _ in mats)
    out = torch.empty(max(n for _, _, n in mats))
    ptrs = (ctypes.c_void_p * len(mats))(*[t.data_ptr() for t, _, _ in mats])
    shape = (ctypes.c_int64 * (3 * len(mats)))(*[v for t, type_, n in mats
                                                 for v in (n, t.shape[1] * 32, gguf_bits(type_))])
    best = math.inf
    for _ in range(passes):
        t0 = time.perf_counter()
        fn(ptrs, shape, len(mats), x.data_ptr(), out.data_ptr(), torch.get_num_threads())
        best = min(best, time.perf_counter() - t0)
    return out[:mats[-1][2]], best * 1e3


FLOAT_GROUP = 16  # outputs a float_matmul task takes: two tiles of GGUF_ROWS
PAIR_GROUP = 32  # outputs a task takes on pair tiles: two tiles of 16


def pack_float_tiles(w: torch.Tensor, pairs: bool = False, wide: bool = False) -> torch.Tensor:
    """Float32 or bf16 weights (N, K) -> float_matmul's tiles (ceil(N / 16) * 2, K, 8) of the same dtype:
    tile t holds outputs 8t .. 8t + 7, input by input (the rows padded with zeros to whole pairs). With
    `wide` (float32, where float_wide_build): tiles (ceil(N / 32) * 2, K, 16) of outputs 16t .. 16t + 15;
    with `pairs` (bf16, K even, where float_pairs_build): (ceil(N / 32) * 2, K / 2, 16, 2), input pair by
    input pair."""
    N, K = w.shape
    group, rows = (PAIR_GROUP, 16) if pairs or wide else (FLOAT_GROUP, GGUF_ROWS)
    assert not pairs or (w.dtype == torch.bfloat16 and K % 2 == 0), (w.dtype, K)
    assert not wide or w.dtype == torch.float32, w.dtype
    w = torch.cat((w, w.new_zeros(-N % group, K))) if N % group else w
    if pairs:
        return w.view(-1, rows, K // 2, 2).transpose(1, 2).contiguous()
    return w.view(-1, rows, K).transpose(1, 2).contiguous()


def _float_query(symbol: str, compiler: str) -> bool:
    import ctypes
    fn = gguf_kernel(symbol, compiler)
    if fn is None:
        return False
    fn.restype = ctypes.c_int
    return fn() == 1


def float_pairs_build(compiler: str = "cc") -> bool:
    """Whether float_matmul multiplies bf16 pair tiles here (a CPU with AVX512-BF16)."""
    return _float_query("float_pairs", compiler)


def float_wide_build(compiler: str = "cc") -> bool:
    """Whether float_matmul multiplies wide float32 tiles here (a CPU with AVX512)."""
    return _float_query("float_wide", compiler)


def float_matmul_ref(x, w):
    """float_matmul's spec: x (M, K) times w (N, K) transposed, in float64 (the kernel sums in float32,
    each output one chain of fused multiply-adds over its inputs in order)."""
    return x.double() @ w.double().T


def float_matmul_cpu(x, tiles, N: int, compiler: str = "cc"):
    """x (M, K) float32 times the weights pack_float_tiles packed into `tiles`: (M, N) float32, each row's
    bits the same in any batch; None where the kernel cannot be built here."""
    fn = gguf_kernel("float_matmul", compiler)
    if fn is None:
        return None
    M, K = x.shape
    pairs = tiles.dim() == 4  # pack_float_tiles(pairs=True)'s: x rounded to bf16
    wide = tiles.dim() == 3 and tiles.shape[2] == 16
    assert x.dtype == torch.float32 and x.is_contiguous() and tiles.shape[1] * (2 if pairs else 1) == K
    assert tiles.dtype in (torch.float32, torch.bfloat16) and tiles.shape[0] * tiles.shape[2] >= N, N
    out = torch.empty(M, N, dtype=torch.float32)
    mode = 2 if pairs else 4 if wide else int(tiles.dtype == torch.bfloat16)
    fn(x.data_ptr(), tiles.data_ptr(), M, N, K, mode, out.data_ptr(), torch.get_num_threads())
    return out


def gguf_bits(type_: int) -> int:
    """The width of a GGUF block type's codes in gguf_matmul's tiles."""
    return 8 if type_ == 8 else 4


# The CPU kernels of overlap_engine's ops q_linear, gguf_linear, float_linear and decode_attention_c in
# C++ against torch's headers, calling the C kernels above: a kernel written in Python costs the dispatcher
# a call back into Python, as much as a small model's one-token matmul itself, and a decode step makes
# hundreds of such calls. The ops' Python kernels stay where this does not build. Each C kernel is handed
# over once it is built, keyed as _cpu_kernels keys it.

CPU_OPS_SRC = r"""
/* built against torch %(TORCH)s */
#include <cmath>
#include <cstring>
#include <map>
#include <tuple>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <ATen/Parallel.h>

typedef void (*q_matmul_fn)(const void *, const void *, int64_t, int64_t, int64_t, void *, int);
typedef void (*gguf_matmul_fn)(const void *, const void *, int64_t, int64_t, int64_t, int, void *, int);
typedef gguf_matmul_fn float_matmul_fn;  /* x, tiles, M, N, K, tiles' mode, out, threads */
typedef void (*attention_fn)(const void *, const void *, const void *, const void *, const void *,
                             const void *, int64_t, int64_t, float, void *, int);
typedef std::tuple<int, int64_t, int64_t, int64_t, int64_t> attention_key;  /* fp32 or bf16, D, Hkv, G, E */
static q_matmul_fn q_matmul[9];  /* by bits */
static gguf_matmul_fn gguf_matmul;
static float_matmul_fn float_matmul;
typedef void (*silu_mul_fn)(const void *, int64_t, int64_t, int, void *, int);
static silu_mul_fn silu_mul;  /* GGUF_MATMUL_SRC's, vectorized; handed over with float_matmul */
static std::map<attention_key, attention_fn> attention;

extern "C" void set_q_matmul(int bits, void *fn) { q_matmul[bits] = (q_matmul_fn)fn; }
extern "C" void set_gguf_matmul(void *fn) { gguf_matmul = (gguf_matmul_fn)fn; }
extern "C" void set_float_matmul(void *fn, void *silu) {
    float_matmul = (float_matmul_fn)fn;
    silu_mul = (silu_mul_fn)silu;
}
extern "C" void set_decode_attention(int bf16, int64_t D, int64_t Hkv, int64_t G, int64_t E, void *fn) {
    attention[{bf16, D, Hkv, G, E}] = (attention_fn)fn;
}

static at::Tensor q_linear(const at::Tensor &x, const at::Tensor &tiles, int64_t bits) {
    TORCH_CHECK((bits == 4 || bits == 8) && q_matmul[bits], "q_linear: no kernel for ", bits, "-bit codes");
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && tiles.scalar_type() == at::kByte && tiles.is_contiguous(),
                "q_linear: x in bf16 and contiguous uint8 tiles");
    const at::Tensor xc = x.contiguous();
    const int64_t K = xc.size(-1), M = xc.numel() / K, N = tiles.size(0) * 16;
    TORCH_CHECK(tiles.size(1) * 32 == K, "q_linear: tiles of ", tiles.size(1) * 32, " inputs, x of ", K);
    std::vector<int64_t> shape = xc.sizes().vec();
    shape.back() = N;
    at::Tensor out = at::empty(shape, xc.options());
    q_matmul[bits](xc.data_ptr(), tiles.data_ptr(), M, N, K, out.data_ptr(), at::get_num_threads());
    return out;
}

/* kernels.gguf_matmul_cpu's checks and call: x (..., K) float32 times tiles of ggml type `type`, N outputs */
static at::Tensor gguf_linear(const at::Tensor &x, const at::Tensor &tiles, int64_t type, int64_t N) {
    const int bits = type == 8 ? 8 : 4;
    TORCH_CHECK((type == 2 || type == 3 || type == 8) && gguf_matmul, "gguf_linear: no kernel for type ",
                type);
    TORCH_CHECK(x.scalar_type() == at::kFloat && tiles.scalar_type() == at::kByte && tiles.is_contiguous()
                && tiles.dim() == 3 && tiles.size(2) == (bits == 8 ? 272 : 160) && tiles.size(0) * 8 >= N,
                "gguf_linear: x in float32 and contiguous uint8 tiles of its type");
    const at::Tensor xc = x.contiguous();
    const int64_t K = xc.size(-1), M = xc.numel() / K;
    TORCH_CHECK(tiles.size(1) * 32 == K, "gguf_linear: tiles of ", tiles.size(1) * 32, " inputs, x of ", K);
    std::vector<int64_t> shape = xc.sizes().vec();
    shape.back() = N;
    at::Tensor out = at::empty(shape, xc.options());
    if (M > 0)
        gguf_matmul(xc.data_ptr(), tiles.data_ptr(), M, N, K, bits, out.data_ptr(), at::get_num_threads());
    return out;
}

/* kernels.float_matmul_cpu's checks and call: x (..., K) float32 or bf16 (summed in float32, the result
   rounded to x's dtype) times pack_float_tiles' tiles, N outputs */
static at::Tensor float_linear(const at::Tensor &x, const at::Tensor &tiles, int64_t N) {
    TORCH_CHECK(float_matmul, "float_linear: no kernel");
    const bool pairs = tiles.dim() == 4;  /* pack_float_tiles(pairs=True)'s: bf16, (T, K / 2, 16, 2) */
    const bool wide = tiles.dim() == 3 && tiles.size(2) == 16 && tiles.scalar_type() == at::kFloat;
    TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16)
                && (pairs ? tiles.scalar_type() == at::kBFloat16 && tiles.size(2) == 16 && tiles.size(3) == 2
                          : tiles.dim() == 3 && (tiles.size(2) == 8 || wide)
                            && (tiles.scalar_type() == at::kFloat || tiles.scalar_type() == at::kBFloat16))
                && tiles.is_contiguous() && tiles.size(0) %% 2 == 0
                && tiles.size(0) * tiles.size(2) >= N,
                "float_linear: x in float32 or bf16 and contiguous tiles");
    const bool in_bf16 = pairs && x.scalar_type() == at::kBFloat16;  /* bf16 rows in, bf16 sums out */
    const at::Tensor xc = in_bf16 ? x.contiguous() : x.to(at::kFloat).contiguous();
    const int64_t K = xc.size(-1), M = xc.numel() / K;
    const int64_t tiles_k = tiles.size(1) * (pairs ? 2 : 1);
    TORCH_CHECK(tiles_k == K, "float_linear: tiles of ", tiles_k, " inputs, x of ", K);
    std::vector<int64_t> shape = xc.sizes().vec();
    shape.back() = N;
    at::Tensor out = at::empty(shape, xc.options());
    if (M > 0)
        float_matmul(xc.data_ptr(), tiles.data_ptr(), M, N, K,
                     in_bf16 ? 3 : pairs ? 2 : wide ? 4 : tiles.scalar_type() == at::kBFloat16,
                     out.data_ptr(), at::get_num_threads());
    return x.scalar_type() == out.scalar_type() ? out : out.to(x.scalar_type());
}

/* The deterministic mode's per-row ops, each row computed alone in one order written out (no reordering
   flags here), so that a prefill, a decode at any batch and a compiled graph (to which each is one op)
   give a token the same bits; the arithmetic is overlap_engine's rms_norm, apply_rope and SwiGLU's, each
   result rounded to the dtype where theirs is (SwiGLU's e^x is GGUF_MATMUL_SRC's exp8, vectorized, where
   that is handed over). */
template <typename T> static inline float f32(T v) { return static_cast<float>(v); }

/* f rounded to T: bf16 to nearest even, NaN to 0x7FC0, as c10's conversion does, with a select for
   NaN where c10 branches (the loops vectorize) */
template <typename T> static inline T rnd(float f) { return f; }
template <> inline at::BFloat16 rnd<at::BFloat16>(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint16_t rounded = (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
    const uint16_t bits = (u & 0x7FFFFFFF) > 0x7F800000 ? 0x7FC0 : rounded;
    return at::BFloat16(bits, at::BFloat16::from_bits());
}

/* rows of x (plus r's, into sum, where r is given) times w (n): w * (s / sqrt(mean(s^2) + eps)), the
   squares summed in 8 running sums */
template <typename T> static void rms_norm_rows(const T *x, const T *r, const T *w, int64_t rows, int64_t n,
                                                float eps, T *sum, T *out) {
    at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
        for (int64_t row = r0; row < r1; row++) {
            const T *xr = x + row * n;
            if (r) {
                for (int64_t i = 0; i < n; i++) sum[row * n + i] = rnd<T>(f32(xr[i]) + f32(r[row * n + i]));
                xr = sum + row * n;
            }
            float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            int64_t i = 0;
            for (; i + 8 <= n; i += 8)
                for (int j = 0; j < 8; j++) s[j] += f32(xr[i + j]) * f32(xr[i + j]);
            for (; i < n; i++) s[0] += f32(xr[i]) * f32(xr[i]);
            const float ss = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
            const float inv = 1.0f / std::sqrt(ss / (float)n + eps);
            for (i = 0; i < n; i++) out[row * n + i] = rnd<T>(f32(w[i]) * f32(rnd<T>(f32(xr[i]) * inv)));
        }
    });
}

static void check_norm(const at::Tensor &x, const at::Tensor &w) {
    TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16)
                && w.scalar_type() == x.scalar_type() && w.dim() == 1 && w.size(0) == x.size(-1),
                "row_rms_norm: x in float32 or bf16, w of its last dimension and dtype");
}

static void norm_call(const at::Tensor &x, const at::Tensor *r, const at::Tensor &w, double eps,
                      at::Tensor *sum, at::Tensor &out) {
    const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
#define NORM(T) rms_norm_rows(x.data_ptr<T>(), r ? r->data_ptr<T>() : nullptr, w.data_ptr<T>(), rows, n, \
                              (float)eps, sum ? sum->data_ptr<T>() : nullptr, out.data_ptr<T>())
    if (x.scalar_type() == at::kFloat) NORM(float); else NORM(at::BFloat16);
#undef NORM
}

static at::Tensor row_rms_norm(const at::Tensor &x, const at::Tensor &w, double eps) {
    check_norm(x, w);
    const at::Tensor xc = x.contiguous(), wc = w.contiguous();
    at::Tensor out = at::empty_like(xc);
    norm_call(xc, nullptr, wc, eps, nullptr, out);
    return out;
}

/* (x + r, its rms_norm) */
static std::tuple<at::Tensor, at::Tensor> row_add_rms_norm(const at::Tensor &x, const at::Tensor &r,
                                                           const at::Tensor &w, double eps) {
    check_norm(x, w);
    TORCH_CHECK(r.sizes() == x.sizes() && r.scalar_type() == x.scalar_type(), "row_add_rms_norm: r unlike x");
    const at::Tensor xc = x.contiguous(), rc = r.contiguous(), wc = w.contiguous();
    at::Tensor sum = at::empty_like(xc), out = at::empty_like(xc);
    norm_call(xc, &rc, wc, eps, &sum, out);
    return {sum, out};
}

/* x (N, H, D), its rows xs apart (the q and k heads of a qkv row), rotated into out (N, H, D):
   x * cos + rotate_half(x) * sin, cos and sin (N, 1, D) */
template <typename T> static void rope_rows(const T *x, int64_t xs, const T *cos, const T *sin, int64_t N,
                                            int64_t H, int64_t D, T *out) {
    at::parallel_for(0, N, 16, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; t++)
            for (int64_t h = 0; h < H; h++) {
                const T *xr = x + t * xs + h * D, *c = cos + t * D, *s = sin + t * D;
                T *y = out + (t * H + h) * D;
                const int64_t half = D / 2;  /* rotate_half: (-x2, x1) */
                for (int64_t d = 0; d < half; d++)
                    y[d] = rnd<T>(f32(rnd<T>(-f32(xr[d + half]) * f32(s[d]))) + f32(xr[d]) * f32(c[d]));
                for (int64_t d = half; d < D; d++)
                    y[d] = rnd<T>(f32(rnd<T>(f32(xr[d - half]) * f32(s[d]))) + f32(xr[d]) * f32(c[d]));
            }
    });
}

static at::Tensor row_rope(const at::Tensor &x, const at::Tensor &cos, const at::Tensor &sin) {
    TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.dim() == 3
                && cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type()
                && cos.numel() == x.size(0) * x.size(2) && sin.numel() == cos.numel(),
                "row_rope: x (N, H, D), cos and sin (N, 1, D), all of one dtype");
    const int64_t N = x.size(0), H = x.size(1), D = x.size(2);
    const bool heads_packed = x.stride(2) == 1 && x.stride(1) == D;  /* a view of qkv's rows: no copy */
    const at::Tensor xc = heads_packed ? x : x.contiguous(), cc = cos.contiguous(), sc = sin.contiguous();
    at::Tensor out = at::empty({N, H, D}, x.options());
    if (x.scalar_type() == at::kFloat)
        rope_rows(xc.data_ptr<float>(), xc.stride(0), cc.data_ptr<float>(), sc.data_ptr<float>(), N, H, D,
                  out.data_ptr<float>());
    else
        rope_rows(xc.data_ptr<at::BFloat16>(), xc.stride(0), cc.data_ptr<at::BFloat16>(),
                  sc.data_ptr<at::BFloat16>(), N, H, D, out.data_ptr<at::BFloat16>());
    return out;
}

/* gate_up (N, 2I) -> silu(gate) * up (N, I) */
template <typename T> static void silu_mul_rows(const T *gu, int64_t N, int64_t I, T *out) {
    at::parallel_for(0, N, 16, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; t++)
            for (int64_t i = 0; i < I; i++) {
                const float g = f32(gu[t * 2 * I + i]);
                out[t * I + i] = rnd<T>(f32(rnd<T>(g / (1.0f + std::exp(-g)))) * f32(gu[t * 2 * I + I + i]));
            }
    });
}

static at::Tensor row_silu_mul(const at::Tensor &gate_up) {
    TORCH_CHECK((gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == at::kBFloat16)
                && gate_up.dim() == 2 && gate_up.size(1) %% 2 == 0,
                "row_silu_mul: gate_up (N, 2I) in float32 or bf16");
    const at::Tensor gc = gate_up.contiguous();
    const int64_t N = gc.size(0), I = gc.size(1) / 2;
    at::Tensor out = at::empty({N, I}, gc.options());
    if (silu_mul && I %% 8 == 0)
        silu_mul(gc.data_ptr(), N, I, gc.scalar_type() == at::kBFloat16, out.data_ptr(),
                 at::get_num_threads());
    else if (gc.scalar_type() == at::kFloat)
        silu_mul_rows(gc.data_ptr<float>(), N, I, out.data_ptr<float>());
    else
        silu_mul_rows(gc.data_ptr<at::BFloat16>(), N, I, out.data_ptr<at::BFloat16>());
    return out;
}

/* kernels.decode_attention_cpu's checks and call, with the softmax scale head_dim ** -0.5 */
static at::Tensor decode_attention_c(const at::Tensor &q, const at::Tensor &kb, const at::Tensor &vb,
                                     const at::Tensor &req_to_token, const at::Tensor &rows,
                                     const at::Tensor &lens) {
    const at::Tensor qc = q.contiguous();
    const int64_t N = qc.size(0), Hq = qc.size(1), D = qc.size(2), B = rows.size(0), Hkv = kb.size(1);
    TORCH_CHECK(kb.sizes() == vb.sizes() && kb.dim() == 3 && kb.size(2) == D && kb.is_contiguous()
                && vb.is_contiguous() && kb.scalar_type() == q.scalar_type()
                && vb.scalar_type() == q.scalar_type(), "decode_attention_c: pools unlike q");
    TORCH_CHECK(req_to_token.scalar_type() == at::kInt && req_to_token.is_contiguous(),
                "decode_attention_c: req_to_token in contiguous int32");
    TORCH_CHECK(B > 0 && N %% B == 0 && Hq %% Hkv == 0, "decode_attention_c: ", N, " queries for ", B,
                " requests");
    const auto found = attention.find({q.scalar_type() == at::kBFloat16, D, Hkv, Hq / Hkv, N / B});
    TORCH_CHECK(found != attention.end(), "decode_attention_c: no kernel built for these shapes");
    const at::Tensor rows64 = rows.to(at::kLong).contiguous(), lens64 = lens.to(at::kLong).contiguous();
    at::Tensor out = at::empty_like(qc);
    found->second(qc.data_ptr(), kb.data_ptr(), vb.data_ptr(), req_to_token.data_ptr(), rows64.data_ptr(),
                  lens64.data_ptr(), B, req_to_token.size(1), (float)std::pow((double)D, -0.5),
                  out.data_ptr(), at::get_num_threads());
    return out;
}

TORCH_LIBRARY_IMPL(overlap_engine, CPU, m) {
    m.impl("q_linear", &q_linear);
    m.impl("gguf_linear", &gguf_linear);
    m.impl("float_linear", &float_linear);
    m.impl("row_rms_norm", &row_rms_norm);
    m.impl("row_add_rms_norm", &row_add_rms_norm);
    m.impl("row_rope", &row_rope);
    m.impl("row_silu_mul", &row_silu_mul);
    m.impl("decode_attention_c", &decode_attention_c);
}
"""


def cpu_ops_function(symbol: str, argtypes: list, compiler: str):
    """The function `symbol` of CPU_OPS_SRC, built once and loaded (loading the library registers its
    kernels with torch's dispatcher), or None where it cannot be built here."""
    key = ("ops", symbol)
    if key not in _cpu_kernels:
        torch_dir = os.path.dirname(torch.__file__)
        inc, lib = os.path.join(torch_dir, "include"), os.path.join(torch_dir, "lib")
        flags = ["-O3", "-march=native", "-ffp-contract=off", "-std=c++20", "-shared", "-fPIC",
                 f"-I{inc}"]  # sums as written
        _cpu_kernels[key] = build_c("ops", CPU_OPS_SRC % {"TORCH": torch.__version__}, flags, compiler,
                                    symbol, argtypes, lang="c++", libs=(f"-L{lib}", "-lc10", "-ltorch_cpu",
                                                                f"-Wl,-rpath,{lib}"))
    return _cpu_kernels[key]


def q_linear_in_cpp(bits: int, compiler: str) -> bool:
    """Makes CPU_OPS_SRC's q_linear the CPU kernel of overlap_engine::q_linear (which overlap_engine
    defines), q_matmul_kernel(bits) handed to it; False where either cannot be built here."""
    import ctypes
    fn = q_matmul_kernel(bits, compiler)
    setter = cpu_ops_function("set_q_matmul", [ctypes.c_int, ctypes.c_void_p], compiler)
    if fn is None or setter is None:
        return False
    setter(bits, ctypes.cast(fn, ctypes.c_void_p))
    return True


def gguf_linear_in_cpp(compiler: str) -> bool:
    """As q_linear_in_cpp, for overlap_engine::gguf_linear and gguf_kernel("gguf_matmul")."""
    import ctypes
    fn = gguf_kernel("gguf_matmul", compiler)
    setter = cpu_ops_function("set_gguf_matmul", [ctypes.c_void_p], compiler)
    if fn is None or setter is None:
        return False
    setter(ctypes.cast(fn, ctypes.c_void_p))
    return True


def float_linear_in_cpp(compiler: str) -> bool:
    """As q_linear_in_cpp, for overlap_engine::float_linear and gguf_kernel("float_matmul"), with
    gguf_kernel("silu_mul") for overlap_engine::row_silu_mul."""
    import ctypes
    fn, silu = gguf_kernel("float_matmul", compiler), gguf_kernel("silu_mul", compiler)
    setter = cpu_ops_function("set_float_matmul", [ctypes.c_void_p, ctypes.c_void_p], compiler)
    if fn is None or silu is None or setter is None:
        return False
    setter(ctypes.cast(fn, ctypes.c_void_p), ctypes.cast(silu, ctypes.c_void_p))
    return True


def decode_attention_in_cpp(dtype, D: int, Hkv: int, G: int, E: int, compiler: str) -> bool:
    """As q_linear_in_cpp, for overlap_engine::decode_attention_c and cpu_kernel(dtype, D, Hkv, G, E)."""
    import ctypes
    fn = cpu_kernel(dtype, D, Hkv, G, compiler, E)
    i64 = ctypes.c_int64
    setter = cpu_ops_function("set_decode_attention", [ctypes.c_int, i64, i64, i64, i64, ctypes.c_void_p],
                              compiler)
    if fn is None or setter is None:
        return False
    setter(int(dtype == torch.bfloat16), D, Hkv, G, E, ctypes.cast(fn, ctypes.c_void_p))
    return True
