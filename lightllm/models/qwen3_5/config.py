"""`config.json` of Qwen3.5 (dense and MoE, text-only or the VLM's `text_config`) -> ModelConfig.

Qwen3.5 shares Qwen3-Next's attention and MoE; it differs in the GDN projection layout (split, not grouped) and
in the FFN policy: the dense model has SwiGLU everywhere, the MoE model routes on every layer and always
renormalises the top-k weights. Its interleaved M-RoPE reduces to plain partial RoPE for text (all three position
streams are equal).
"""

from __future__ import annotations

from lightllm.models.config import DENSE, MOE, ModelConfig
from lightllm.models.qwen3_next.config import build_qwen_config, qwen_moe


def map_config(raw: dict) -> ModelConfig:
    num_layers = raw["num_hidden_layers"]
    if raw.get("num_experts"):
        return build_qwen_config(raw, "qwen3_5", (MOE,) * num_layers, qwen_moe(raw, True))
    return build_qwen_config(raw, "qwen3_5", (DENSE,) * num_layers, None)
