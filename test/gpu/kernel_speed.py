"""Kernel speed in one process, sized for one ~8-minute H200 command: (a) the block-FP8 GEMM tuned at the dense
layer shapes of Qwen3-Next-80B-A3B and Qwen3.5-35B-A3B (M 4096 / 8192) against the bf16 GEMM, (b) the MLA latent
decode kernel at Kimi-Linear-48B-A3B's shapes (batch 64, 8k / 32k context) over a sweep of launch tiles against
the latent-cache read floor, (c) the fused MoE tuned at the served expert shapes (batch buckets 1..256).

    python test/gpu/kernel_speed.py --out $OUT                  # all parts, tables to $OUT/tables and the repo
    python test/gpu/kernel_speed.py --out $OUT --parts fp8,mla  # a subset
    python test/gpu/kernel_speed.py --dry_run --out /tmp/ks     # CPU: tiny shapes under TRITON_INTERPRET=1

Each part has a time budget (`--fp8_budget_s`, `--mla_budget_s`, `--moe_budget_s`; candidates past it are left
out, never the first). Rows print as they finish. Every candidate is checked against a reference before it is
timed (FP8: dequantize-then-matmul; MLA: the torch path on four rows; MoE: the per-expert loop). Tables go to
`<out>/tables/<kernel>/<device>.json` (copy them to the repo path shown) and, unless `--no_repo_tables`, straight
into the package folders the kernels read. Without CUDA (and without `--dry_run`) it prints a line and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

# the dry run needs Triton's interpreter, which is chosen when the kernels are defined (at import)
if "--dry_run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from lightllm.kernels.fp8 import configs as fp8_configs  # noqa: E402
from lightllm.kernels.fp8.shapes import unique_gemms  # noqa: E402
from lightllm.kernels.fused_moe import configs as moe_configs  # noqa: E402
from lightllm.kernels.fused_moe.configs import batch_bucket, shape_key  # noqa: E402
from lightllm.kernels.fused_moe.shapes import SERVED_SHAPES, MoEShape  # noqa: E402
from lightllm.kernels.mla_attention import (  # noqa: E402
    CONFIG_DIR as MLA_CONFIG_DIR,
)
from lightllm.kernels.mla_attention import (
    MLATile,
    launch_splits,
    mla_attention_torch,
    mla_attention_triton,
    tile_key,
)
from lightllm.kernels.tuned_tables import device_name, write_entries  # noqa: E402
from lightllm.tools import tune_fp8_gemm, tune_fused_moe  # noqa: E402
from lightllm.tools.gpu_timing import copy_bandwidth, graph_us  # noqa: E402

FP8_MODELS = ["qwen3-next-80b-a3b", "qwen3.5-35b-a3b"]
FP8_M = [4096, 8192]
# Kimi-Linear-48B-A3B's MLA at TP1: heads, latent rank, rope dims; batch 64 at 8k and 32k cached tokens
MLA_SHAPE = (32, 512, 64)
MLA_CASES = {"decode b64 @8k": (64, 8192), "decode b64 @32k": (64, 32768)}
# launch tiles tried (block_heads, max_tile_rows, block_keys, warps, stages): each lowers for sm_90 without register
# spills with its latent loads multi-buffered (stages - 1 blocks in flight); 32-head tiles hold an SM alone
# (165-252 registers x 8 warps), 16-head ones of 4 warps fit two or three per SM (and keep 16-row tiles for verify);
# 16 warps (128 registers each) put twice the warps beside one latent block (more dots in flight while others wait
# on the softmax's row reductions); their MMA layout spreads the warps over the keys, so 64-key blocks compute each
# score twice (16 warps x 8 keys) and smaller blocks more often: only the 64-key one is tried
MLA_TILES = [
    (32, 32, 32, 8, 3),
    (16, 16, 16, 4, 4),
    (32, 32, 16, 8, 4),
    (16, 16, 16, 4, 5),
    (32, 32, 32, 8, 4),
    (16, 16, 16, 8, 4),
    (32, 32, 16, 8, 5),
    (32, 32, 64, 8, 3),
    (32, 32, 64, 16, 3),
]
# 64-row tiles (`min_tile_rows`: a 32-head decode tile padded, a two-token verify tile as it is): both dots on
# sm_90's warpgroup MMA; the shapes that lower without spills
MLA_PADDED_TILES = [(32, 64, 32, 8, 3), (32, 64, 32, 8, 2), (32, 64, 16, 8, 4), (32, 64, 16, 8, 5)]
# keys-major tiles (both dots transposed, on sm_90's warpgroup MMA: warps spread over the latent block, not over
# the keys); the 8-warp shapes that lower for sm_90 within its shared memory without spilling more than 48 bytes
MLA_KEYS_MAJOR_TILES = [(32, 32, keys, 8, stages) for keys, stages in ((32, 3), (32, 4), (16, 4), (64, 2), (64, 3))]
# waves of SMs a split launch aims to fill: a tile that fits several programs per SM fills them with more splits
MLA_WAVES = (2, 4, 8)
MOE_SHAPES = ["qwen3.5-35b-a3b", "qwen3-next-80b-a3b", "kimi-linear-48b-a3b"]
# coarse buckets first, then the ones between: a budget that runs out leaves gaps, which take the nearest tuned
# bucket's entry, rather than leaving the large batches to a small batch's entry
MOE_BATCHES = [1, 256, 64, 16, 128, 32, 4, 8, 2]
# the heuristic's tiles at these batch sizes are in this grid, so a tuned entry is never slower than the fallback
MOE_GRID = {
    "BLOCK_M": (16, 32, 64),
    "BLOCK_N": (32, 64, 128),
    "BLOCK_K": (64, 128),
    "num_warps": (4, 8),
    "num_stages": (3,),
}
# the dry run's tiny stand-ins
DRY_FP8 = {(45, 64): "tiny odd N", (64, 96): "tiny"}
DRY_M = [5, 40]
DRY_MLA_SHAPE = (4, 32, 8)
DRY_MLA_CASES = {"decode b3 @70": (3, 70)}
DRY_MLA_TILES = [(4, 4, 16, 4, 1), (2, 4, 16, 4, 1)]
DRY_MLA_PADDED_TILES = [(4, 4, 16, 4, 1)]
DRY_MLA_KEYS_MAJOR_TILES = [(4, 4, 16, 4, 1)]
DRY_MOE = [MoEShape("tiny-moe", 8, 2, 32, 24)]
DRY_MOE_GRID = {"BLOCK_M": (16,), "BLOCK_N": (16, 32), "BLOCK_K": (16,), "num_warps": (4,), "num_stages": (1,)}


class Report:
    """Prints rows as they finish and keeps them for `<out>/kernel_speed.md`."""

    def __init__(self, out: Path):
        self.path = out / "kernel_speed.md"
        self.lines: list[str] = []

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)
        self.path.write_text("\n".join(self.lines) + "\n")


def save_table(src_dir: Path, device: str, out: Path, kernel: str, key: str, buckets: dict, repo: bool) -> str:
    """Merge the entries into `<out>/tables/<kernel>/<device>.json` and (when `repo`) into the package's table."""
    write_entries(out / "tables" / kernel / f"{device}.json", key, buckets)
    if repo:
        write_entries(src_dir / f"{device}.json", key, buckets)
    return str(src_dir / f"{device}.json")


