"""kernels/qk_norm_rope.py and kernels/sigmoid_gate.py: the Triton kernels (TRITON_INTERPRET=1 on CPU) and the torch
paths equal float64 references written from the formulas, over query views strided as the attention layer makes
them (each head's half of a wider projection row), head counts with a partial last tile, partial, full and no
rotation; the fp16 kernels round where eager torch rounds; swapped inputs break the equality; bad shapes are
refused; the attention layer computes cos and sin once per step; lowered for sm_90 the kernel holds no fused
multiply-add (each product rounds before the sum, as in eager torch)."""

from __future__ import annotations

import os

import pytest
import torch

from lightllm.kernels.qk_norm_rope import qk_norm_rope_torch, qk_norm_rope_triton, rope_cos_sin
from lightllm.kernels.sigmoid_gate import sigmoid_gate_torch, sigmoid_gate_triton
from unit_tests.helpers.asserts import assert_rel_close
from unit_tests.helpers.sm90 import PTXAS, run_lowering_module

EPS = 1e-6


def _reference(x, w, positions, inv_freq, factor):
    """float64 from the formulas (but the fp32 angle): zero-centred RMSNorm, then rotate-half RoPE on the leading 2 * len(inv_freq) dims."""
    x = x.double()
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS) * (1 + w.double())
    rd = 2 * inv_freq.numel()
    if rd == 0:
        return y
    # the angle is an fp32 product by contract (at positions in the tens of thousands its rounding is the error)
    ang = (positions.float()[:, None] * inv_freq[None, :]).double()
    cos = (torch.cat((ang, ang), -1).cos() * factor)[:, None, :]
    sin = (torch.cat((ang, ang), -1).sin() * factor)[:, None, :]
    rot, half = y[..., :rd], rd // 2
    partner = torch.cat((-rot[..., half:], rot[..., :half]), -1)
    return torch.cat((rot * cos + partner * sin, y[..., rd:]), -1)


def _case(t, hq, hk, d, rd, dtype, seed, factor=1.0):
    gen = torch.Generator().manual_seed(seed)
    # the engine's layout: q and k are views of one fused q|gate, k, v projection row per token
    qkv = (torch.randn(t, 2 * hq * d + 2 * hk * d, generator=gen) * 3).to(dtype)
    q_gate, k, _ = qkv.split([2 * hq * d, hk * d, hk * d], dim=-1)
    q, k = q_gate.view(t, hq, 2 * d)[..., :d], k.view(t, hk, d)
    qw = (torch.randn(d, generator=gen) * 0.3).to(dtype)
    kw = (torch.randn(d, generator=gen) * 0.3).to(dtype)
    positions = torch.randint(0, 40000, (t,), generator=gen)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rd, 2, dtype=torch.float32) / max(rd, 1)))
    cos, sin = rope_cos_sin(positions, inv_freq, factor, dtype)
    return q, k, qw, kw, positions, inv_freq, cos, sin


@pytest.mark.parametrize(
    "t,hq,hk,d,rd,factor",
    [(3, 4, 2, 24, 12, 1.0), (5, 10, 3, 256, 64, 1.0), (1, 2, 1, 40, 40, 1.2), (4, 3, 3, 16, 0, 1.0)],
    ids=["partial-rotary", "head-tiles-with-a-tail", "full-rotary-yarn-factor", "no-rotary"],
)
def test_qk_norm_rope_equals_the_float64_reference(t, hq, hk, d, rd, factor):
    q, k, qw, kw, positions, inv_freq, cos, sin = _case(
        t, hq, hk, d, rd, torch.float32, seed=t * 31 + d + rd, factor=factor
    )
    q_out, k_out = qk_norm_rope_triton(q, k, qw, kw, EPS, cos, sin)
    assert q_out.is_contiguous() and q_out.shape == q.shape and k_out.shape == k.shape
    for name, got, x, w in (("q", q_out, q, qw), ("k", k_out, k, kw)):
        expected = _reference(x, w, positions, inv_freq, factor)
        assert_rel_close(f"triton {name}", got, expected, 2e-5)
    tq, tk = qk_norm_rope_torch(q, k, qw, kw, EPS, cos, sin)
    assert_rel_close("torch q", tq, _reference(q, qw, positions, inv_freq, factor), 2e-5)
    assert_rel_close("torch k", tk, _reference(k, kw, positions, inv_freq, factor), 2e-5)
    if rd:
        # twin: cos and sin swapped is another rotation
        broken, _ = qk_norm_rope_triton(q, k, qw, kw, EPS, sin, cos)
        assert not torch.allclose(broken, q_out, rtol=1e-3, atol=1e-4)
    # twin: the key's weight on the query is another norm
    broken, _ = qk_norm_rope_triton(q, k, kw, kw, EPS, cos, sin)
    assert not torch.allclose(broken, q_out, rtol=1e-3, atol=1e-4)


