"""Fused multiply-adds in the q/k norm + RoPE kernel lowered for sm_90: one line `DTYPE FUSION COUNT` per dtype,
with the launch's own compile options (`qk_norm_rope.LAUNCH_OPTIONS`) and with fp fusion on (what Triton does by
default), counting every `fma.*` instruction of the PTX.

    python -m unit_tests.helpers.rope_sm90_fma

Run without `TRITON_INTERPRET` (the interpreter replaces the JIT function this compiles).
"""

from __future__ import annotations

import re

from lightllm.kernels.qk_norm_rope import LAUNCH_OPTIONS, qk_norm_rope_kernel
from unit_tests.helpers.sm90 import lower_sm90

POINTERS = ("q", "k", "q_out", "k_out", "q_weight", "k_weight", "cos", "sin")
STRIDES = ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_c")
# Qwen3.5 / Qwen3-Next gated attention at TP1: 16 query heads, 2 key heads of 256, a quarter rotated
SHAPE = dict(HQ=16, HK=2, D=256, RD=64, BH=8, BD=256)


def fma_count(dtype: str, options: dict) -> int:
    types = {**{n: f"*{dtype}" for n in POINTERS}, **{n: "i64" for n in STRIDES}, "eps": "fp32"}
    extra = {k: v for k, v in options.items() if k != "num_warps"}
    kernel = lower_sm90(qk_norm_rope_kernel, SHAPE, options["num_warps"], 1, types, extra)
    return len(re.findall(r"\bfma\.", kernel.asm["ptx"]))


def main() -> None:
    for dtype in ("bf16", "fp16", "fp32"):
        for name, options in (("launch", LAUNCH_OPTIONS), ("fused", {**LAUNCH_OPTIONS, "enable_fp_fusion": True})):
            print(dtype, name, fma_count(dtype, options), flush=True)


if __name__ == "__main__":
    main()
