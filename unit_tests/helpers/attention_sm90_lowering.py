"""Lower the paged attention kernel's prefill tiles for sm_90 at the served head shapes: one line per shape,
`NAME BT BM BN REGISTERS SPILL_BYTES SHARED_BYTES`, with the tile `paged_attention._tile` picks for a long chunk.

    python -m unit_tests.helpers.attention_sm90_lowering

Run without `TRITON_INTERPRET` (the interpreter replaces the JIT function this compiles).
"""

from __future__ import annotations

import triton

from lightllm.kernels.paged_attention import _tile, paged_attention_kernel
from unit_tests.helpers.sm90 import allocation, lower_sm90

# name: (query heads, key heads, key dim, value dim), TP1, 16-bit
SHAPES = {
    "qwen3.5 gqa": (16, 2, 256, 256),
    "kimi mla expanded": (32, 32, 192, 128),
}
TYPES = {
    **{n: "*bf16" for n in ("q", "k_pool", "v_pool", "o")},
    **{"o_part": "*fp32", "ml_part": "*fp32", "slot_table": "*i64", "table_rows": "*i64"},
    **{n: "*i32" for n in ("query_start", "query_len", "num_cached")},
    **{"qk_scale": "fp32", "num_tokens": "i32", "num_heads": "i32", "num_splits": "i32"},
}


def main() -> None:
    for name, (h, hk, dk, dv) in SHAPES.items():
        bk, bv = triton.next_power_of_2(dk), triton.next_power_of_2(dv)
        tile = _tile(4096, h // hk, max(bk, bv), 2)
        constexprs = dict(GROUP=h // hk, DK=dk, DV=dv, BT=tile.bt, BM=tile.bm, BN=tile.bn, BK=bk, BV=bv)
        constexprs.update(DOT_PRECISION="tf32", SPLIT=False, HAS_TABLE_ROWS=False)
        kernel = lower_sm90(paged_attention_kernel, constexprs, tile.num_warps, tile.num_stages, TYPES)
        regs = allocation(kernel.asm["ptx"])
        print(
            name, tile.bt, tile.bm, tile.bn, regs.registers, regs.spill_store_bytes, kernel.metadata.shared, flush=True
        )


if __name__ == "__main__":
    main()