def part_fp8(args, device: torch.device, out: Path, echo: Report) -> None:
    shapes, ms, block = (DRY_FP8, DRY_M, (32, 32)) if args.dry_run else (unique_gemms(FP8_MODELS), FP8_M, (128, 128))
    echo(f"## (a) block-FP8 GEMM vs bf16 `torch.matmul` ({', '.join(FP8_MODELS)} dense layers)\n")
    staged = out / "tables" / "fp8_gemm" / f"{device_name(device)}.json"
    results = tune_fp8_gemm.tune_table(
        shapes, ms, staged, device, block, args.fp8_budget_s, quick=args.dry_run, echo=echo
    )
    if not args.no_repo_tables:
        for t in results:
            write_entries(
                fp8_configs.config_path(device_name(device)),
                fp8_configs.shape_key(t.n, t.k, block),
                {batch_bucket(t.m): t.config},
            )
    big = [t for t in results if t.m >= 4096 and not math.isnan(t.bf16_us)]
    if big:
        ratios = [t.bf16_us / t.us for t in big]
        echo(
            f"\nM >= 4096: bf16 / fp8 min {min(ratios):.2f}x, geometric mean "
            f"{math.exp(statistics.fmean(math.log(r) for r in ratios)):.2f}x (target >= 1.6x)"
        )
    echo(f"table: {staged} -> {fp8_configs.config_path(device_name(device))}\n")


def mla_problem(rows: int, cached: int, shape: tuple[int, int, int], dtype, device):
    """Latents of `rows` rows of `cached + 1` positions at shuffled pool slots, one absorbed query token per row."""
    heads, rank, rope = shape
    total = cached + 1
    gen = torch.Generator(device=device).manual_seed(rows + cached)
    latent = torch.randn(rows * total, rank + rope, generator=gen, device=device).to(dtype)
    slots = torch.randperm(rows * total, generator=gen, device=device).view(rows, total).to(torch.int32)
    q = torch.randn(rows, heads, rank + rope, generator=gen, device=device).to(dtype)
    ints = dict(dtype=torch.int32, device=device)
    meta = (torch.arange(rows, **ints), torch.ones(rows, **ints), torch.full((rows,), cached, **ints))
    return q, latent, slots, meta


