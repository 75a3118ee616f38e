"""loader: key checks name every missing/unexpected key, dtype policy, TP shards that reassemble the weights."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from lightllm.models.hybrid import HybridModel
from lightllm.models.layers.attention import GatedAttention
from lightllm.models.layers.gdn import GatedDeltaNet
from lightllm.models.layers.kda import KimiDeltaAttention
from lightllm.models.layers.mla import LatentAttention
from lightllm.models.loader import load_weights, normalize_name
from lightllm.models.registry import load_model_config
from lightllm.models.tp import TPInfo
from unit_tests.models.conftest import ARCH_CASES


def checkpoint(model_dir: str) -> dict[str, torch.Tensor]:
    return load_file(f"{model_dir}/model.safetensors")


def build(model_dir: str, tensors=None, dtype=torch.float32, tp: TPInfo | None = None) -> HybridModel:
    model = HybridModel(load_model_config(model_dir), tp)
    load_weights(model, tensors if tensors is not None else model_dir, dtype, "cpu", tp, show_progress=False)
    return model


def test_missing_and_unexpected_keys_are_all_named(tiny):
    model_dir, _ = tiny("qwen3_next-hv2")
    tensors = checkpoint(model_dir)
    removed = ["model.layers.1.linear_attn.A_log", "model.layers.3.self_attn.k_norm.weight", "mtp.fc.weight"]
    for name in removed:
        del tensors[name]
    tensors["model.layers.0.linear_attn.bogus.weight"] = torch.zeros(1)
    tensors["extra_head.weight"] = torch.zeros(1)
    with pytest.raises(KeyError) as err:
        build(model_dir, tensors)
    text = str(err.value)
    for name in removed + ["model.layers.0.linear_attn.bogus.weight", "extra_head.weight"]:
        assert name in text
    assert "missing (3)" in text and "unexpected (2)" in text


def test_qwen3_5_language_model_prefix_and_vision_tower_are_handled(tiny):
    model_dir, _ = tiny("qwen3_5-hv2")
    nested = checkpoint(model_dir)
    assert any(k.startswith("model.language_model.") for k in nested) and any(".visual." in k for k in nested)
    assert normalize_name("model.visual.blocks.0.attn.qkv.weight") is None
    flat = {k.replace("language_model.", ""): v for k, v in nested.items() if ".visual." not in k}
    a, b = build(model_dir, flat), build(model_dir, nested)
    assert all(torch.equal(x, y) for x, y in zip(a.buffers(), b.buffers()))


def test_kimi_dense_layer_accepts_both_spellings(tiny):
    model_dir, _ = tiny("kimi_linear")
    tensors = checkpoint(model_dir)
    ffn = [k for k in tensors if k.startswith("model.layers.0.") and ("mlp." in k or "block_sparse_moe." in k)]
    assert ffn, "tiny Kimi has a dense first layer"
    renamed = dict(tensors)
    for k in ffn:
        other = k.replace(".mlp.", ".block_sparse_moe.") if ".mlp." in k else k.replace(".block_sparse_moe.", ".mlp.")
        renamed[other] = renamed.pop(k)
    a, b = build(model_dir, tensors), build(model_dir, renamed)
    assert all(torch.equal(x, y) for x, y in zip(a.buffers(), b.buffers()))


def test_dtype_conversion_keeps_gate_parameters_fp32(tiny):
    model_dir, _ = tiny("kimi_linear")
    model = build(model_dir, dtype=torch.bfloat16)
    dtypes = {name.rsplit(".", 1)[-1]: b.dtype for name, b in model.named_buffers()}
    assert dtypes["A_log"] == dtypes["dt_bias"] == dtypes["score_bias"] == dtypes["router"] == torch.float32
    assert dtypes["in_proj"] == dtypes["embed"] == torch.bfloat16


def _parts(module, name: str, tensor: torch.Tensor, dim: int) -> list[tuple[torch.Tensor, bool]]:
    """Split a fused local weight into its parts, in order, each with whether every rank holds it whole (MLA's
    latent projection after the rank's query heads, KDA's low-rank gate inputs f_a and g_a before its heads);
    the others are sharded independently."""
    if name.endswith("gate_up"):
        return [(p, False) for p in tensor.chunk(2, dim=dim)]
    if isinstance(module, GatedDeltaNet) and name in ("in_proj", "conv_weight"):
        s = module.spec
        kd, vd = module.num_k_heads * s.head_k_dim, module.num_v_heads * s.head_v_dim
        sizes = [kd, kd, vd] + ([vd, module.num_v_heads, module.num_v_heads] if name == "in_proj" else [])
        return [(p, False) for p in tensor.split(sizes, dim=0)]
    if isinstance(module, GatedAttention) and name in ("qkv_proj", "qkv_bias"):
        qd, kvd = 2 * module.num_heads * module.cfg.head_dim, module.num_kv_heads * module.cfg.head_dim
        return [(p, False) for p in tensor.split([qd, kvd, kvd], dim=0)]
    if isinstance(module, LatentAttention) and name == "q_kv_a":
        c = module.cfg
        q, latent = tensor.split([module.num_heads * c.qk_head_dim, c.kv_lora_rank + c.qk_rope_head_dim], dim=0)
        return [(q, False), (latent, True)]
    if isinstance(module, KimiDeltaAttention) and name == "in_proj":
        hd = module.num_heads * module.spec.head_k_dim
        f_a, g_a, *heads = tensor.split(module.split_sizes[:2] + [hd, hd, hd, module.num_heads], dim=0)
        return [(f_a, True), (g_a, True)] + [(p, False) for p in heads]
    if isinstance(module, KimiDeltaAttention) and name == "conv_weight":
        return [(p, False) for p in tensor.chunk(3, dim=0)]
    return [(tensor, False)]


@pytest.mark.parametrize("case", ARCH_CASES)
def test_tp2_shards_concatenate_to_the_full_weights(tiny, case):
    model_dir, _ = tiny(case)
    full = build(model_dir)
    ranks = [build(model_dir, tp=TPInfo(rank=r, size=2)) for r in range(2)]
    modules = dict(ranks[0].named_modules())
    shard_buffers = [dict(m.named_buffers()) for m in ranks]
    num_sharded = 0
    for name, weight in full.named_buffers():
        a, b = shard_buffers[0][name], shard_buffers[1][name]
        if a.shape == weight.shape:
            assert torch.equal(a, weight) and torch.equal(b, weight), f"{name}: replicated weight differs"
            continue
        num_sharded += 1
        dim = next(d for d in range(weight.dim()) if a.shape[d] != weight.shape[d])
        owner, _, leaf = name.rpartition(".")
        module = modules[owner]
        pieces = []
        for (part_a, whole), (part_b, _) in zip(_parts(module, leaf, a, dim), _parts(module, leaf, b, dim)):
            if whole:
                assert torch.equal(part_a, part_b), f"{name}: a part every rank holds whole differs"
            pieces.append(part_a if whole else torch.cat([part_a, part_b], dim=dim))
        rebuilt = torch.cat(pieces, dim=dim)
        assert torch.equal(rebuilt, weight), f"{name}: rank shards do not reassemble the full weight"
    assert num_sharded > 10
