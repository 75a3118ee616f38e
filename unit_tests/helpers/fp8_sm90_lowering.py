"""Compile the block-FP8 GEMM for sm_90 with every launch configuration it can take at the served dense shapes (the
heuristic's per M bucket and every tuning candidate, pointer and TMA loads); print one row per variant, exit 1 on
a failure, a register spill, or operand loads that are not multi-buffered (shared memory below `stages - 1`
operand tiles: Triton left them as plain loads, one K step at a time).

    python -m unit_tests.helpers.fp8_sm90_lowering

Run without `TRITON_INTERPRET` (the interpreter replaces the JIT functions this compiles); the test
`unit_tests/kernels/test_fp8_lowering.py` runs it in a clean subprocess.
"""

from __future__ import annotations

import sys
import traceback

from lightllm.kernels.fp8.configs import CUBLAS, heuristic_config
from lightllm.kernels.fp8.gemm import fp8_block_gemm_kernel
from lightllm.tools.tune_fp8_gemm import candidates
from unit_tests.helpers.sm90 import allocation, lower_sm90

BLOCK = (128, 128)


def configs() -> list[dict]:
    """Each distinct Triton configuration the heuristic or the tuner can give at 128 x 128 blocks."""
    out: list[dict] = []
    for m in (1, 17, 65, 4096):
        for c in [heuristic_config(m, BLOCK), *candidates(m, BLOCK)]:
            if c != CUBLAS and c not in out:
                out.append(c)
    return out


def lower(config: dict):
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], BLOCK[1]
    operand = "*fp8e4nv"
    types = {
        "a": f"tensordesc<fp8e4nv[{bm}, {bk}]>" if config["TMA"] else operand,
        "w": f"tensordesc<fp8e4nv[{bn}, {bk}]>" if config["TMA"] else operand,
        "a_s": "*fp32",
        "w_s": "*fp32",
        "o": "*bf16",
        "M": "i32",
        "N": "i32",
        "K": "i32",
    }
    # the served shapes: K a whole number of 128-wide scale groups
    constexprs = dict(
        BLOCK_N_SCALE=BLOCK[0],
        BM=bm,
        BN=bn,
        BK=bk,
        GROUP_M=config["GROUP_M"],
        TMA=config["TMA"],
        SCALAR_W_SCALE=BLOCK[0] % bn == 0,
        EVEN_K=True,
    )
    return lower_sm90(fp8_block_gemm_kernel, constexprs, config["num_warps"], config["num_stages"], types)


def main() -> int:
    failures = 0
    print("| tile | warps | stages | loads | registers | spill store bytes | shared bytes | buffered |")
    print("|---|---|---|---|---|---|---|---|")
    for c in configs():
        tile = f"{c['BLOCK_M']}x{c['BLOCK_N']}"
        loads = "tma" if c["TMA"] else "pointer"
        try:
            kernel = lower(c)
            alloc = allocation(kernel.asm["ptx"])
            stage_bytes = (c["BLOCK_M"] + c["BLOCK_N"]) * BLOCK[1]
            buffered = kernel.metadata.shared >= (c["num_stages"] - 1) * stage_bytes
            print(
                f"| {tile} | {c['num_warps']} | {c['num_stages']} | {loads} | {alloc} | {kernel.metadata.shared} | "
                f"{'yes' if buffered else 'NO'} |",
                flush=True,
            )
            failures += alloc.spill_store_bytes != 0 or not buffered
        except Exception:
            failures += 1
            print(f"| {tile} | {c['num_warps']} | {c['num_stages']} | {loads} | FAILED |\n{traceback.format_exc()}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
