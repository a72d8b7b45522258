"""
Benchmarks for overlap_engine. One subcommand per benchmark:

  python bench.py kernels            # decode attention: achieved HBM GB/s vs torch SDPA (needs CUDA)
  python bench.py kernels --quick    # one small shape, to check that it runs

Without CUDA `kernels` says so and runs one tiny shape under the Triton interpreter instead.
"""

import argparse
import time

import torch
import torch.nn.functional as F

import kernels

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
        return kernels.decode_attention(q, k_cache, v_cache, req_to_token, rows, seq_lens, sm_scale, args.splits)

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
        args.batches, args.contexts, args.hq, args.hkv, args.head_dim = "2", "64", 8, 2, 32
        args.dtype, args.warmup, args.iters = "float32", 1, 2
    elif args.quick:
        args.batches, args.contexts, args.warmup, args.iters = "64", "1024", 2, 5
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
    print("bytes counted: K+V of every context token of every request + q + o + the int32 req_to_token slots;")
    print("triton = decode_attention (2 kernels); sdpa = F.scaled_dot_product_attention alone on K/V already")
    print("gathered dense; gather+sdpa = k_cache[req_to_token] gather then SDPA. Same bytes for every column.")
    print(f"mean of {args.iters} back-to-back calls after {args.warmup} warm-up calls; peak = {peak or '?'} GB/s\n")
    configs = [(B, ctx) for B in batches for ctx in contexts]
    rows = []  # printed after the loop, so the progress bar does not cut through the table
    for B, ctx in _progress(configs):
        nbytes = decode_bytes(B, ctx, args.hq, args.hkv, args.head_dim, elem)
        r = bench_decode(B, ctx, args, k_cache, v_cache, device, dtype)
        gbps = {k: nbytes / (r[k] * 1e-6) / 1e9 for k in ("triton", "sdpa", "gather_sdpa")}
        pct = f"{100 * gbps['triton'] / peak:.0f}%" if peak else "-"
        rows.append(f"| {B} | {ctx} | {nbytes / 1e6:.1f} | {r['triton']:.1f} | {gbps['triton']:.0f} | {pct} "
                    f"| {gbps['sdpa']:.0f} | {gbps['gather_sdpa']:.0f} | {r['sdpa'] / r['triton']:.2f}x "
                    f"| {r['err']:.1e} |")
    print("| B | ctx | MB | triton µs | triton GB/s | % peak | sdpa GB/s | gather+sdpa GB/s | triton / sdpa "
          "| max err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


def _progress(configs):
    """tqdm over the configs when there are more than a few; the plain list otherwise."""
    if len(configs) <= 3:
        return configs
    from tqdm import tqdm

    return tqdm(configs, desc="decode configs", leave=False)


# ----------------------------------------------------------------------------------------------
# command line


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    k = sub.add_parser("kernels", help="decode attention bandwidth vs torch SDPA")
    k.add_argument("--batches", default=KERNEL_BATCHES, help="comma-separated batch sizes")
    k.add_argument("--contexts", default=KERNEL_CONTEXTS, help="comma-separated context lengths")
    k.add_argument("--hq", type=int, default=KERNEL_HQ, help="query heads")
    k.add_argument("--hkv", type=int, default=KERNEL_HKV, help="kv heads")
    k.add_argument("--head-dim", type=int, default=KERNEL_D)
    k.add_argument("--dtype", default=KERNEL_DTYPE, choices=["float16", "bfloat16", "float32"])
    k.add_argument("--splits", type=int, default=KERNEL_SPLITS, help="num_kv_splits of decode_attention")
    k.add_argument("--warmup", type=int, default=KERNEL_WARMUP)
    k.add_argument("--iters", type=int, default=KERNEL_ITERS)
    k.add_argument("--contiguous-slots", action="store_true", help="each request's slots in order, not shuffled")
    k.add_argument("--peak-gbps", type=float, default=None, help="HBM roofline, if the GPU is not in the table")
    k.add_argument("--quick", action="store_true", help="one small shape (B=64, ctx=1024), few iterations")
    k.set_defaults(fn=cmd_kernels)

    args = p.parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
