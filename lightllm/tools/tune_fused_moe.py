"""Tune the fused MoE's launch configurations on this GPU and write them to the package's table for this device.

    python -m lightllm.tools.tune_fused_moe --shapes qwen3.5-35b-a3b,kimi-linear-48b-a3b [--tp 1] \
        [--dtype bfloat16] [--batches 1,2,4,8,16,32,64,128,256,512] [--output FILE] [--grid full|quick|prefill]

For each shape and batch bucket it routes random tokens (softmax top-k over random logits), then, for every
BLOCK_M, times each grouped GEMM alone over its tile candidates (BLOCK_N, BLOCK_K, warps, stages) and keeps the
BLOCK_M whose best pair is fastest. The winner is checked against the per-expert torch loop before it is written
(`lightllm/kernels/fused_moe/configs/<device>.json`, under this Triton version; other entries are kept).
Candidates that do not compile or do not fit in shared memory are skipped. `--grid quick` tries a reduced grid,
`--grid prefill` tall blocks and wide tiles for prefill token counts.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time

import torch
import triton
import triton.testing

from lightllm.kernels.fused_moe.align import align_pairs
from lightllm.kernels.fused_moe.configs import batch_bucket, config_path, device_name, shape_key
from lightllm.kernels.fused_moe.fused_moe import fused_experts
from lightllm.kernels.fused_moe.grouped_gemm import down_weighted, gate_up_swiglu
from lightllm.kernels.fused_moe.routing import softmax_topk
from lightllm.kernels.fused_moe.shapes import SERVED_SHAPES, MoEShape
from lightllm.kernels.tuned_tables import write_entries
from lightllm.models.layers.moe import run_experts

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
FULL_GRID = {
    "BLOCK_M": (16, 32, 64, 128),
    "BLOCK_N": (32, 64, 128),
    "BLOCK_K": (64, 128, 256),
    "num_warps": (4, 8),
    "num_stages": (2, 3, 4),
}
QUICK_GRID = {"BLOCK_M": (16, 64), "BLOCK_N": (64, 128), "BLOCK_K": (64, 128), "num_warps": (4,), "num_stages": (3,)}
# prefill token counts (hundreds of rows per expert): tall blocks and wide tiles, where the GEMMs are compute-bound
PREFILL_GRID = {
    "BLOCK_M": (64, 128),
    "BLOCK_N": (64, 128, 256),
    "BLOCK_K": (64, 128),
    "num_warps": (4, 8),
    "num_stages": (3, 4),
}
GRIDS = {"full": FULL_GRID, "quick": QUICK_GRID, "prefill": PREFILL_GRID}


def tiles(grid: dict) -> list[dict]:
    keys = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
    return [dict(zip(keys, values)) for values in itertools.product(*(grid[k] for k in keys))]


def time_ms(fn) -> float:
    """Median ms of `fn` on the GPU, inf when it does not compile or run (too much shared memory, too many
    registers); without CUDA (interpreter checks of the tuning scripts) one wall-clock run."""
    try:
        if not torch.cuda.is_available():
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        fn()
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")
    except (triton.runtime.errors.OutOfResources, triton.CompilationError, RuntimeError):
        return math.inf


def problem(shape: MoEShape, num_tokens: int, dtype: torch.dtype, seed: int = 0, device: str = "cuda"):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(num_tokens, shape.hidden, device=device, generator=gen).to(dtype)
    gate_up = torch.randn(shape.num_experts, 2 * shape.inter, shape.hidden, device=device, generator=gen)
    down = torch.randn(shape.num_experts, shape.hidden, shape.inter, device=device, generator=gen)
    gate_up = (gate_up / math.sqrt(shape.hidden)).to(dtype)
    down = (down / math.sqrt(shape.inter)).to(dtype)
    logits = torch.randn(num_tokens, shape.num_experts, device=device, generator=gen)
    weights, ids = softmax_topk(logits, shape.top_k, True)
    return x, gate_up, down, weights, ids


def tune_one(
    shape: MoEShape, num_tokens: int, dtype: torch.dtype, grid: dict, device: str = "cuda"
) -> tuple[dict, float]:
    """The fastest configuration of one shape and token count, and its ms for both GEMMs (`device` "cpu": the
    interpreter, a check of the script)."""
    x, gate_up, down, weights, ids = problem(shape, num_tokens, dtype, device=device)
    pairs = num_tokens * shape.top_k
    # the down GEMM is timed on real activations (zeros would let nothing overflow, garbage could be NaN)
    act = torch.randn(pairs, shape.inter, device=device).to(dtype)
    pair_out = torch.empty(pairs, shape.hidden, dtype=torch.float32, device=device)
    flat_weights = weights.reshape(-1)
    best, best_ms = None, math.inf
    # blocks much taller than an expert's expected rows only add padding: not worth timing
    rows = num_tokens * shape.top_k / shape.num_experts
    for block_m in [m for m in grid["BLOCK_M"] if m == min(grid["BLOCK_M"]) or m <= 2 * rows]:
        blocks = align_pairs(ids, shape.num_experts, block_m)
        gate_up_ms = {
            json.dumps(t): time_ms(lambda t=t, b=blocks: gate_up_swiglu(x, gate_up, b, shape.top_k, t, act))
            for t in tiles(grid)
        }
        down_ms = {
            json.dumps(t): time_ms(
                lambda t=t, b=blocks: down_weighted(act, down, flat_weights, b, shape.top_k, t, pair_out)
            )
            for t in tiles(grid)
        }
        g, d = min(gate_up_ms, key=gate_up_ms.get), min(down_ms, key=down_ms.get)
        total = gate_up_ms[g] + down_ms[d]
        if total < best_ms:
            best, best_ms = {"BLOCK_M": block_m, "gate_up": json.loads(g), "down": json.loads(d)}, total
    if best is None:
        raise RuntimeError(f"{shape.name} at {num_tokens} tokens: no candidate ran")
    check(best, x, gate_up, down, weights, ids)
    return best, best_ms


def check(config: dict, x, gate_up, down, weights, ids) -> None:
    """The chosen configuration must reproduce the per-expert loop (fp32 reference)."""
    out = fused_experts(x, gate_up, down, weights, ids, config=config).float()
    ref = run_experts(x.float(), gate_up.float(), down.float(), weights, ids.long())
    err = ((out - ref).norm() / ref.norm()).item()
    if not err < 2e-2:
        raise RuntimeError(f"config {config} gives relative error {err:.3e} against the loop")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m lightllm.tools.tune_fused_moe", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen3.5-35b-a3b,qwen3-next-80b-a3b,kimi-linear-48b-a3b")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument(
        "--data_type", default="bfloat16", choices=tuple(DTYPES), help="activations and experts (the server's flag)"
    )
    p.add_argument("--batches", default="1,2,4,8,16,32,64,128,256,512")
    p.add_argument("--output", default=None, help="table file (default: the package's table of this device)")
    p.add_argument(
        "--grid", default="full", choices=tuple(GRIDS), help="candidates: all, a reduced grid, prefill-sized tiles"
    )
    args = p.parse_args(argv)
    unknown = sorted(set(args.shapes.split(",")) - set(SERVED_SHAPES))
    if unknown:
        p.error(f"--shapes: unknown {', '.join(unknown)}; choose from {', '.join(SERVED_SHAPES)}")
    if not torch.cuda.is_available():
        raise SystemExit("tune_fused_moe needs a CUDA device")
    dtype = DTYPES[args.data_type]
    device = torch.device("cuda")
    path = args.output or str(config_path(device_name(device)))
    grid = GRIDS[args.grid]
    for name in args.shapes.split(","):
        shape = SERVED_SHAPES[name].sharded(args.tp)
        key = shape_key(shape.num_experts, shape.inter, shape.hidden, shape.top_k, dtype)
        for num_tokens in (int(b) for b in args.batches.split(",")):
            config, ms = tune_one(shape, batch_bucket(num_tokens), dtype, grid)
            write_entries(path, key, {batch_bucket(num_tokens): config})
            print(f"{shape.name} tokens {batch_bucket(num_tokens):4d}: {ms * 1e3:8.1f} us  {json.dumps(config)}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
