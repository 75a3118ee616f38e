"""Compile the fused MoE kernels for sm_90 at the served MoE shapes with the tiles the heuristic picks on CUDA;
print one row per variant, exit 1 on a failure or a register spill.

    python -m unit_tests.helpers.moe_sm90_lowering

Run without `TRITON_INTERPRET` (the interpreter replaces the JIT functions this compiles); the test
`unit_tests/kernels/fused_moe/test_sm90_lowering.py` runs it in a clean subprocess.
"""

from __future__ import annotations

import sys
import traceback

import torch
import triton

from lightllm.kernels.fused_moe.align import (
    moe_align_count_kernel,
    moe_align_plan_kernel,
    moe_align_scatter_kernel,
    tile_sizes,
)
from lightllm.kernels.fused_moe.combine import moe_combine_kernel
from lightllm.kernels.fused_moe.configs import heuristic_config
from lightllm.kernels.fused_moe.grouped_gemm import moe_down_kernel, moe_gate_up_kernel
from lightllm.kernels.fused_moe.routing import moe_sigmoid_topk_kernel, moe_softmax_topk_kernel
from lightllm.kernels.fused_moe.shapes import SERVED_SHAPES
from unit_tests.helpers.sm90 import compile_sm90

INTS = ("T", "E", "H", "I", "num_pairs", "num_experts")
ROUTING_TYPES = {
    "T": "i32",
    "E": "i32",
    "logits": "*bf16",
    "bias": "*fp32",
    "weights": "*fp32",
    "ids": "*i32",
    "scale": "fp32",
}
GEMM_TYPES = {"sorted_pairs": "*i32", "block_expert": "*i32", "weights": "*fp32", "pair_out": "*fp32"}
ALIGN_TYPES = {
    "ids": "*i32",
    "chunk_counts": "*i32",
    "chunk_offsets": "*i32",
    "pad_start": "*i32",
    "expert_count": "*i32",
    "sorted_pairs": "*i32",
    "block_expert": "*i32",
    "num_pairs": "i32",
    "num_chunks": "i32",
    "num_blocks": "i32",
    "E": "i32",
}
COMBINE_TYPES = {"pair_out": "*fp32", "shared": "*bf16", "gate_logit": "*bf16", "out": "*bf16"}


def _types(extra: dict, act: str) -> dict:
    return {**{n: "i32" for n in INTS}, "x": act, "gate_up": act, "act": act, "down": act, **extra}


def _reduced_dim(shape, gemm: str) -> int:
    """K of a grouped GEMM (hidden for gate/up, intermediate for down): its launch sets EVEN_K from it."""
    return shape.hidden if gemm == "gate_up" else shape.inter


def cases() -> list[tuple[str, object, dict, dict, int, int]]:
    """(label, kernel, constexprs, types, warps, stages) of every variant the served shapes launch."""
    out = []
    for s in SERVED_SHAPES.values():
        be, bkp = triton.next_power_of_2(s.num_experts), triton.next_power_of_2(s.top_k)
        route = dict(TOP_K=s.top_k, BT=8, BE=be, BKP=bkp, NORM=True)
        if s.scoring == "sigmoid":
            for groups, top in ((1, 1), (8, 4)):
                c = {**route, "NUM_GROUPS": groups, "TOPK_GROUPS": top, "BG": groups}
                out.append((f"{s.name} sigmoid_topk groups={groups}", moe_sigmoid_topk_kernel, c, ROUTING_TYPES, 4, 1))
        else:
            out.append((f"{s.name} softmax_topk", moe_softmax_topk_kernel, route, ROUTING_TYPES, 4, 1))
        tiles = tile_sizes(s.num_experts, 16)
        out.append((f"{s.name} align_count", moe_align_count_kernel, dict(BP=tiles["BP"], BE=be), ALIGN_TYPES, 8, 1))
        for bm in (16, 64, 128):
            tiles = tile_sizes(s.num_experts, bm)
            c = dict(BM=bm, BE=be, BCH=tiles["BCH"])
            out.append((f"{s.name} align_plan BM={bm}", moe_align_plan_kernel, c, ALIGN_TYPES, 8, 1))
            c = dict(BM=bm, BP=tiles["BP"], BE=be, BB=tiles["BB"])
            out.append((f"{s.name} align_scatter BM={bm}", moe_align_scatter_kernel, c, ALIGN_TYPES, 8, 1))
        for tokens in (1, 64, 256, 2048, 16384):
            config = heuristic_config(tokens, s.num_experts, s.inter, s.hidden, s.top_k, torch.bfloat16)
            for name, kernel in (("gate_up", moe_gate_up_kernel), ("down", moe_down_kernel)):
                t = config[name]
                c = dict(
                    TOP_K=s.top_k,
                    BM=config["BLOCK_M"],
                    BN=t["BLOCK_N"],
                    BK=t["BLOCK_K"],
                    DOT_PRECISION="tf32",
                    FP8=False,
                    BLOCK_N_SCALE=128,
                    EVEN_K=_reduced_dim(s, name) % t["BLOCK_K"] == 0,
                )
                label = f"{s.name} {name} T={tokens} BM={c['BM']} BN={c['BN']} BK={c['BK']}"
                out.append((label, kernel, c, _types(GEMM_TYPES, "*bf16"), t["num_warps"], t["num_stages"]))
        bn = min(512, triton.next_power_of_2(s.hidden))
        c = dict(TOP_K=s.top_k, BT=2048 // bn, BN=bn, HAS_SHARED=True, HAS_GATE=s.scoring == "softmax")
        out.append((f"{s.name} combine", moe_combine_kernel, c, {**COMBINE_TYPES, "T": "i32", "H": "i32"}, 4, 1))
    # block-FP8 experts (128 x 128 scale blocks) at Qwen3-Next's shape, decode and prefill tiles
    s = SERVED_SHAPES["qwen3-next-80b-a3b"]
    fp8_types = _types({**GEMM_TYPES, "x_s": "*fp32", "w_s": "*fp32", "act_s": "*fp32"}, "*fp8e4nv")
    for tokens in (1, 2048, 16384):
        config = heuristic_config(tokens, s.num_experts, s.inter, s.hidden, s.top_k, torch.bfloat16, fp8=True)
        for name, kernel in (("gate_up", moe_gate_up_kernel), ("down", moe_down_kernel)):
            t = config[name]
            c = dict(
                TOP_K=s.top_k,
                BM=config["BLOCK_M"],
                BN=t["BLOCK_N"],
                BK=128,
                DOT_PRECISION="tf32",
                FP8=True,
                BLOCK_N_SCALE=128,
                EVEN_K=_reduced_dim(s, name) % 128 == 0,
            )
            types = {**fp8_types, "act": "*bf16"} if name == "gate_up" else fp8_types
            out.append((f"{s.name} fp8 {name} T={tokens}", kernel, c, types, t["num_warps"], t["num_stages"]))
    return out


def main() -> int:
    failures = 0
    print("| kernel | warps | stages | registers | spill store bytes |\n|---|---|---|---|---|")
    for label, kernel, constexprs, types, warps, stages in cases():
        try:
            alloc = compile_sm90(kernel, constexprs, warps, stages, types)
            print(f"| {label} | {warps} | {stages} | {alloc} |", flush=True)
            failures += alloc.spill_store_bytes != 0
        except Exception:
            failures += 1
            print(f"| {label} | {warps} | {stages} | FAILED | |\n{traceback.format_exc()}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
