"""kernels/rms_norm.py: the Triton kernel (TRITON_INTERPRET=1 on CPU) and the torch path equal a float64 reference
written from the formulas, in every weight convention, with and without the output gate and the residual add,
over dimensions with a tail tile, rows sharing a program, and strided rows; the fp16 kernel rounds where the torch
path rounds; a swapped weight or gate breaks the equality; bad shapes are refused."""

from __future__ import annotations

import itertools

import pytest
import torch

from lightllm.kernels.rms_norm import (
    CAST_THEN_WEIGHT,
    FP32_WEIGHT,
    NO_GATE,
    SIGMOID_GATE,
    SILU_GATE,
    ZERO_CENTERED,
    rms_norm_rows,
    rms_norm_torch,
    rms_norm_triton,
)
from unit_tests.helpers.asserts import assert_rel_close, poison_

EPS = 1e-6


def _reference(x, weight, mode, gate, gate_kind, residual):
    """float64, straight from the formulas (no intermediate rounding)."""
    x = x.double() + (residual.double() if residual is not None else 0)
    n = x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS)
    w = weight.double()
    y = n * (1 + w) if mode == ZERO_CENTERED else n * w
    if gate_kind == SILU_GATE:
        y = y * torch.nn.functional.silu(gate.double())
    elif gate_kind == SIGMOID_GATE:
        y = y * torch.sigmoid(gate.double())
    return y, x


def _inputs(rows, dim, dtype, seed, strided=False):
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, dim + (7 if strided else 0), generator=gen) * 2
    x = wide[:, :dim].to(dtype) if not strided else wide.to(dtype)[:, :dim]
    weight = (torch.randn(dim, generator=gen) * 0.3).to(dtype)
    gate = (torch.randn(rows, dim, generator=gen) * 2).to(dtype)
    residual = torch.randn(rows, dim, generator=gen).to(dtype)
    return x, weight, gate, residual


CASES = list(itertools.product([ZERO_CENTERED, CAST_THEN_WEIGHT, FP32_WEIGHT], [NO_GATE, SILU_GATE, SIGMOID_GATE]))


@pytest.mark.parametrize("mode,gate_kind", CASES)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize(
    "rows,dim,strided", [(3, 100, False), (37, 24, False), (5, 64, True), (1, 300, False)],
    ids=["tail-tile", "rows-share-a-program", "strided-rows", "one-row"],
)  # fmt: skip
def test_kernel_and_torch_equal_the_float64_reference(mode, gate_kind, with_residual, rows, dim, strided):
    x, weight, gate, residual = _inputs(rows, dim, torch.float32, seed=rows * 100 + dim + mode * 7 + gate_kind)
    gate = gate if gate_kind != NO_GATE else None
    residual = residual if with_residual else None
    expected, expected_sum = _reference(x, weight, mode, gate, gate_kind, residual)
    out = poison_(torch.empty(x.shape))
    res_out = poison_(torch.empty(x.shape)) if with_residual else None
    y, total = rms_norm_triton(x, weight, EPS, mode, gate, gate_kind, residual, out=out, residual_out=res_out)
    assert y is out and torch.isfinite(y).all()
    assert_rel_close("triton", y, expected, 1e-5)
    assert_rel_close("torch", rms_norm_torch(x + (residual if with_residual else 0), weight, EPS, mode, gate,
                                             gate_kind), expected, 1e-5)  # fmt: skip
    if with_residual:
        assert total is res_out and torch.equal(total, x + residual)
    else:
        assert total is None
    # twin: a reversed weight (or gate) is another function
    broken, _ = rms_norm_triton(x, weight.flip(0), EPS, mode, gate, gate_kind, residual)
    assert not torch.allclose(broken, y, rtol=1e-3, atol=1e-4)
    if gate is not None:
        broken, _ = rms_norm_triton(x, weight, EPS, mode, gate.flip(-1), gate_kind, residual)
        assert not torch.allclose(broken, y, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("mode,gate_kind", CASES)
def test_fp16_kernel_rounds_where_torch_rounds(mode, gate_kind):
    """In half precision the kernel's roundings (the residual sum, the cast before the weight, the output) are the
    torch path's: equal up to one unit in the last place of a few elements (fp32 sums in another order)."""
    x, weight, gate, residual = _inputs(9, 96, torch.float16, seed=mode * 3 + gate_kind)
    gate = gate if gate_kind != NO_GATE else None
    y, total = rms_norm_triton(x, weight, EPS, mode, gate, gate_kind, residual)
    ref = rms_norm_torch(x + residual, weight, EPS, mode, gate, gate_kind)
    assert torch.equal(total, x + residual)
    ulp = (ref.float().abs() * 2**-10).clamp_min(2**-24)
    off = (y.float() - ref.float()).abs() > ulp * 1.01
    assert off.float().mean() < 0.02, f"{int(off.sum())} of {off.numel()} elements differ by more than one ulp"
    assert_rel_close("fp16", y, _reference(x, weight, mode, gate, gate_kind, residual)[0], 2e-3)


def test_entry_dispatches_torch_on_cpu_and_matches_the_kernel():
    x, weight, gate, residual = _inputs(4, 48, torch.float32, seed=5)
    y, total = rms_norm_rows(x, weight, EPS, CAST_THEN_WEIGHT, gate, SILU_GATE, residual)
    torch.testing.assert_close(y, rms_norm_triton(x, weight, EPS, CAST_THEN_WEIGHT, gate, SILU_GATE, residual)[0])
    assert torch.equal(total, x + residual)
    assert rms_norm_rows(x, weight, EPS, ZERO_CENTERED)[1] is None


def test_bad_shapes_are_refused():
    x, weight, gate, residual = _inputs(2, 16, torch.float32, seed=1)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(x, weight[:8], EPS, ZERO_CENTERED)
    with pytest.raises(ValueError, match="gate"):
        rms_norm_triton(x, weight, EPS, ZERO_CENTERED, gate[:1], SILU_GATE)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_triton(x, weight, EPS, ZERO_CENTERED, residual=residual.half())
    with pytest.raises(ValueError, match="dtype"):
        rms_norm_triton(x.half(), weight.float(), EPS, CAST_THEN_WEIGHT)
