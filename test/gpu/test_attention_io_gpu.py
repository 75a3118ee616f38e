"""Gated attention's fused q/k norm + RoPE and output gate compiled on a CUDA device at the served head shapes: the
output gate bit for bit the eager torch expression it replaces, the norm equal to eager torch's (its fp32 sum order
aside) and the rotated values within one unit of the dtype of eager torch's, over decode and prefill token counts, and the same inside a CUDA graph replayed
on new inputs."""

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

    q = randn(t, hq, 2 * d)[..., :d]
    gate = randn(t, hq, 2 * d)[..., d:]
    k = randn(t, hk, d)
    weights = randn(d) * 0.1, randn(d) * 0.1
    positions = torch.randint(0, 1 << 17, (t,), device="cuda", generator=gen)
    inv_freq = 1.0 / (1e7 ** (torch.arange(0, rd, 2, dtype=torch.float32, device="cuda") / rd))
    cos, sin = rope_cos_sin(positions, inv_freq, 1.0, dtype)
    return q, k, gate, weights, cos, sin


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("tokens", [1, 7, 256, 3000])
@pytest.mark.parametrize("heads", HEADS, ids=["hq16", "hq32"])
def test_the_kernels_give_the_eager_numbers(heads, tokens, dtype):
    q, k, gate, (qw, kw), cos, sin = _inputs(tokens, *heads, dtype, seed=tokens)
    o = q.contiguous() * 0.5
    assert torch.equal(sigmoid_gate(o, gate), sigmoid_gate_torch(o, gate))
    got, want = qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin), qk_norm_rope_torch(q, k, qw, kw, 1e-6, cos, sin)
    rd = cos.shape[-1]
    for g, w in zip(got, want):
        assert g.is_contiguous() and g.shape == w.shape
        # the unrotated dims: the norm, equal but for its fp32 sum order
        assert (g[..., rd:] == w[..., rd:]).float().mean().item() > 0.999
        # the rotated dims: within one unit of the dtype of eager torch's value (module docstring)
        ulp = torch.finfo(dtype).eps * torch.maximum(g.float().abs(), w.float().abs())
        assert bool(((g.float() - w.float()).abs() <= ulp).all())
        assert ((g.float() - w.float()).norm() / w.float().norm()).item() < 4e-3


def test_the_kernels_replay_in_a_cuda_graph():
    q, k, gate, (qw, kw), cos, sin = _inputs(64, *HEADS[0], torch.bfloat16, seed=1)
    o = q.contiguous()
    outs = (qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin), sigmoid_gate(o, gate))  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = (qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin), sigmoid_gate(o, gate))
    for t in (q, k, gate, o, cos, sin):
        t.copy_(torch.randn(t.shape, device="cuda").to(t.dtype))
    graph.replay()
    (gq, gk), gg = outs
    (eq, ek), eg = qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin), sigmoid_gate(o, gate)
    assert torch.equal(gq, eq) and torch.equal(gk, ek) and torch.equal(gg, eg)
