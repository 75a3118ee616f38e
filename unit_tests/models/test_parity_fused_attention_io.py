"""The gated-attention layers with their q/k norm and RoPE, and their output gate, through the fused Triton kernels
(their CUDA path, here under TRITON_INTERPRET=1) instead of the torch forms: prefill and decode logits still match
transformers on the tiny checkpoints of the architectures with gated attention; twin: cos and sin swapped in the
kernel breaks the match."""

from __future__ import annotations

import pytest

import lightllm.models.layers.attention as attention
from lightllm.kernels.qk_norm_rope import qk_norm_rope_triton
from lightllm.kernels.sigmoid_gate import sigmoid_gate_triton
from unit_tests.models.drive import decode, make_runner, prefill
from unit_tests.models.test_parity import MAX_REL, assert_logits, max_rel, prompt

GATED_ATTENTION_CASES = ("qwen3_next-hv2", "qwen3_5-hv2", "qwen3_5_moe-hv4")


@pytest.fixture
def fused(monkeypatch):
    calls = []

    def norm_rope(*args):
        calls.append("qk_norm_rope")
        return qk_norm_rope_triton(*args)

    def gate(o, g):
        calls.append("sigmoid_gate")
        return sigmoid_gate_triton(o, g)

    monkeypatch.setattr(attention, "qk_norm_rope", norm_rope)
    monkeypatch.setattr(attention, "sigmoid_gate", gate)
    return calls


@pytest.mark.parametrize("case", GATED_ATTENTION_CASES)
def test_prefill_and_decode_through_the_kernels_match_transformers(tiny, case, fused):
    model_dir, oracle = tiny(case)
    ids = prompt(5, 21)
    runner = make_runner(model_dir)
    handle = runner.add_request()
    logits = prefill(runner, handle, ids[:-1])
    assert_logits(f"{case} prefill", logits, oracle.prefill_logits(ids[:-1])[0, -1])
    step = decode(runner, handle, ids[-1])
    assert_logits(f"{case} decode", step, oracle.prefill_logits(ids)[0, -1])
    assert set(fused) == {"qk_norm_rope", "sigmoid_gate"}


def test_swapped_cos_and_sin_break_the_match(tiny, monkeypatch):
    model_dir, oracle = tiny("qwen3_5-hv2")

    def swapped(q, k, q_weight, k_weight, eps, cos, sin):
        return qk_norm_rope_triton(q, k, q_weight, k_weight, eps, sin, cos)

    monkeypatch.setattr(attention, "qk_norm_rope", swapped)
    ids = prompt(6, 15)
    runner = make_runner(model_dir)
    logits = prefill(runner, runner.add_request(), ids)
    assert max_rel(logits, oracle.prefill_logits(ids)[0, -1]) > 10 * MAX_REL
