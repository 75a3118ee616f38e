"""The models with every norm through the fused Triton kernel (its CUDA path, here under TRITON_INTERPRET=1)
instead of its torch form: prefill and decode logits still match transformers on the tiny checkpoints of every
architecture (Qwen's zero-centred norms and the silu-gated GDN output norm, Kimi's cast-then-weight norms and the
sigmoid-gated KDA output norm, the residual adds fused into the norms); twin: a kernel given the wrong weight
convention breaks the match."""

from __future__ import annotations

import pytest

import lightllm.kernels.rms_norm as kernel
import lightllm.models.layers.norms as norms
from unit_tests.models.conftest import ARCH_CASES
from unit_tests.models.kernel_parity import assert_prefill_and_decode_match, prefill_mismatch
from unit_tests.models.test_parity import MAX_REL, prompt


def _triton_rows(x, weight, eps, mode, gate=None, gate_kind=kernel.NO_GATE, residual=None):
    calls.append(mode)
    return kernel.rms_norm_triton(x, weight, eps, mode, gate, gate_kind, residual)


calls: list[int] = []


@pytest.fixture
def fused_norms(monkeypatch):
    calls.clear()
    monkeypatch.setattr(norms, "rms_norm_rows", _triton_rows)
    return calls


@pytest.mark.parametrize("case", ARCH_CASES)
def test_prefill_and_decode_through_the_kernel_match_transformers(tiny, case, fused_norms):
    assert_prefill_and_decode_match(case, *tiny(case), prompt(5, 21))
    # each convention of the architecture went through the kernel
    expected = {kernel.CAST_THEN_WEIGHT, kernel.FP32_WEIGHT} if case == "kimi_linear" else {
        kernel.ZERO_CENTERED, kernel.CAST_THEN_WEIGHT}  # fmt: skip
    assert set(fused_norms) == expected


def test_a_wrong_convention_breaks_the_match(tiny, monkeypatch):
    model_dir, oracle = tiny("qwen3_5-hv2")

    def swapped(x, weight, eps, mode, gate=None, gate_kind=kernel.NO_GATE, residual=None):
        mode = kernel.CAST_THEN_WEIGHT if mode == kernel.ZERO_CENTERED else mode
        return kernel.rms_norm_triton(x, weight, eps, mode, gate, gate_kind, residual)

    monkeypatch.setattr(norms, "rms_norm_rows", swapped)
    assert prefill_mismatch(model_dir, oracle, 6, 15) > 10 * MAX_REL
