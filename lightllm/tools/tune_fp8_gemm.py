"""Tune the block-FP8 GEMM's launch configurations on this GPU and write them to the package's table for this device.

    python -m lightllm.tools.tune_fp8_gemm [--models qwen3-next-80b-a3b,qwen3.5-35b-a3b] [--m 4096,8192] \
        [--nk 12352:2048,...] [--output FILE] [--budget_s 240] [--quick]

For each weight shape (N, K) of the models (or `--nk`) and each token count M it times the candidate
configurations (tile, group, warps, stages, TMA or pointer loads: `candidates`) on random operands, keeps the
fastest one whose output matches the dequantize-then-matmul reference, and merges it into
`lightllm/kernels/fp8/configs/<device>.json` under this Triton version and M's power-of-two bucket (other entries
are kept). Candidates that do not compile or fit are skipped; the bf16 GEMM of the same shape is timed beside it.
`--budget_s` bounds the whole sweep (each shape still gets its first candidate, the heuristic's choice).
`--device cpu` runs tiny shapes through Triton's interpreter (a check of the script, no timing worth reading).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
import time
from dataclasses import dataclass, field

# the CPU check needs Triton's interpreter, which is chosen when the kernels are defined (at import)
if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1 :][:1] == ["cpu"]:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from lightllm.kernels.fp8 import (  # noqa: E402
    fp8_block_gemm,
    fp8_block_gemm_reference,
    quantize_activation_groups,
    quantize_weight_blocks,
)
from lightllm.kernels.fp8.configs import CUBLAS, config_path, heuristic_config, shape_key  # noqa: E402
from lightllm.kernels.fp8.shapes import SERVED_GEMMS, unique_gemms  # noqa: E402
from lightllm.kernels.tuned_tables import batch_bucket, device_name, write_entries  # noqa: E402
from lightllm.tools.tune_fused_moe import time_ms  # noqa: E402

# (BM, BN, num_warps, num_stages): tiles that lower for sm_90 without register spills with their loads pipelined;
# wgmma needs 64-row tiles per warp group, decode-sized M keeps 16-row tiles (mma) and narrow columns
LARGE_M_TILES = ((128, 128, 8, 3), (128, 128, 8, 4), (64, 128, 4, 3), (64, 128, 4, 4), (128, 64, 4, 4), (64, 256, 8, 3))
SMALL_M_TILES = ((16, 64, 4, 3), (16, 128, 4, 4), (32, 64, 4, 4), (64, 64, 4, 3), (64, 128, 4, 3))
QUICK_TILES = ((16, 32, 4, 2), (32, 32, 4, 2))
MAX_REL = 1e-2


# launch-order groups tried besides 8 (row tiles sharing a weight tile in L2) for two prefill tiles
WIDE_GROUPS = (16,)
WIDE_GROUP_TILES = ((128, 128, 8, 3), (64, 128, 4, 3))


def candidates(m: int, block: tuple[int, int], quick: bool = False) -> list[dict]:
    """The heuristic's configuration first, then every tile of M's size class with pointer and TMA loads (two
    prefill tiles also with wider launch-order groups)."""
    tiles = QUICK_TILES if quick else LARGE_M_TILES if m > 64 else SMALL_M_TILES
    grouped = [(t, 8) for t in tiles]
    if tiles is LARGE_M_TILES:
        grouped += [(t, g) for t in WIDE_GROUP_TILES for g in WIDE_GROUPS]
    out = [heuristic_config(batch_bucket(m), block)]
    for ((bm, bn, warps, stages), group), tma in itertools.product(grouped, (False, True)):
        c = {"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": group, "num_warps": warps, "num_stages": stages, "TMA": tma}
        if c not in out:
            out.append(c)
    # cuBLASLt's block-scaled GEMM, where torch and the GPU offer it (a candidate that raises is skipped)
    if not quick and tuple(block) == (128, 128):
        out.append(CUBLAS)
    return out


@dataclass
class Tuned:
    """The outcome for one (N, K, M): the best configuration, its time, the bf16 GEMM's, and what was skipped."""

    n: int
    k: int
    m: int
    config: dict
    us: float
    bf16_us: float
    err: float
    tried: int
    # the heuristic's configuration (the first candidate) and the activation quantization a layer adds
    heuristic_us: float = math.nan
    quant_us: float = math.nan
    failed: list[str] = field(default_factory=list)

    def tflops(self, us: float) -> float:
        return 2 * self.m * self.n * self.k / us / 1e6


