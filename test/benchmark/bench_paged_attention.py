"""The paged-attention kernel with its context split across programs (the default when a launch has too few
programs to fill the GPU) against one program per query tile, in one run, at the served attention shapes.

    python test/benchmark/bench_paged_attention.py           # CUDA: a table of microseconds per launch
    python test/benchmark/bench_paged_attention.py --device cpu --iters 1   # interpreter smoke run, tiny contexts
    python test/benchmark/bench_paged_attention.py --sweep   # launch shapes of a long prefill chunk, TFLOP/s each

Rows: a prefix-cache hit (a short prompt chunk after a long cached prefix), decode and verify batches over long
contexts, and launches that already fill the GPU (a long prefill chunk, a large decode batch), where both columns
must be the same launch. Every cell checks that the two outputs agree before it is timed (CUDA graphs of 20
launches, median of `--iters` replays).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

# the CPU smoke run needs Triton's interpreter, which is chosen when the kernels are defined (at import)
if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1 :][:1] == ["cpu"]:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402

from lightllm.kernels import paged_attention as kernel  # noqa: E402

# (query heads, key heads, Dk, Dv)
SHAPES = {"qwen3.5-attention": (16, 2, 256, 256), "kimi-mla": (32, 32, 192, 128)}
# name -> (cached tokens per row, new tokens per row, rows)
CASES = {
    "hit 8192+100": (8192, 100, 1),
    "hit 32768+100": (32768, 100, 1),
    "decode b1 @8k": (8192, 1, 1),
    "decode b8 @8k": (8192, 1, 8),
    "verify W=4 b8 @8k": (8192, 4, 8),
    "decode b64 @2k": (2048, 1, 64),
    "decode b256 @1k": (1024, 1, 256),
    "prefill 4096 @4k": (4096, 4096, 1),
}
TINY = {"hit 40+9": (40, 9, 1), "decode b3 @70": (70, 1, 3)}


def make_inputs(shape, cached, new, rows, dtype, device):
    heads, kv_heads, dk, dv = shape
    ctx = cached + new
    slots = torch.randperm(rows * ctx, device=device).view(rows, ctx)
    k_pool = torch.randn(rows * ctx, kv_heads, dk, dtype=dtype, device=device)
    v_pool = torch.randn(rows * ctx, kv_heads, dv, dtype=dtype, device=device)
    q = torch.randn(rows * new, heads, dk, dtype=dtype, device=device)
    ints = dict(dtype=torch.int32, device=device)
    starts = torch.arange(rows, **ints) * new
    lens = torch.full((rows,), new, **ints)
    prefix = torch.full((rows,), cached, **ints)
    return q, k_pool, v_pool, slots, starts, lens, prefix


def launch(inputs, scale, new, ctx, splits, tile=None):
    q, k_pool, v_pool, slots, starts, lens, prefix = inputs
    out = torch.empty(q.shape[0], q.shape[1], v_pool.shape[-1], dtype=q.dtype, device=q.device)
    return lambda: kernel.paged_attention(
        q,
        k_pool,
        v_pool,
        slots,
        starts,
        lens,
        prefix,
        scale,
        new,
        out,
        max_context_len=ctx,
        num_splits=splits,
        tile=tile,
    )


# a long prefill chunk over no prefix and over a prefix as long as itself
SWEEP_CASES = {"chunk 8192 @0": (0, 8192, 1), "chunk 8192 @8192": (8192, 8192, 1)}


def sweep(dtype, device, iters: int) -> None:
    """Every launch shape of the sweep's grid at Qwen3.5's attention heads, per long-chunk case: milliseconds and
    TFLOP/s of the causal work, checked against the default shape's output first; shapes that do not fit the GPU
    (shared memory) say so."""
    shape = SHAPES["qwen3.5-attention"]
    heads, kv_heads, dk, dv = shape
    group = heads // kv_heads
    print(f"default tile of a long chunk: {kernel._tile(8192, group, dk, dtype.itemsize)}\n")
    print("| case | tokens / tile | keys / block | warps | stages | ms | TFLOP/s |")
    print("|---|---|---|---|---|---|---|")
    for case, (cached, new, rows) in SWEEP_CASES.items():
        torch.manual_seed(0)
        inputs = make_inputs(shape, cached, new, rows, dtype, device)
        ctx, scale = cached + new, dk**-0.5
        reference = launch(inputs, scale, new, ctx, 1)()
        flops = 4 * new * (cached + new / 2) * dk * heads * rows
        for bt in (64 // group, 128 // group):
            for bn, warps, stages in ((32, 4, 2), (32, 8, 2), (32, 8, 3), (64, 8, 2), (64, 8, 3)):
                tile = kernel.Tile(bt, max(16, bt * group), bn, warps, stages)
                fn = launch(inputs, scale, new, ctx, 1, tile)
                try:
                    diff = (fn().float() - reference.float()).abs().max().item()
                except triton.runtime.errors.OutOfResources as e:
                    print(f"| {case} | {bt} | {bn} | {warps} | {stages} | does not fit: {str(e)[:60]} | |")
                    continue
                assert diff < 2e-2, f"{case} {tile}: outputs differ by {diff}"
                us = time_us(fn, iters)
                print(
                    f"| {case} | {bt} | {bn} | {warps} | {stages} | {us / 1000:.2f} | {flops / us / 1e6:.0f} |",
                    flush=True,
                )


def time_us(fn, iters: int) -> float:
    if not torch.cuda.is_available():
        return float("nan")
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / 20)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--sweep", action="store_true", help="time launch shapes of a long prefill chunk (CUDA)")
    a = p.parse_args()
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if a.sweep:
        sweep(dtype, device, a.iters)
        return
    cases = CASES if device.type == "cuda" else TINY
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (Triton interpreter)"
    print(f"paged attention, {gpu}, {dtype}; us per launch (median of {a.iters} graph replays of 20 launches)\n")
    print("| shape | case | programs | splits | one program per tile us | split us | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for shape_name, shape in SHAPES.items():
        heads, kv_heads, dk, _ = shape
        for case, (cached, new, rows) in cases.items():
            torch.manual_seed(0)
            inputs = make_inputs(shape, cached, new, rows, dtype, device)
            ctx, scale = cached + new, dk**-0.5
            bk = max(16, triton.next_power_of_2(max(dk, shape[3])))
            tile = kernel._tile(new, heads // kv_heads, bk, dtype.itemsize)
            programs = triton.cdiv(new, tile.bt) * rows * kv_heads
            splits = kernel.num_context_splits(programs, ctx, tile.bn, device) if device.type == "cuda" else 3
            whole, split = launch(inputs, scale, new, ctx, 1), launch(inputs, scale, new, ctx, splits)
            diff = (whole().float() - split().float()).abs().max().item()
            assert diff < (2e-2 if dtype == torch.bfloat16 else 1e-4), f"{shape_name} {case}: outputs differ by {diff}"
            t_whole, t_split = time_us(whole, a.iters), time_us(split, a.iters)
            print(
                f"| {shape_name} | {case} | {programs} | {splits} | {t_whole:.1f} | {t_split:.1f} | "
                f"{t_whole / t_split:.2f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
