"""Compile the MLA latent kernel and the split combine kernel for sm_90 at Kimi-Linear's shapes with the launch
shapes the wrapper picks on CUDA (and a 64-row padded tile at TP1); print one row per variant, exit 1 on a failure,
a register spill, latent gathers left single-buffered (every iteration waiting for its own loads), or a 64-row
tile whose dots do not lower to the warpgroup MMA (`wgmma`).

    python -m unit_tests.helpers.mla_sm90_lowering

Run without `TRITON_INTERPRET` (the interpreter replaces the JIT functions this compiles); the test
`unit_tests/kernels/test_mla_lowering.py` runs it in a clean subprocess.
"""

from __future__ import annotations

import re
import sys
import traceback

import triton

from lightllm.kernels.attention_splits import MAX_SPLITS, paged_attention_combine_kernel
from lightllm.kernels.mla_attention import MLATile, _tile, mla_attention_kernel, tile_query_lengths
from unit_tests.helpers.sm90 import allocation, lower_sm90

# heads per rank (Kimi-Linear TP1, TP2), latent rank, rope dims
SHAPES = {"kimi-linear-tp1": (32, 512, 64), "kimi-linear-tp2": (16, 512, 64)}
# (shape, tile) pairs lowered: the default tile at both shapes, and a 64-row tile (a 32-head decode tile padded, a
# two-token verify tile as it is) at TP1
PADDED = MLATile(max_tile_rows=64, block_keys=32, min_tile_rows=64)
# both dots transposed: rows of 32 keys and 512 latent dims, so both lower to the warpgroup MMA without padding
KEYS_MAJOR = MLATile(keys_major=True)
VARIANTS = [
    ("kimi-linear-tp1", MLATile()),
    ("kimi-linear-tp2", MLATile()),
    ("kimi-linear-tp1", PADDED),
    ("kimi-linear-tp1", KEYS_MAJOR),
]
TYPES = {
    "q": "*bf16",
    "latent": "*bf16",
    "o": "*bf16",
    "o_part": "*fp32",
    "ml_part": "*fp32",
    "slot_table": "*i64",
    "table_rows": "*i64",
    "query_start": "*i32",
    "query_len": "*i32",
    "num_cached": "*i32",
    "qk_scale": "fp32",
    "num_tokens": "i32",
    "num_heads": "i32",
    "num_splits": "i32",
}


def cases(heads: int, rank: int, rope: int, tile: MLATile = MLATile()) -> list[tuple[str, object, dict, int, int]]:
    """(label, kernel, constexprs, warps, stages) of every variant a layer at this shape launches."""
    out = []
    for query_len in tile_query_lengths(heads, tile):
        bh, bt, bm = _tile(heads, query_len, tile)
        for split in (False, True):
            c = dict(
                C=rank,
                R=rope,
                BH=bh,
                BT=bt,
                BM=bm,
                BN=tile.block_keys,
                BC=triton.next_power_of_2(rank),
                BR=max(16, triton.next_power_of_2(rope)),
                DOT_PRECISION="tf32",
                SPLIT=split,
                HAS_TABLE_ROWS=True,
                KEYS_MAJOR=tile.keys_major,
            )
            label = f"mla_attention BH={bh} BT={bt} split={split}" + (" keys-major" if tile.keys_major else "")
            out.append((label, mla_attention_kernel, c, tile.num_warps, tile.num_stages))
    combine = dict(SP=MAX_SPLITS, DV=rank, BV=triton.next_power_of_2(rank))
    out.append(("combine", paged_attention_combine_kernel, combine, 4, 1))
    return out


def buffered(kernel, compiled, stages: int) -> bool:
    """The latent kernel's gathers are multi-buffered (a wait that leaves copies in flight) when it has the stages
    for it; the combine kernel has no loop to pipeline."""
    if kernel is not mla_attention_kernel or stages < 3:
        return True
    return re.search(r"async_wait[^\n]*num = [1-9]", compiled.asm["ttgir"]) is not None


def main() -> int:
    failures = 0
    print(
        "| shape | kernel | warps | registers | spill store bytes | gathers buffered | dots |\n"
        "|---|---|---|---|---|---|---|"
    )
    for name, tile in VARIANTS:
        for label, kernel, constexprs, warps, stages in cases(*SHAPES[name], tile):
            try:
                compiled = lower_sm90(kernel, constexprs, warps, stages, TYPES)
                ptx = compiled.asm["ptx"]
                alloc = allocation(ptx)
                ok = buffered(kernel, compiled, stages)
                dots = "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "-"
                wide = kernel is mla_attention_kernel and (constexprs["BM"] >= 64 or constexprs["KEYS_MAJOR"])
                print(
                    f"| {name} | {label} BM={constexprs.get('BM', '-')} | {warps} | {alloc} | "
                    f"{'yes' if ok else 'NO'} | {dots} |",
                    flush=True,
                )
                failures += alloc.spill_store_bytes != 0 or not ok or (wide and dots != "wgmma")
            except Exception:
                failures += 1
                print(f"| {name} | {label} | {warps} | FAILED | |\n{traceback.format_exc()}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
