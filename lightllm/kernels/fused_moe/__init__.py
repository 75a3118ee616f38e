"""Fused mixture-of-experts in Triton: device routing, per-expert padded layout, grouped GEMMs, combine.

`softmax_topk` / `sigmoid_topk` route, `fused_experts` runs the routed SwiGLU experts and the combine (with the
shared expert folded in). See each module for its layout; `configs.py` for the launch tables.
"""

from lightllm.kernels.fused_moe.configs import get_config, heuristic_config
from lightllm.kernels.fused_moe.fused_moe import fused_experts
from lightllm.kernels.fused_moe.routing import sigmoid_topk, softmax_topk

__all__ = ["fused_experts", "get_config", "heuristic_config", "sigmoid_topk", "softmax_topk"]