def time_us(fn) -> float:
    """Median µs of `fn` (the fused MoE tuner's timer: inf when a candidate does not compile or fit)."""
    return time_ms(fn) * 1e3


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def tune_shape(
    n: int,
    k: int,
    m: int,
    device: torch.device,
    block: tuple[int, int] = (128, 128),
    deadline: float = math.inf,
    quick: bool = False,
) -> Tuned:
    """Time the candidates of one (N, K, M) until `deadline` (time.monotonic; the first always runs) and return the
    fastest that matches the reference (RuntimeError when none does)."""
    gen = torch.Generator(device=device).manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen, device=device) / math.sqrt(k)).to(torch.bfloat16)
    w_q, w_s = quantize_weight_blocks(w, block)
    a_q, a_s = quantize_activation_groups(x, block[1])
    ref = fp8_block_gemm_reference(a_q, a_s, w_q, w_s, torch.float32, block)
    best: tuple[float, dict, float] | None = None
    failed: list[str] = []
    tried = 0
    heuristic_us = math.nan
    for config in candidates(m, block, quick):
        if tried and time.monotonic() > deadline:
            break
        tried += 1
        try:
            out = fp8_block_gemm(a_q, a_s, w_q, w_s, torch.bfloat16, block, config=config)
        except Exception as e:  # a candidate that does not compile, fit or exist here is skipped, not fatal
            failed.append(f"{describe(config)}: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
            continue
        err = relative_error(out, ref)
        if not err < MAX_REL:
            failed.append(f"{describe(config)}: relative error {err:.2e}")
            continue
        us = time_us(lambda c=config: fp8_block_gemm(a_q, a_s, w_q, w_s, torch.bfloat16, block, config=c))
        heuristic_us = us if tried == 1 else heuristic_us
        if best is None or us < best[0]:
            best = (us, config, err)
    if best is None:
        raise RuntimeError(f"fp8 GEMM N={n} K={k} M={m}: no candidate ran correctly: {failed}")
    on_gpu = device.type == "cuda"
    bf16_us = time_us(lambda: torch.matmul(x, w.T)) if on_gpu else math.nan
    quant_us = time_us(lambda: quantize_activation_groups(x, block[1])) if on_gpu else math.nan
    return Tuned(n, k, m, best[1], best[0], bf16_us, best[2], tried, heuristic_us, quant_us, failed)


def describe(c: dict) -> str:
    if c == CUBLAS:
        return "cublas"
    tile = f"{c['BLOCK_M']}x{c['BLOCK_N']} g{c['GROUP_M']} w{c['num_warps']} s{c['num_stages']}"
    return tile + (" tma" if c["TMA"] else " ptr")


def compile_candidates(
    n: int, k: int, ms: list[int], device: torch.device, block: tuple[int, int], quick: bool = False
) -> None:
    """Launch every candidate of every M once on a short problem of one weight shape, so that the budget shares of
    `tune_table` time candidates rather than compile them: the kernel specialises on the shapes' divisibility, not
    their sizes, so one shape's variants serve every served shape (a candidate that fails is left to
    `tune_shape`)."""
    gen = torch.Generator(device=device).manual_seed(0)
    w_q, w_s = quantize_weight_blocks(torch.randn(n, k, generator=gen, device=device).to(torch.bfloat16), block)
    for m in ms:
        x = torch.randn(min(m, 256), k, generator=gen, device=device).to(torch.bfloat16)
        a_q, a_s = quantize_activation_groups(x, block[1])
        for config in candidates(m, block, quick):
            try:
                fp8_block_gemm(a_q, a_s, w_q, w_s, torch.bfloat16, block, config=config)
            except Exception:  # reported by tune_shape, which runs it again
                continue


def format_row(name: str, t: Tuned) -> str:
    tile = describe(t.config)
    return (
        f"| {name} | {t.m} | {t.n} | {t.k} | {t.bf16_us:.1f} | {t.tflops(t.bf16_us):.0f} | {t.heuristic_us:.1f} | "
        f"{t.us:.1f} | {t.tflops(t.us):.0f} | {t.bf16_us / t.us:.2f}x | {t.bf16_us / (t.us + t.quant_us):.2f}x | "
        f"{tile} | {t.tried} | {t.err:.1e} |"
    )


HEADER = (
    "| shape | M | N | K | bf16 us | bf16 TFLOP/s | fp8 heuristic us | fp8 tuned us | fp8 TFLOP/s | bf16 / fp8 | "
    "bf16 / (quant + fp8) | best config | tried | rel err |\n" + "|---" * 14 + "|"
)


def tune_table(
    shapes: dict[tuple[int, int], str],
    ms: list[int],
    path: str | os.PathLike,
    device: torch.device,
    block: tuple[int, int] = (128, 128),
    budget_s: float = math.inf,
    quick: bool = False,
    echo=print,
) -> list[Tuned]:
    """Tune every (N, K) of `shapes` at every M within `budget_s` seconds in all (the candidates compiled first,
    then the rest shared evenly, so a late shape is not starved) and merge each result into the table file `path`
    as it finishes."""
    results = []
    reported: set[str] = set()
    jobs = [(nk, m) for nk in shapes for m in ms]
    start = time.monotonic()
    compile_candidates(*next(iter(shapes)), ms, device, block, quick)
    echo(f"(compiled the candidates in {time.monotonic() - start:.0f} s)")
    echo(HEADER)
    for i, ((n, k), m) in enumerate(jobs):
        # this job's share: what is left divided over the jobs left
        left = budget_s - (time.monotonic() - start)
        deadline = time.monotonic() + left / (len(jobs) - i)
        t = tune_shape(n, k, m, device, block, deadline, quick)
        write_entries(path, shape_key(n, k, block), {batch_bucket(m): t.config})
        results.append(t)
        echo(format_row(shapes[(n, k)], t))
        # each reason once: a candidate this torch / GPU lacks fails the same way at every shape
        for reason in t.failed:
            if reason not in reported:
                reported.add(reason)
                echo(f"|   skipped {reason} |")
    return results


def main(argv: list[str] | None = None) -> list[Tuned]:
    p = argparse.ArgumentParser(prog="python -m lightllm.tools.tune_fp8_gemm", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(SERVED_GEMMS), help=f"of {sorted(SERVED_GEMMS)}")
    p.add_argument("--nk", default=None, help="explicit N:K shapes (comma separated) instead of --models")
    p.add_argument("--m", default="4096,8192", help="token counts (each tunes its power-of-two bucket)")
    p.add_argument("--block", default="128,128")
    p.add_argument("--output", default=None, help="table file (default: the package's table of this device)")
    p.add_argument("--budget_s", type=float, default=math.inf, help="bound on the whole sweep (seconds)")
    p.add_argument("--quick", action="store_true", help="two small candidate tiles (a check of the script)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = p.parse_args(argv)
    unknown = sorted(set(args.models.split(",")) - set(SERVED_GEMMS))
    if unknown and not args.nk:
        p.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(sorted(SERVED_GEMMS))}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("tune_fp8_gemm needs a CUDA device (or --device cpu for an interpreter check)")
    device = torch.device(args.device)
    block = tuple(int(b) for b in args.block.split(","))
    if args.nk:
        shapes = {tuple(int(d) for d in nk.split(":")): f"N:K {nk}" for nk in args.nk.split(",")}
    else:
        shapes = unique_gemms(args.models.split(","))
    path = args.output or str(config_path(device_name(device)))
    results = tune_table(shapes, [int(m) for m in args.m.split(",")], path, device, block, args.budget_s, args.quick)
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
