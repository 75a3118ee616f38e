"""The gated-attention layers with their q/k norm and RoPE, and their output gate, through the fused Triton kernels
(their CUDA path, here under TRITON_INTERPRET=1) instead of the torch forms: prefill and decode logits still match
transformers on the tiny checkpoints of the architectures with gated attention; twin: cos and sin swapped in the
kernel breaks the match."""

from __future__ import annotations

from collections import Counter

import pytest

import lightllm.models.layers.attention as attention
from lightllm.kernels.qk_norm_rope import qk_norm_rope_triton
from lightllm.kernels.sigmoid_gate import sigmoid_gate_triton
from unit_tests.models.kernel_parity import assert_prefill_and_decode_match, prefill_mismatch, route_through
from unit_tests.models.test_parity import MAX_REL, prompt

GATED_ATTENTION_CASES = ("qwen3_next-hv2", "qwen3_5-hv2", "qwen3_5_moe-hv4")


@pytest.fixture
def fused(monkeypatch) -> Counter:
    calls = Counter()
    route_through(monkeypatch, calls, attention, "qk_norm_rope", qk_norm_rope_triton)
    route_through(monkeypatch, calls, attention, "sigmoid_gate", sigmoid_gate_triton)
    return calls


@pytest.mark.parametrize("case", GATED_ATTENTION_CASES)
def test_prefill_and_decode_through_the_kernels_match_transformers(tiny, case, fused):
    assert_prefill_and_decode_match(case, *tiny(case), prompt(5, 21))
    assert set(fused) == {"qk_norm_rope", "sigmoid_gate"}


def test_swapped_cos_and_sin_break_the_match(tiny, monkeypatch):
    model_dir, oracle = tiny("qwen3_5-hv2")

    def swapped(q, k, q_weight, k_weight, eps, cos, sin):
        return qk_norm_rope_triton(q, k, q_weight, k_weight, eps, sin, cos)

    monkeypatch.setattr(attention, "qk_norm_rope", swapped)
    assert prefill_mismatch(model_dir, oracle, 6, 15) > 10 * MAX_REL
