"""`load_dummy_weights` (`--load_format dummy`): random weights from config.json alone, at sensible scales,
deterministic per seed, served through the ModelRunner on CPU at full width and tiny depth."""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math

import pytest
import torch

from lightllm.engine.batch import ForwardBatch
from lightllm.models.dummy_weights import DT_MAX, DT_MIN, DummyCheckpoint, load_dummy_weights
from lightllm.models.hybrid import HybridModel
from lightllm.models.registry import model_config_from_dict
from lightllm.tools.dummy_model_dir import PRESETS
from lightllm.tools.tiny_model.configs import model_config
from lightllm.tools.tiny_model.sizes import TinySizes
from lightllm.worker import runner as runner_module
from lightllm.worker.config import RunnerConfig
from lightllm.worker.runner import ModelRunner

TOKEN_IDS = collections.defaultdict(lambda: 3)
# Qwen3.5-35B-A3B's widths (vocab cut to keep the test's memory small), two layers: one GDN, one attention
QWEN35_MOE_WIDTH = TinySizes(
    hidden_size=2048,
    num_layers=2,
    vocab_size=4096,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    num_experts=256,
    num_experts_per_tok=8,
    full_attention_interval=2,
    num_mtp_layers=0,
)


def write_config(path, arch: str, sizes: TinySizes, dtype: str = "float32"):
    (path / "config.json").write_text(json.dumps(model_config(arch, sizes, dtype, TOKEN_IDS)))
    return path


def serve_logits(model_dir, monkeypatch, seed: int, prompt: list[int], data_type: str) -> torch.Tensor:
    """Prefill `prompt` and decode one token through a CPU ModelRunner with `load_format="dummy"` (the runner's
    random weights drawn with `seed`); logits [2, V]."""
    monkeypatch.setattr(runner_module, "load_dummy_weights", functools.partial(load_dummy_weights, seed=seed))
    config = RunnerConfig(
        model_dir=str(model_dir),
        load_format="dummy",
        device="cpu",
        data_type=data_type,
        max_running_requests=2,
        max_total_token_num=256,
        max_req_total_len=64,
        disable_prefix_cache=True,
    )
    runner = ModelRunner(config)
    handle = runner.add_request()
    batch = ForwardBatch([handle], [len(prompt)], [0], 1, torch.tensor(prompt), [True])
    first = runner.forward(batch).logits[-1]
    token = int(first.argmax())
    step = ForwardBatch([handle], [1], [len(prompt)], 0, torch.tensor([token]))
    second = runner.forward(step).logits[0]
    return torch.stack([first, second]).float()


@pytest.mark.slow
def test_full_width_qwen35_moe_serves_finite_logits(tmp_path, monkeypatch):
    """Qwen3.5-35B-A3B's widths (256 experts, top-8) at two layers, bf16, from config.json alone (~20 s of draws)."""
    model_dir = write_config(tmp_path, "qwen3_5_moe", QWEN35_MOE_WIDTH, "bfloat16")
    assert not list(tmp_path.glob("*.safetensors"))
    logits = serve_logits(model_dir, monkeypatch, 0, [5, 17, 301, 42, 7], "bfloat16")
    assert torch.isfinite(logits).all() and logits.std() > 0.1


# Kimi-Linear-48B-A3B's widths (the preset's MLA, KDA and expert widths), two layers (KDA with the dense MLP, MLA
# with the MoE); a quarter of the experts and a cut vocabulary keep the draws to a few seconds
KIMI_WIDTH = dataclasses.replace(PRESETS["kimi-linear-48b-a3b"][1], num_layers=2, vocab_size=4096, num_experts=64)


@pytest.mark.slow
def test_full_width_kimi_serves_finite_logits(tmp_path, monkeypatch, caplog):
    """Kimi-Linear-48B-A3B's MLA and KDA widths at two layers, bf16, from config.json alone; the start-up says the
    weights are random. Twin: another seed gives other logits."""
    import logging

    model_dir = write_config(tmp_path, "kimi_linear", KIMI_WIDTH, "bfloat16")
    assert not list(tmp_path.glob("*.safetensors"))
    with caplog.at_level(logging.WARNING):
        logits = serve_logits(model_dir, monkeypatch, 0, [5, 17, 301, 42, 7], "bfloat16")
    assert torch.isfinite(logits).all() and logits.std() > 0.1
    assert "weights are RANDOM" in caplog.text
    other = serve_logits(model_dir, monkeypatch, 1, [5, 17, 301, 42, 7], "bfloat16")
    assert not torch.allclose(logits, other, atol=1e-2)


ARCHS = ["qwen3_next", "qwen3_5_moe", "kimi_linear"]


@pytest.mark.parametrize("arch", ARCHS)
def test_deep_stack_stays_finite_and_loads_are_deterministic(tmp_path, monkeypatch, arch):
    """48 layers at tiny width: logits finite and spread (no collapse, no blow-up); a second load gives the same
    bits; the twin, another seed, gives other logits."""
    model_dir = write_config(tmp_path, arch, TinySizes(num_layers=48, num_mtp_layers=0))
    prompt = [11, 200, 37, 5, 90, 64]
    logits = serve_logits(model_dir, monkeypatch, 0, prompt, "float32")
    assert torch.isfinite(logits).all() and 0.1 < logits.std() < 100
    assert torch.equal(logits, serve_logits(model_dir, monkeypatch, 0, prompt, "float32"))
    assert not torch.allclose(logits, serve_logits(model_dir, monkeypatch, 1, prompt, "float32"), atol=1e-3)


def test_draw_scales(tmp_path):
    """Norm gains at 1 in each convention, decay parameters in their initial ranges, unit-variance projections."""
    cfg = model_config_from_dict(model_config("qwen3_5_moe", TinySizes(), "float32", TOKEN_IDS))
    reader = DummyCheckpoint(dict(HybridModel(cfg).checkpoint_shapes(None)), cfg, "cpu")
    # Qwen: zero-centred decoder norms and q/k norms (stored 0), plain GDN output norm (stored 1)
    assert torch.equal(reader.get("model.layers.0.input_layernorm.weight"), torch.zeros(64))
    assert torch.equal(reader.get("model.layers.3.self_attn.q_norm.weight"), torch.zeros(16))
    assert torch.equal(reader.get("model.layers.0.linear_attn.norm.weight"), torch.ones(16))
    a = reader.get("model.layers.0.linear_attn.A_log").exp()
    assert ((a >= 1) & (a <= 16)).all()
    dt = torch.nn.functional.softplus(reader.get("model.layers.0.linear_attn.dt_bias"))
    assert ((dt >= DT_MIN * 0.999) & (dt <= DT_MAX * 1.001)).all()
    w = reader.get("model.layers.0.linear_attn.in_proj_qkv.weight")
    assert abs(w.std().item() * math.sqrt(64) - 1) < 0.1
    assert torch.equal(w, reader.get("model.layers.0.linear_attn.in_proj_qkv.weight"))
    kimi = model_config_from_dict(model_config("kimi_linear", TinySizes(), "float32", TOKEN_IDS))
    reader = DummyCheckpoint(dict(HybridModel(kimi).checkpoint_shapes(None)), kimi, "cpu")
    # Kimi: plain norms everywhere
    assert torch.equal(reader.get("model.layers.0.input_layernorm.weight"), torch.ones(64))
    assert torch.equal(reader.get("model.norm.weight"), torch.ones(64))
