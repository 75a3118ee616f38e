"""config.json / generation_config.json of tiny checkpoints in each real checkpoint's layout and key names.

Everything not shrunk keeps the real model's value (Qwen3-Next-80B-A3B, Qwen3.5-27B / -35B-A3B, Kimi-Linear-48B-A3B).
"""

from __future__ import annotations

from .sizes import TinySizes, kimi_full_attn_layers, qwen_layer_types

_QWEN_ROPE_THETA = 10_000_000
_QWEN_MAX_POSITIONS = 262_144
_KIMI_MAX_POSITIONS = 1_048_576


def _qwen_common(s: TinySizes) -> dict:
    return {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "full_attention_interval": s.full_attention_interval,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "hidden_size": s.hidden_size,
        "initializer_range": 0.02,
        "linear_conv_kernel_dim": s.conv_kernel_size,
        "linear_key_head_dim": s.linear_key_head_dim,
        "linear_num_key_heads": s.linear_num_key_heads,
        "linear_num_value_heads": s.linear_num_value_heads,
        "linear_value_head_dim": s.linear_value_head_dim,
        "max_position_embeddings": _QWEN_MAX_POSITIONS,
        "num_attention_heads": s.num_attention_heads,
        "num_hidden_layers": s.num_layers,
        "num_key_value_heads": s.num_key_value_heads,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": s.vocab_size,
    }


def _qwen_moe(s: TinySizes) -> dict:
    return {
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": s.moe_intermediate_size,
        "norm_topk_prob": True,
        "num_experts": s.num_experts,
        "num_experts_per_tok": s.num_experts_per_tok,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": s.shared_expert_intermediate_size,
    }


def qwen3_next_config(s: TinySizes, dtype: str, ids: dict[str, int]) -> dict:
    # The released config carries the interval and flat rope keys; transformers derives layer_types from them.
    cfg = {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "intermediate_size": s.intermediate_size,
        "partial_rotary_factor": 0.25,
        "rope_scaling": None,
        "rope_theta": _QWEN_ROPE_THETA,
        "torch_dtype": dtype,
        **_qwen_common(s),
        **_qwen_moe(s),
    }
    return dict(sorted(cfg.items()))


def _qwen3_5_text(s: TinySizes, dtype: str, ids: dict[str, int], moe: bool) -> dict:
    cfg = {
        "attn_output_gate": True,
        "dtype": dtype,
        "eos_token_id": ids["<|endoftext|>"],
        "layer_types": qwen_layer_types(s.num_layers, s.full_attention_interval),
        "mamba_ssm_dtype": "float32",
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        "mtp_num_hidden_layers": s.num_mtp_layers,
        "mtp_use_dedicated_embeddings": False,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": _mrope_section(s.head_dim),
            "partial_rotary_factor": 0.25,
            "rope_theta": _QWEN_ROPE_THETA,
            "rope_type": "default",
        },
        **_qwen_common(s),
    }
    if moe:
        cfg.update(_qwen_moe(s))
    else:
        cfg["intermediate_size"] = s.intermediate_size
    return dict(sorted(cfg.items()))


def _mrope_section(head_dim: int) -> list[int]:
    # Real [11, 11, 10] splits the 32 rotary frequency pairs of 64 rotary dims (head_dim 256 x 0.25) over t/h/w.
    pairs = int(head_dim * 0.25) // 2
    t = h = (pairs + 2) // 3
    return [t, h, pairs - t - h]


def _tiny_vision(s: TinySizes) -> dict:
    return {
        "deepstack_visual_indexes": [],
        "depth": 1,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 32,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 64,
        "num_heads": 2,
        "num_position_embeddings": 16,
        "out_hidden_size": s.hidden_size,
        "patch_size": 4,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }


def qwen3_5_config(s: TinySizes, dtype: str, ids: dict[str, int], moe: bool) -> dict:
    """Released Qwen3.5 checkpoints are the vision-language model; the text model sits under `text_config`."""
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "image_token_id": ids["<|image_pad|>"],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": _qwen3_5_text(s, dtype, ids, moe),
        "tie_word_embeddings": False,
        "video_token_id": ids["<|video_pad|>"],
        "vision_config": _tiny_vision(s),
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
    }


def kimi_linear_config(s: TinySizes, dtype: str, ids: dict[str, int]) -> dict:
    full = kimi_full_attn_layers(s.num_layers, s.full_attention_interval)
    cfg = {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "bos_token_id": ids["[BOS]"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["[PAD]"],
        "first_k_dense_replace": s.first_k_dense_replace,
        "hidden_act": "silu",
        "hidden_size": s.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": s.intermediate_size,
        "kv_lora_rank": s.kv_lora_rank,
        "linear_attn_config": {
            "full_attn_layers": full,
            "head_dim": s.linear_key_head_dim,
            "kda_layers": [i for i in range(1, s.num_layers + 1) if i not in full],
            "num_heads": s.linear_num_value_heads,
            "short_conv_kernel_size": s.conv_kernel_size,
        },
        "mla_use_nope": True,
        "model_max_length": _KIMI_MAX_POSITIONS,
        "moe_intermediate_size": s.moe_intermediate_size,
        "moe_layer_freq": 1,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "num_attention_heads": s.num_attention_heads,
        "num_expert_group": 1,
        "num_experts": s.num_experts,
        "num_experts_per_token": s.num_experts_per_tok,
        "num_hidden_layers": s.num_layers,
        "num_key_value_heads": s.num_attention_heads,
        "num_nextn_predict_layers": 0,
        "num_shared_experts": 1,
        "q_lora_rank": None,
        "qk_nope_head_dim": s.qk_nope_head_dim,
        "qk_rope_head_dim": s.qk_rope_head_dim,
        "rms_norm_eps": 1e-5,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "routed_scaling_factor": 2.446,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "torch_dtype": dtype,
        "use_cache": True,
        "use_grouped_topk": True,
        "v_head_dim": s.v_head_dim,
        "vocab_size": s.vocab_size,
    }
    return dict(sorted(cfg.items()))


def model_config(arch: str, s: TinySizes, dtype: str, ids: dict[str, int]) -> dict:
    """The config.json dict of `arch` (see `sizes.ARCHS`)."""
    if arch == "qwen3_next":
        return qwen3_next_config(s, dtype, ids)
    if arch in ("qwen3_5", "qwen3_5_moe"):
        return qwen3_5_config(s, dtype, ids, moe=arch == "qwen3_5_moe")
    if arch == "kimi_linear":
        return kimi_linear_config(s, dtype, ids)
    raise ValueError(f"unknown arch {arch!r}")


def generation_config(arch: str, ids: dict[str, int]) -> dict:
    """generation_config.json with each family's released sampling defaults and stop ids."""
    if arch == "kimi_linear":
        return {"bos_token_id": ids["[BOS]"], "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["[PAD]"]}
    eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    sampling = {"temperature": 0.7, "top_k": 20, "top_p": 0.8}
    if arch != "qwen3_next":
        # Qwen3.5 ships the thinking-mode defaults.
        sampling = {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    return {
        "bos_token_id": ids["<|endoftext|>"],
        "do_sample": True,
        "eos_token_id": eos,
        "pad_token_id": ids["<|endoftext|>"],
        **sampling,
    }
