"""`config.json` of Qwen3-Next (and the fields Qwen3.5 shares with it) -> ModelConfig."""

from __future__ import annotations

from lightllm.linear_att import LinearAttSpec
from lightllm.models.config import (
    DENSE,
    FULL,
    LINEAR,
    MOE,
    AttentionConfig,
    ModelConfig,
    MoEConfig,
    eos_ids,
    first_present,
    rope_parameters,
    rope_scaling,
)


def qwen_layer_types(raw: dict) -> tuple[str, ...]:
    """Explicit `layer_types`, or every `full_attention_interval`-th layer (1-based) is full attention."""
    num_layers = raw["num_hidden_layers"]
    if raw.get("layer_types"):
        return tuple(raw["layer_types"])
    interval = raw.get("full_attention_interval", 4)
    return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers))


def qwen_attention(raw: dict) -> AttentionConfig:
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    # merged over every spelling: YaRN added as `rope_scaling` keeps the theta and share `rope_parameters` gives
    rope = rope_parameters(raw)
    theta = rope.get("rope_theta", 10000.0)
    partial = rope.get("partial_rotary_factor", 1.0)
    return AttentionConfig(
        kind="gated",
        num_heads=raw["num_attention_heads"],
        num_kv_heads=raw["num_key_value_heads"],
        head_dim=head_dim,
        rotary_dim=int(head_dim * partial),
        rope_theta=float(theta),
        rope_scaling=rope_scaling(raw),
        bias=bool(raw.get("attention_bias", False)),
    )


def gdn_spec(raw: dict, num_linear_layers: int) -> LinearAttSpec:
    return LinearAttSpec(
        algo="gdn",
        num_layers=num_linear_layers,
        num_k_heads=raw["linear_num_key_heads"],
        num_v_heads=raw["linear_num_value_heads"],
        head_k_dim=raw["linear_key_head_dim"],
        head_v_dim=raw["linear_value_head_dim"],
        conv_kernel_size=raw.get("linear_conv_kernel_dim", 4),
    )


def qwen_moe(raw: dict, norm_topk_prob: bool) -> MoEConfig:
    return MoEConfig(
        scoring="softmax",
        num_experts=raw["num_experts"],
        top_k=raw["num_experts_per_tok"],
        intermediate_size=raw["moe_intermediate_size"],
        norm_topk_prob=norm_topk_prob,
        shared_intermediate_size=raw.get("shared_expert_intermediate_size", 0) or 0,
        shared_expert_gate=bool(raw.get("shared_expert_intermediate_size")),
    )


MTP_DEPTH_KEYS = ("num_mtp_layers", "mtp_num_hidden_layers", "num_nextn_predict_layers")


def num_mtp_layers(raw: dict) -> int:
    return int(first_present(raw, *MTP_DEPTH_KEYS, default=0))


def build_qwen_config(raw: dict, arch: str, ffn_types: tuple[str, ...], moe: MoEConfig | None) -> ModelConfig:
    layer_types = qwen_layer_types(raw)
    return ModelConfig(
        arch=arch,
        model_type=raw["model_type"],
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        layer_types=layer_types,
        ffn_types=ffn_types,
        intermediate_size=raw.get("intermediate_size") or 0,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        zero_centered_norm=True,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention=qwen_attention(raw),
        linear=gdn_spec(raw, sum(t == LINEAR for t in layer_types)),
        moe=moe,
        num_mtp_layers=num_mtp_layers(raw),
        torch_dtype=str(first_present(raw, "dtype", "torch_dtype", default="bfloat16")),
        eos_token_ids=eos_ids(raw),
    )


def map_config(raw: dict) -> ModelConfig:
    """Qwen3-Next: MoE on every `decoder_sparse_step`-th layer not in `mlp_only_layers`, dense SwiGLU elsewhere."""
    num_layers = raw["num_hidden_layers"]
    num_experts = raw.get("num_experts", 0) or 0
    step = raw.get("decoder_sparse_step", 1) or 1
    dense_only = set(raw.get("mlp_only_layers") or [])
    ffn_types = tuple(
        MOE if num_experts > 0 and i not in dense_only and (i + 1) % step == 0 else DENSE for i in range(num_layers)
    )
    moe = qwen_moe(raw, bool(raw.get("norm_topk_prob", True))) if MOE in ffn_types else None
    return build_qwen_config(raw, "qwen3_next", ffn_types, moe)
