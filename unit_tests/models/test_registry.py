"""registry: model_type dispatch, nested text_config, per-architecture config mapping."""

from __future__ import annotations

import json

import pytest

from lightllm.models.config import DENSE, FULL, LINEAR, MOE
from lightllm.models.registry import SUPPORTED_MODEL_TYPES, load_model_config, model_config_from_dict

QWEN_TEXT = {
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 24,
    "full_attention_interval": 4,
    "rope_theta": 5e6,
    "partial_rotary_factor": 0.25,
}


def test_unknown_model_type_lists_supported_types():
    with pytest.raises(ValueError) as err:
        model_config_from_dict({"model_type": "llama"})
    for name in SUPPORTED_MODEL_TYPES:
        assert name in str(err.value)


def test_qwen3_next_layers_ffn_and_rope():
    raw = dict(QWEN_TEXT, model_type="qwen3_next", num_experts=16, num_experts_per_tok=4, moe_intermediate_size=8)
    raw.update(shared_expert_intermediate_size=8, mlp_only_layers=[2], norm_topk_prob=False)
    cfg = model_config_from_dict(raw)
    assert cfg.layer_types == (LINEAR, LINEAR, LINEAR, FULL) * 2
    assert cfg.ffn_types[2] == DENSE and cfg.ffn_types.count(MOE) == 7
    assert cfg.moe.norm_topk_prob is False and cfg.moe.shared_expert_gate
    assert (cfg.attention.rotary_dim, cfg.attention.rope_theta) == (8, 5e6)
    assert (cfg.linear.algo, cfg.linear.num_v_heads, cfg.linear.head_v_dim, cfg.linear.num_layers) == ("gdn", 8, 24, 6)
    assert cfg.zero_centered_norm


@pytest.mark.parametrize("outer,inner", [("qwen3_5", "qwen3_5_text"), ("qwen3_5_moe", "qwen3_5_moe_text")])
def test_qwen3_5_reads_nested_text_config(outer, inner):
    text = dict(QWEN_TEXT, model_type=inner, mtp_num_hidden_layers=1)
    if "moe" in inner:
        text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=8)
    cfg = model_config_from_dict({"model_type": outer, "text_config": text, "tie_word_embeddings": True})
    assert cfg.arch == "qwen3_5" and cfg.num_mtp_layers == 1 and cfg.tie_word_embeddings
    assert cfg.ffn_types == ((MOE,) if "moe" in inner else (DENSE,)) * 8
    assert model_config_from_dict(text).layer_types == cfg.layer_types


def test_kimi_linear_original_spelling():
    raw = {
        "model_type": "kimi_linear",
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 5,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "num_experts": 8,
        "num_experts_per_token": 2,
        "num_shared_experts": 2,
        "moe_renormalize": True,
        "routed_scaling_factor": 2.5,
        "num_expert_group": 2,
        "topk_group": 1,
        "first_k_dense_replace": 2,
        "linear_attn_config": {"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4, "full_attn_layers": [3, 5]},
    }
    cfg = model_config_from_dict(raw)
    assert cfg.layer_types == (LINEAR, LINEAR, FULL, LINEAR, FULL)
    assert cfg.ffn_types == (DENSE, DENSE, MOE, MOE, MOE)
    m = cfg.moe
    assert (m.scoring, m.num_groups, m.shared_intermediate_size, m.routed_scaling_factor) == ("sigmoid", 2, 32, 2.5)
    assert cfg.attention.kind == "mla" and cfg.attention.kv_cache_shapes == ((40,),)
    assert cfg.linear.algo == "kda" and not cfg.zero_centered_norm and cfg.num_mtp_layers == 0


@pytest.mark.parametrize("case", ["qwen3_next-hv2", "qwen3_5-hv2", "qwen3_5_moe-hv4", "kimi_linear"])
def test_tiny_checkpoints_map_like_their_transformers_config(tiny, case):
    model_dir, oracle = tiny(case)
    cfg, hf = load_model_config(model_dir), oracle.config.get_text_config()
    assert list(cfg.layer_types) == list(hf.layer_types)
    assert cfg.vocab_size == hf.vocab_size and cfg.hidden_size == hf.hidden_size
    assert cfg.num_mtp_layers == (0 if case == "kimi_linear" else 1)
    with open(f"{model_dir}/config.json") as f:
        raw = json.load(f)
    assert cfg.model_type == raw.get("text_config", raw)["model_type"]