def mla_case(name, rows, cached, shape, tiles, dtype, device, bandwidth, deadline, echo) -> dict:
    """Time every tile (checked first against the torch path on four rows) on one case; `{tile: us / floor}`."""
    heads, rank, rope = shape
    q, latent, slots, (q_start, q_len, n_cached) = mla_problem(rows, cached, shape, dtype, device)
    floor_us = rows * (cached + 1) * (rank + rope) * latent.element_size() / bandwidth * 1e6
    out = torch.empty(rows, heads, rank, dtype=dtype, device=device)
    # the reference on four rows (the torch path gathers every row's context in fp32)
    n = min(4, rows)
    ref = torch.full((n, heads, rank), float("nan"), dtype=dtype, device=device)
    mla_attention_torch(q[:n], latent, slots[:n], q_start[:n], q_len[:n], n_cached[:n], rank**-0.5, 1, ref)
    ratios = {}
    for i, tile in enumerate(tiles):
        if i and time.monotonic() > deadline:
            echo(f"| {name} | {len(tiles) - i} tiles left out: budget spent | | | | | |")
            break
        splits = launch_splits(heads, rows, 1, cached + 1, device, tile) if device.type == "cuda" else 2

        def run(tile=tile, splits=splits):
            mla_attention_triton(
                q, latent, slots, q_start, q_len, n_cached, rank**-0.5, 1, out, num_splits=splits, tile=tile
            )

        label = f"{tile.block_heads}, {tile.max_tile_rows}, {tile.block_keys}, {tile.num_warps}, "
        label += f"{tile.num_stages}, {tile.waves}, {tile.min_tile_rows}, {tile.keys_major}"
        try:
            out.fill_(float("nan"))
            run()
            err = tune_fp8_gemm.relative_error(out[:n], ref)
            if not err < (2e-2 if dtype == torch.bfloat16 else 1e-4):
                echo(f"| {name} | {label} | {splits} | wrong: rel err {err:.2e} | | | |")
                continue
            us = graph_us(run, device=device)
        except Exception as e:  # a tile past the SM's registers / shared memory is skipped
            echo(f"| {name} | {label} | {splits} | failed: {type(e).__name__} | | | |")
            continue
        ratios[tile] = us / floor_us
        echo(f"| {name} | {label} | {splits} | {us:.1f} | {floor_us:.1f} | {us / floor_us:.2f}x | {err:.1e} |")
    return ratios


def compile_mla_tiles(shape, tiles, dtype, device) -> None:
    """Launch each tile once (split) on a short context, so the per-case budgets time tiles rather than compile
    them (a tile that fails is reported by `mla_case`)."""
    heads, rank, _ = shape
    q, latent, slots, (q_start, q_len, n_cached) = mla_problem(1, 64, shape, dtype, device)
    out = torch.empty(1, heads, rank, dtype=dtype, device=device)
    for tile in dict.fromkeys(dataclasses.replace(t, waves=2) for t in tiles):
        try:
            mla_attention_triton(q, latent, slots, q_start, q_len, n_cached, 1.0, 1, out, num_splits=2, tile=tile)
        except Exception:
            continue


