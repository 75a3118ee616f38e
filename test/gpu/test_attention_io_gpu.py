"""Gated attention's fused q/k norm + RoPE and output gate compiled on a CUDA device at the served head shapes: the
output gate bit for bit the eager torch expression it replaces; the q/k norm and rotation within the rounding error
of their dtype from a float64 computation of the same inputs, as eager torch is (and eager torch with cos and sin
swapped is not); in bf16 / fp16 equal to eager torch's but where the norm's fp32 sum order moves a bit; over decode
and prefill token counts, and the same inside a CUDA graph replayed on new inputs."""

from __future__ import annotations

import pytest
import torch

from lightllm.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_torch, rope_cos_sin
from lightllm.kernels.sigmoid_gate import sigmoid_gate, sigmoid_gate_torch

pytestmark = pytest.mark.gpu

# (query heads, key heads, head dim, rotary dim): Qwen3.5-35B-A3B / Qwen3-Next TP1 gated attention
HEADS = [(16, 2, 256, 64), (32, 2, 256, 64)]


def _inputs(t, hq, hk, d, rd, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return (torch.randn(*shape, device="cuda", generator=gen) * 3).to(dtype)

    # the engine's layout: views of one fused q|gate, k, v projection row per token
    q_gate, k, _ = randn(t, 2 * hq * d + 2 * hk * d).split([2 * hq * d, hk * d, hk * d], dim=-1)
    q, gate = q_gate.view(t, hq, 2 * d).chunk(2, dim=-1)
    k = k.view(t, hk, d)
    weights = randn(d) * 0.1, randn(d) * 0.1
    positions = torch.randint(0, 1 << 17, (t,), device="cuda", generator=gen)
    inv_freq = 1.0 / (1e7 ** (torch.arange(0, rd, 2, dtype=torch.float32, device="cuda") / rd))
    cos, sin = rope_cos_sin(positions, inv_freq, 1.0, dtype)
    return q, k, gate, weights, cos, sin


def _exact(x, weight, cos, sin):
    """float64 norm and rotation of the heads `x [T, H, D]` (cos, sin as given, in their dtype); also the bound of
    a correctly rounded computation's error per element: one unit of the dtype of every addend and of the result."""
    x, weight, cos, sin = x.double(), weight.double(), cos.double()[:, None, :], sin.double()[:, None, :]
    y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + EPS) * (1.0 + weight)
    rd, half = cos.shape[-1], cos.shape[-1] // 2
    partner = torch.cat((-y[..., half:rd], y[..., :half]), dim=-1)
    a, b = y[..., :rd] * cos, partner * sin
    out = torch.cat((a + b, y[..., rd:]), dim=-1)
    scale = torch.cat((a.abs() + b.abs() + (a + b).abs(), y[..., rd:].abs()), dim=-1)
    return out, scale


def _within_rounding(got, exact, scale, dtype) -> bool:
    # fp32 carries a few units more: the kernel's rsqrt is the hardware's approximate one; values in fp16's subnormal
    # range round to its fixed spacing (the smallest normal times eps), not relative to themselves
    info = torch.finfo(dtype)
    units = 4 if dtype == torch.float32 else 1
    return bool(((got.double() - exact).abs() <= units * info.eps * scale + 2 * info.tiny * info.eps).all())


EPS = 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("tokens", [1, 7, 256, 3000])
@pytest.mark.parametrize("heads", HEADS, ids=["hq16", "hq32"])
def test_the_kernels_give_the_eager_numbers(heads, tokens, dtype):
    q, k, gate, (qw, kw), cos, sin = _inputs(tokens, *heads, dtype, seed=tokens)
    o = q.contiguous() * 0.5
    assert torch.equal(sigmoid_gate(o, gate), sigmoid_gate_torch(o, gate))
    got = qk_norm_rope(q, k, qw, kw, EPS, cos, sin)
    want = qk_norm_rope_torch(q, k, qw, kw, EPS, cos, sin)
    swapped = qk_norm_rope_torch(q, k, qw, kw, EPS, sin, cos)
    for x, w_norm, g, w, bad in zip((q, k), (qw, kw), got, want, swapped):
        assert g.is_contiguous() and g.shape == w.shape
        exact, scale = _exact(x, w_norm, cos, sin)
        assert _within_rounding(w, exact, scale, dtype), "eager torch outside the bound: the bound is wrong"
        assert _within_rounding(g, exact, scale, dtype)
        assert not _within_rounding(bad, exact, scale, dtype)
        if dtype != torch.float32:
            # each product rounded where eager torch rounds it: equal but where the norm's fp32 sum order moved a bit
            assert (g == w).float().mean().item() > 0.999


def test_the_kernels_replay_in_a_cuda_graph():
    q, k, gate, (qw, kw), cos, sin = _inputs(64, *HEADS[0], torch.bfloat16, seed=1)
    o = q.contiguous()
    outs = (qk_norm_rope(q, k, qw, kw, EPS, cos, sin), sigmoid_gate(o, gate))  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = (qk_norm_rope(q, k, qw, kw, EPS, cos, sin), sigmoid_gate(o, gate))
    for t in (q, k, gate, o, cos, sin):
        t.copy_(torch.randn(t.shape, device="cuda").to(t.dtype))
    graph.replay()
    (gq, gk), gg = outs
    (eq, ek), eg = qk_norm_rope(q, k, qw, kw, EPS, cos, sin), sigmoid_gate(o, gate)
    assert torch.equal(gq, eq) and torch.equal(gk, ek) and torch.equal(gg, eg)
