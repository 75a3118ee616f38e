"""`config.json` of Kimi-Linear (original remote-code spelling or transformers' spelling) -> ModelConfig."""

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
)


def kimi_layer_types(raw: dict, lin: dict) -> tuple[str, ...]:
    """`linear_attn_config.full_attn_layers` / `kda_layers` are 1-based; transformers also writes `layer_types`."""
    num_layers = raw["num_hidden_layers"]
    if "full_attn_layers" in lin:
        full = {i - 1 for i in lin["full_attn_layers"]}
        return tuple(FULL if i in full else LINEAR for i in range(num_layers))
    if raw.get("layer_types"):
        return tuple(raw["layer_types"])
    raise ValueError("kimi_linear config needs linear_attn_config.full_attn_layers or layer_types")


def kimi_ffn_types(raw: dict) -> tuple[str, ...]:
    num_layers = raw["num_hidden_layers"]
    if raw.get("mlp_layer_types"):
        return tuple(MOE if t == "sparse" else DENSE for t in raw["mlp_layer_types"])
    first_dense = raw.get("first_k_dense_replace", 1)
    return tuple(DENSE if i < first_dense else MOE for i in range(num_layers))


def map_config(raw: dict) -> ModelConfig:
    lin = raw.get("linear_attn_config") or {}
    layer_types = kimi_layer_types(raw, lin)
    num_heads = raw["num_attention_heads"]
    num_kv_heads = raw.get("num_key_value_heads") or num_heads
    if num_kv_heads != num_heads:
        raise ValueError(f"kimi_linear MLA expects num_key_value_heads == num_attention_heads, got {num_kv_heads}")
    # the released MLA uses no positions (NoPE), so rope_theta and rope_scaling change nothing; a rotary MLA would
    # need the rotation this engine does not apply
    if raw.get("mla_use_nope") is False:
        raise ValueError("kimi_linear with mla_use_nope false (rotary MLA) is not supported: only NoPE MLA is")
    if raw.get("q_lora_rank"):
        raise ValueError("kimi_linear with q_lora_rank is not supported (no released checkpoint uses it)")
    # the latent projection and o_proj would carry biases the latent-space attention does not add
    if raw.get("attention_bias"):
        raise ValueError("kimi_linear with attention_bias true is not supported (no released checkpoint uses it)")
    attention = AttentionConfig(
        kind="mla",
        num_heads=num_heads,
        num_kv_heads=num_heads,
        bias=False,
        kv_lora_rank=raw["kv_lora_rank"],
        qk_nope_head_dim=raw["qk_nope_head_dim"],
        qk_rope_head_dim=raw["qk_rope_head_dim"],
        v_head_dim=raw["v_head_dim"],
    )
    head_dim = first_present(lin, "head_dim", default=raw.get("linear_head_dim", 128))
    num_lin_heads = first_present(lin, "num_heads", default=raw.get("linear_num_heads", 32))
    spec = LinearAttSpec(
        algo="kda",
        num_layers=sum(t == LINEAR for t in layer_types),
        num_k_heads=num_lin_heads,
        num_v_heads=num_lin_heads,
        head_k_dim=head_dim,
        head_v_dim=head_dim,
        conv_kernel_size=first_present(lin, "short_conv_kernel_size", default=raw.get("linear_conv_kernel_dim", 4)),
    )
    ffn_types = kimi_ffn_types(raw)
    moe = None
    if MOE in ffn_types:
        moe = MoEConfig(
            scoring="sigmoid",
            num_experts=first_present(raw, "num_experts", "num_local_experts"),
            top_k=first_present(raw, "num_experts_per_token", "num_experts_per_tok"),
            intermediate_size=raw["moe_intermediate_size"],
            norm_topk_prob=bool(first_present(raw, "moe_renormalize", "norm_topk_prob", default=True)),
            shared_intermediate_size=raw["moe_intermediate_size"]
            * first_present(raw, "num_shared_experts", "n_shared_experts", default=1),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            num_groups=first_present(raw, "num_expert_group", "n_group", default=1),
            topk_groups=first_present(raw, "topk_group", default=1),
            score_correction_bias=True,
        )
    return ModelConfig(
        arch="kimi_linear",
        model_type=raw["model_type"],
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        layer_types=layer_types,
        ffn_types=ffn_types,
        intermediate_size=raw["intermediate_size"],
        rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
        zero_centered_norm=False,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention=attention,
        linear=spec,
        moe=moe,
        num_mtp_layers=0,
        torch_dtype=str(first_present(raw, "dtype", "torch_dtype", default="bfloat16")),
        eos_token_ids=eos_ids(raw),
    )