def test_fp16_kernel_rounds_where_eager_torch_rounds():
    q, k, qw, kw, _, _, cos, sin = _case(6, 5, 2, 64, 32, torch.float16, seed=7)
    q_out, k_out = qk_norm_rope_triton(q, k, qw, kw, EPS, cos, sin)
    tq, tk = qk_norm_rope_torch(q, k, qw, kw, EPS, cos, sin)
    for got, want in ((q_out, tq), (k_out, tk)):
        assert got.dtype == torch.float16
        # the norm's fp32 sum runs in another order: a value may land one rounding step away, rarely
        assert (got == want).float().mean() > 0.98
        assert_rel_close("fp16", got, want, 2e-3)


def test_bad_shapes_are_refused():
    q, k, qw, kw, _, _, cos, sin = _case(2, 2, 1, 16, 8, torch.float32, seed=1)
    with pytest.raises(ValueError, match="head dim"):
        qk_norm_rope_triton(q, k[..., :8], qw, kw, EPS, cos, sin)
    with pytest.raises(ValueError, match="even rd"):
        qk_norm_rope_triton(q, k, qw, kw, EPS, cos[:, :7], sin[:, :7])


@pytest.mark.parametrize("t,h,d", [(3, 3, 100), (2, 5, 256), (0, 2, 8)], ids=["one-tile", "tail-tile", "no-tokens"])
def test_sigmoid_gate_equals_the_float64_reference(t, h, d):
    gen = torch.Generator().manual_seed(t * 7 + h + d)
    o = torch.randn(t, h, d, generator=gen)
    gate = (torch.randn(t, h, 2 * d, generator=gen) * 3)[..., d:]  # the gate half of each query projection row
    got = sigmoid_gate_triton(o, gate)
    expected = (o.double() * torch.sigmoid(gate.double())).reshape(t, h * d)
    assert got.shape == (t, h * d) and got.is_contiguous()
    if t:
        assert_rel_close("triton", got, expected, 1e-6)
        assert_rel_close("torch", sigmoid_gate_torch(o, gate), expected, 1e-6)
        # twin: the gate on the values is another function
        assert not torch.allclose(sigmoid_gate_triton(gate.contiguous(), o), got, rtol=1e-3, atol=1e-4)


def test_sigmoid_gate_fp16_rounds_where_eager_torch_rounds():
    gen = torch.Generator().manual_seed(3)
    o = torch.randn(7, 4, 48, generator=gen).half()
    gate = (torch.randn(7, 4, 96, generator=gen) * 3).half()[..., :48]
    got, want = sigmoid_gate_triton(o, gate), sigmoid_gate_torch(o, gate)
    assert (got == want).float().mean() > 0.98
    assert_rel_close("fp16", got, want, 2e-3)


def test_attention_layers_compute_cos_sin_once_per_step():
    from lightllm.models.context import StepContext

    ctx = StepContext(positions=torch.arange(4), num_prefill_tokens=4, write_slots=torch.arange(4), groups=[], kv=None)
    calls = []

    def make():
        calls.append(1)
        return torch.randn(4)

    first = ctx.shared(("rope", torch.float32), make)
    assert ctx.shared(("rope", torch.float32), make) is first and len(calls) == 1
    # another key (dtype) is another value
    assert ctx.shared(("rope", torch.float16), make) is not first and len(calls) == 2


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="Triton's bundled ptxas is not installed")
def test_the_kernel_lowers_for_sm90_without_fused_multiply_adds():
    """Each product rounds before the sum on the GPU too: the kernel's PTX for sm_90 with its launch options holds no
    fused multiply-add in any dtype; twin: with fp fusion on (Triton's default) LLVM contracts the rotation's product
    and sum into one (`fma.rn.bf16x2` in bf16), so the count is not zero. Run in a subprocess: this session runs
    Triton as the interpreter."""
    out = run_lowering_module("unit_tests.helpers.rope_sm90_fma")
    counts = {tuple(line.split()[:2]): int(line.split()[2]) for line in out.splitlines()}
    assert set(counts) == {(d, o) for d in ("bf16", "fp16", "fp32") for o in ("launch", "fused")}, out
    for dtype in ("bf16", "fp16", "fp32"):
        assert counts[dtype, "launch"] == 0, out
        assert counts[dtype, "fused"] > 0, out
