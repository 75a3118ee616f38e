"""Kimi-Linear MLA decode in latent space against the latent-cache read floor and against the expanded form, in
one run, at Kimi-Linear-48B-A3B's attention shapes (TP1: 32 heads, kv_lora_rank 512, rope 64, nope 128, v 128).

    python test/benchmark/bench_mla_attention.py                  # CUDA (H200): the table below
    python test/benchmark/bench_mla_attention.py --sweep          # also every launch shape of the kernel per case
    python test/benchmark/bench_mla_attention.py --device cpu --iters 1   # interpreter smoke run, tiny shapes

Per case (rows x cached context, W new tokens per row):
- kernel us: `mla_attention` alone (absorbed queries over the paged latents, splits + combine), a CUDA graph of
  20 launches, median of `--iters` replays; floor us: the latents it must read (rows x context x 576 x 2 bytes) at
  4.8 TB/s; the ratio of the two.
- latent layer us: the whole attention layer (projections, latent write, absorption, kernel, W_UV, o_proj)
  captured as one CUDA graph (this is also the check that the decode path captures: no host sync, no shape from
  the contexts); expanded layer us: the same layer in the expanded form (gathered latents decompressed through
  kv_b_proj, paged attention), eager (its shapes follow the longest context); the speed-up of latent over it.
Each case first checks that the two forms agree. Without CUDA (and without `--device cpu`) it prints a line and
exits 0.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys

# the CPU smoke run needs Triton's interpreter, which is chosen when the kernels are defined (at import)
if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1 :][:1] == ["cpu"]:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from lightllm.cache.kv_cache import KVCache  # noqa: E402
from lightllm.kernels.mla_attention import MLATile, launch_splits, mla_attention_triton  # noqa: E402
from lightllm.models.config import AttentionConfig  # noqa: E402
from lightllm.models.context import build_context  # noqa: E402
from lightllm.models.layers.mla import LatentAttention  # noqa: E402

HBM_BYTES_PER_S = 4.8e12
KIMI = dict(
    hidden=2304,
    cfg=AttentionConfig(
        kind="mla",
        num_heads=32,
        num_kv_heads=32,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
    ),
)
TINY = dict(
    hidden=48,
    cfg=AttentionConfig(
        kind="mla", num_heads=4, num_kv_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16
    ),
)
# name -> (rows, cached tokens per row, new tokens per row)
CASES = {
    "decode b64 @8k": (64, 8192, 1),
    "decode b64 @32k": (64, 32768, 1),
    "verify W=2 b64 @8k": (64, 8192, 2),
    "decode b1 @32k": (1, 32768, 1),
    "decode b256 @8k": (256, 8192, 1),
}
TINY_CASES = {"decode b3 @70": (3, 70, 1), "verify W=2 b2 @40": (2, 40, 2)}
SWEEP = {
    "block_heads": (16, 32),
    "max_tile_rows": (16, 32),
    "block_keys": (16, 32, 64),
    "num_warps": (4, 8),
    "num_stages": (1, 2, 3),
    "min_tile_rows": (16, 64),
}


def make_layer(shape: dict, dtype, device) -> LatentAttention:
    c, h, hidden = shape["cfg"], shape["cfg"].num_heads, shape["hidden"]
    layer = LatentAttention(c, kv_layer=0)
    gen = torch.Generator().manual_seed(0)

    def w(*dims):
        return (torch.randn(*dims, generator=gen) * dims[-1] ** -0.5).to(dtype).to(device)

    layer.set_weights(
        q_proj=w(h * c.qk_head_dim, hidden),
        kv_a=w(c.kv_lora_rank + c.qk_rope_head_dim, hidden),
        kv_norm=torch.ones(c.kv_lora_rank, dtype=dtype, device=device),
        kv_b=w(h * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
        o_proj=w(hidden, h * c.v_head_dim),
    )
    return layer


def make_step(shape: dict, rows: int, cached: int, new: int, dtype, device):
    """A cache holding every row's context at shuffled slots with random latents, and the step's context."""
    c = shape["cfg"]
    total = cached + new
    kv = KVCache(1, c.kv_cache_shapes, rows * total, rows, total, dtype, device)
    # released in a random order, the slots are handed out shuffled: no row's latents are contiguous
    kv.allocator.free(np.random.default_rng(0).permutation(kv.allocator.alloc(rows * total)))
    kv_rows = [kv.alloc_row() for _ in range(rows)]
    kv.extend_many(np.array(kv_rows), np.full(rows, total))
    kv.buffers[0].normal_()
    ctx = build_context([new] * rows, [cached] * rows, 0, kv_rows, kv, decode_width=new)
    x = torch.randn(ctx.num_tokens, shape["hidden"], dtype=dtype, device=device)
    return kv, ctx, x


def graph_us(fn, iters: int, launches: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    return _median_us(graph.replay, iters, launches)


def eager_us(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    return _median_us(fn, iters, 1)


def _median_us(fn, iters: int, launches: int) -> float:
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / launches)
    return statistics.median(times)


def kernel_launch(layer, kv, ctx, tile: MLATile):
    """The attention kernel alone on the decode group, with absorbed queries of the right shape."""
    c, g = layer.cfg, ctx.groups[0]
    n, wq = g.token_index.shape
    pool = kv.buffers[0][0]
    q_lat = torch.randn(
        n * wq, layer.num_heads, c.kv_lora_rank + c.qk_rope_head_dim, dtype=pool.dtype, device=pool.device
    )
    out = q_lat.new_zeros(n * wq, layer.num_heads, c.kv_lora_rank)
    splits = launch_splits(layer.num_heads, n, wq, kv.max_req_len, pool.device, tile)
    if pool.device.type != "cuda":
        splits = 2
    query_start = torch.arange(0, n * wq, wq, dtype=torch.int32, device=pool.device)

    def run():
        mla_attention_triton(
            q_lat,
            pool,
            g.table,
            query_start,
            g.query_len,
            g.num_cached,
            c.qk_head_dim**-0.5,
            wq,
            out,
            table_rows=g.table_rows,
            num_splits=splits,
            tile=tile,
        )

    return run, splits


def layer_forward(layer, x, ctx, latent: bool):
    def run():
        layer.latent_max_query_len = 1 << 30 if latent else 0
        return layer(x, ctx)

    return run


def run_case(name, shape, rows, cached, new, dtype, device, iters, sweep) -> None:
    torch.manual_seed(0)
    layer = make_layer(shape, dtype, device)
    kv, ctx, x = make_step(shape, rows, cached, new, dtype, device)
    c = shape["cfg"]
    floor_us = rows * (cached + new) * (c.kv_lora_rank + c.qk_rope_head_dim) * kv.buffers[0].element_size()
    floor_us = floor_us / HBM_BYTES_PER_S * 1e6
    latent_fn = layer_forward(layer, x, ctx, latent=True)
    expanded_fn = layer_forward(layer, x, ctx, latent=False)
    with torch.no_grad():
        out_latent = latent_fn().float()
        try:
            out_expanded = expanded_fn().float()
        except torch.OutOfMemoryError:
            out_expanded = None
            torch.cuda.empty_cache()
        if out_expanded is not None:
            err = ((out_latent - out_expanded).norm() / out_expanded.norm()).item()
            assert err < (2e-2 if dtype == torch.bfloat16 else 1e-4), f"{name}: latent vs expanded rel err {err:.2e}"
        kernel, splits = kernel_launch(layer, kv, ctx, MLATile())
        if device.type != "cuda":
            kernel()
            print(f"| {name} | {splits} | smoke run: latent == expanded, kernel launched | | | | | |")
            return
        t_kernel = graph_us(kernel, iters)
        t_latent = graph_us(latent_fn, iters, launches=5)
        t_expanded = eager_us(expanded_fn, max(3, iters // 10)) if out_expanded is not None else float("nan")
        print(
            f"| {name} | {splits} | {t_kernel:.1f} | {floor_us:.1f} | {t_kernel / floor_us:.2f}x | "
            f"{t_latent:.1f} | {t_expanded:.1f} | {t_expanded / t_latent:.1f}x |",
            flush=True,
        )
        if sweep:
            for values in itertools.product(*SWEEP.values()):
                tile = MLATile(**dict(zip(SWEEP, values)))
                try:
                    fn, s = kernel_launch(layer, kv, ctx, tile)
                    t = graph_us(fn, iters)
                except Exception as e:  # a launch shape past the SM's registers / shared memory
                    print(f"|   {tile} | failed: {type(e).__name__} |")
                    continue
                print(f"|   {tile} | {s} | {t:.1f} | {t / floor_us:.2f}x |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--sweep", action="store_true", help="time every launch shape of SWEEP per case")
    p.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    a = p.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("bench_mla_attention: no CUDA device, skipped")
        return
    device = torch.device(a.device)
    cpu = device.type == "cpu"
    dtype = torch.float32 if cpu else torch.bfloat16
    shape, cases = (TINY, TINY_CASES) if cpu else (KIMI, CASES)
    if a.cases:
        cases = {k: v for k, v in cases.items() if k in a.cases.split(",")}
    gpu = "CPU (Triton interpreter)" if cpu else torch.cuda.get_device_name()
    print(f"MLA latent-space decode, Kimi-Linear-48B-A3B attention (TP1), {gpu}, {dtype}, torch {torch.__version__}")
    print(f"kernel: median of {a.iters} graph replays of 20 launches; floor: latent bytes / 4.8 TB/s\n")
    print("| case | splits | kernel us | floor us | kernel / floor | latent layer us | expanded layer us | speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (rows, cached, new) in cases.items():
        run_case(name, shape, rows, cached, new, dtype, device, a.iters, a.sweep)


if __name__ == "__main__":
    main()