def part_mla(args, device: torch.device, out: Path, echo: Report) -> None:
    dry = args.dry_run
    shape, cases = (DRY_MLA_SHAPE, DRY_MLA_CASES) if dry else (MLA_SHAPE, MLA_CASES)
    tiles = [MLATile(*t, waves=w) for t in (DRY_MLA_TILES if dry else MLA_TILES) for w in ((2,) if dry else MLA_WAVES)]
    padded, min_rows = (DRY_MLA_PADDED_TILES, 32) if dry else (MLA_PADDED_TILES, 64)
    tiles += [MLATile(*t, waves=w, min_tile_rows=min_rows) for t in padded for w in ((2,) if dry else MLA_WAVES)]
    keys_major = DRY_MLA_KEYS_MAJOR_TILES if dry else MLA_KEYS_MAJOR_TILES
    tiles += [MLATile(*t, waves=w, keys_major=True) for t in keys_major for w in ((2,) if dry else MLA_WAVES)]
    dtype = torch.float32 if dry else torch.bfloat16
    heads, rank, rope = shape
    bandwidth = copy_bandwidth(device) if not dry else 1e12
    echo(f"## (b) MLA latent decode, Kimi-Linear-48B-A3B attention (TP1: {heads} heads, rank {rank}, rope {rope})\n")
    echo(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write of a 2 GiB buffer); floor = latent bytes / it\n")
    start = time.monotonic()
    compile_mla_tiles(shape, tiles, dtype, device)
    echo(f"(compiled the tiles in {time.monotonic() - start:.0f} s)\n")
    echo(
        "| case | tile (heads, rows, keys, warps, stages, waves, min rows, keys major) | splits | us | floor us | "
        "us / floor "
        "| rel err |"
    )
    echo("|---|---|---|---|---|---|---|")
    ratios: dict[MLATile, list[float]] = {}
    for i, (name, (rows, cached)) in enumerate(cases.items()):
        # each case gets an even share of what is left, so the last one is not starved
        deadline = time.monotonic() + (args.mla_budget_s - (time.monotonic() - start)) / (len(cases) - i)
        for tile, r in mla_case(name, rows, cached, shape, tiles, dtype, device, bandwidth, deadline, echo).items():
            ratios.setdefault(tile, []).append(r)
    complete = {t: r for t, r in ratios.items() if len(r) == len(cases)}
    if not complete:
        echo("no tile ran every case: no table entry\n")
        return
    best = min(complete, key=lambda t: statistics.fmean(math.log(r) for r in complete[t]))
    default = complete.get(MLATile())
    echo(
        f"\nbest tile {best}: us / floor {', '.join(f'{r:.2f}x' for r in complete[best])} "
        f"(default tile: {', '.join(f'{r:.2f}x' for r in default) if default else 'not run'}; target <= 1.5x at 32k)"
    )
    key = tile_key(heads, rank, rope, dtype)
    # one entry at the tuned batch: `get_tile` takes the nearest row bucket, so it serves every batch
    rows = batch_bucket(next(iter(cases.values()))[0])
    path = save_table(
        MLA_CONFIG_DIR, device_name(device), out, "mla", key, {rows: best.__dict__}, not args.no_repo_tables
    )
    echo(f"table: {out / 'tables' / 'mla'} -> {path}\n")


def part_moe(args, device: torch.device, out: Path, echo: Report) -> None:
    dry = args.dry_run
    shapes = DRY_MOE if dry else [SERVED_SHAPES[s] for s in MOE_SHAPES]
    batches, grid = ([1, 8], DRY_MOE_GRID) if dry else (MOE_BATCHES, MOE_GRID)
    dtype = torch.float32 if dry else torch.bfloat16
    echo("## (c) fused MoE tuned at the served expert shapes (both grouped GEMMs, bf16)\n")
    echo("| shape | tokens | tuned us | config |\n|---|---|---|---|")
    start = time.monotonic()
    for i, shape in enumerate(shapes):
        # each shape gets an even share of what is left, so the last one is not starved
        deadline = time.monotonic() + (args.moe_budget_s - (time.monotonic() - start)) / (len(shapes) - i)
        key = shape_key(shape.num_experts, shape.inter, shape.hidden, shape.top_k, dtype)
        for tokens in batches:
            if time.monotonic() > deadline:
                echo(f"| {shape.name} | {tokens} | left out: budget spent | |")
                continue
            config, ms = tune_fused_moe.tune_one(shape, tokens, dtype, grid, device=device.type)
            save_table(
                moe_configs.CONFIG_DIR,
                device_name(device),
                out,
                "fused_moe",
                key,
                {batch_bucket(tokens): config},
                not args.no_repo_tables,
            )
            echo(f"| {shape.name} | {tokens} | {ms * 1e3:.1f} | {config} |")
    echo(f"\ntable: {out / 'tables' / 'fused_moe'} -> {moe_configs.config_path(device_name(device))}\n")


PARTS = {"fp8": part_fp8, "mla": part_mla, "moe": part_moe}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for the report and the produced tables")
    p.add_argument("--parts", default="fp8,mla,moe", help=f"of {list(PARTS)}")
    p.add_argument("--fp8_budget_s", type=float, default=130)
    p.add_argument("--mla_budget_s", type=float, default=130)
    p.add_argument("--moe_budget_s", type=float, default=120)
    p.add_argument("--no_repo_tables", action="store_true", help="write the tables under --out only")
    p.add_argument("--dry_run", action="store_true", help="CPU, tiny shapes, Triton's interpreter")
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("kernel_speed: no CUDA device; skipped (--dry_run checks the script on the CPU)")
        return 0
    device = torch.device("cpu" if args.dry_run else "cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    echo = Report(out)
    import triton

    gpu = "CPU (Triton interpreter)" if args.dry_run else torch.cuda.get_device_name()
    echo(f"# kernel speed: {gpu}, torch {torch.__version__}, triton {triton.__version__}\n")
    start = time.monotonic()
    failed = []
    for part in args.parts.split(","):
        t0 = time.monotonic()
        # one bounded run: a part that fails is reported and the others still run
        try:
            PARTS[part](args, device, out, echo)
        except Exception:
            failed.append(part)
            echo(f"part {part} failed:\n```\n{traceback.format_exc()}```")
        echo(f"({part}: {time.monotonic() - t0:.0f} s)\n")
    echo(f"total {time.monotonic() - start:.0f} s" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
