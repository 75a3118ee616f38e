"""The fp32 oracles (`gdn/reference.py`, `kda/reference.py`) against independent torch recurrences:
transformers' Qwen3-Next / Kimi-Linear torch paths and fla-core's naive references; chunked == recurrent."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightllm.linear_att.gdn import reference as gdn_ref
from lightllm.linear_att.kda import reference as kda_ref
from unit_tests.helpers.asserts import assert_rel_close


def _inputs(T, H, HV, K, V, gk, seed, lower_bound=None):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(T, H, K, generator=gen), torch.randn(T, H, K, generator=gen)
    v = torch.randn(T, HV, V, generator=gen)
    A_log = torch.rand(HV, generator=gen) - 0.5
    if gk == 1:
        g = gdn_ref.gdn_gate(torch.randn(T, HV, generator=gen), A_log, torch.randn(HV, generator=gen))
    else:
        g = kda_ref.kda_gate(
            torch.randn(T, HV, K, generator=gen), A_log, torch.randn(HV, K, generator=gen), lower_bound
        )
    beta = torch.sigmoid(torch.randn(T, HV, generator=gen))
    h0 = torch.randn(1, HV, K, V, generator=gen)
    return q, k, v, g, beta, h0


def _unwrapped(fn):
    # transformers swaps in fla's kernels when fla imports; the torch function it wraps is the independent oracle
    return getattr(fn, "__wrapped__", fn)


@pytest.mark.parametrize("ratio", [1, 2, 4], ids=lambda r: f"hv_per_h{r}")
def test_gdn_recurrent_matches_transformers_qwen3_next(ratio):
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    H, K, V, T = 2, 16, 24, 37
    q, k, v, g, beta, h0 = _inputs(T, H, H * ratio, K, V, 1, seed=ratio)
    o, s = gdn_ref.recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0)
    # the HF function takes q/k already repeated to the value heads
    qh, kh = q.repeat_interleave(ratio, 1)[None], k.repeat_interleave(ratio, 1)[None]
    for fn in (hf.torch_recurrent_gated_delta_rule, hf.torch_chunk_gated_delta_rule):
        o_hf, s_hf = _unwrapped(fn)(
            qh,
            kh,
            v[None],
            g[None],
            beta[None],
            initial_state=h0,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        assert_rel_close(f"{fn.__name__} o", o, o_hf[0], 1e-5)
        assert_rel_close(f"{fn.__name__} state", s, s_hf, 1e-5)


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus_gate", "safe_gate"])
def test_kda_recurrent_matches_transformers_kimi_and_fla_naive(lower_bound):
    from fla.ops.kda.naive import naive_recurrent_kda
    from transformers.models.kimi_linear import modeling_kimi_linear as hf

    H, HV, K, V, T = 2, 4, 16, 24, 29
    q, k, v, g, beta, h0 = _inputs(T, H, HV, K, V, K, seed=3, lower_bound=lower_bound)
    o, s = kda_ref.recurrent_kda(q, k, v, g, beta, initial_state=h0)
    qh, kh = q.repeat_interleave(2, 1)[None], k.repeat_interleave(2, 1)[None]
    o_hf, s_hf = _unwrapped(hf.recurrent_kimi_delta_attention)(
        qh, kh, v[None], g[None], beta[None], initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    assert_rel_close("kimi recurrent o", o, o_hf[0], 1e-5)
    assert_rel_close("kimi recurrent state", s, s_hf, 1e-5)
    o_fla, s_fla = naive_recurrent_kda(
        kda_ref.l2norm(q)[None],
        kda_ref.l2norm(k)[None],
        v[None],
        g[None],
        beta[None],
        initial_state=h0.clone(),
        output_final_state=True,
    )
    assert_rel_close("fla naive o", o, o_fla[0], 1e-5)
    assert_rel_close("fla naive state", s, s_fla, 1e-5)


def test_gdn_recurrent_matches_fla_naive():
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    H, K, V, T = 3, 16, 8, 25
    q, k, v, g, beta, h0 = _inputs(T, H, H, K, V, 1, seed=5)
    o, s = gdn_ref.recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0)
    # fla's naive GDN takes pre-normalised q/k, beta before g, and applies the default scale itself
    o_fla, s_fla = naive_recurrent_gated_delta_rule(
        gdn_ref.l2norm(q)[None],
        gdn_ref.l2norm(k)[None],
        v[None],
        beta[None],
        g[None],
        initial_state=h0.clone(),
        output_final_state=True,
    )
    assert_rel_close("fla naive o", o, o_fla[0], 1e-5)
    assert_rel_close("fla naive state", s, s_fla, 1e-5)


def test_kda_gates_match_fla_and_kimi_forms():
    from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate

    gen = torch.Generator().manual_seed(7)
    HV, K = 3, 8
    f = torch.randn(5, HV, K, generator=gen) * 10
    A_log, dt_bias = torch.randn(HV, generator=gen), torch.randn(HV, K, generator=gen)
    assert_rel_close(
        "softplus gate", kda_ref.kda_gate(f, A_log, dt_bias), naive_kda_gate(f, A_log, dt_bias.flatten()), 1e-6
    )
    assert_rel_close(
        "safe gate",
        kda_ref.kda_gate(f, A_log, dt_bias, -5.0),
        naive_kda_lowerbound_gate(f, A_log, dt_bias.flatten(), lower_bound=-5.0),
        1e-6,
    )
    # Kimi-Linear's gate: -exp(A_log) * softplus(f + dt_bias) with the linear branch above 20
    x = f + dt_bias
    kimi = -A_log.exp()[:, None] * torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x)))
    assert_rel_close("kimi gate", kda_ref.kda_gate(f, A_log, dt_bias), kimi, 1e-6)
    gdn = gdn_ref.gdn_gate(f[..., 0], A_log, dt_bias[:, 0])
    assert_rel_close("gdn gate", gdn, -A_log.exp() * F.softplus(f[..., 0] + dt_bias[:, 0]), 1e-6)


CASES = [
    # (name, lengths, chunk_size)
    ("one_row_boundary_inside", [37], 16),
    ("exact_chunks", [32], 16),
    ("varlen_with_empty_row", [5, 0, 40, 17], 16),
    ("single_tokens", [1, 1], 64),
]


@pytest.mark.parametrize("algo", ["gdn", "kda"])
@pytest.mark.parametrize("initial", [False, True], ids=["zero_state", "has_initial_state"])
@pytest.mark.parametrize("name,lengths,chunk", CASES, ids=[c[0] for c in CASES])
def test_chunked_equals_recurrent(algo, initial, name, lengths, chunk):
    H, HV, K, V = 2, 4, 16, 8
    T = sum(lengths)
    gk = 1 if algo == "gdn" else K
    q, k, v, g, beta, _ = _inputs(T, H, HV, K, V, gk, seed=11)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    h0 = torch.randn(len(lengths), HV, K, V, generator=torch.Generator().manual_seed(2)) if initial else None
    ref = gdn_ref if algo == "gdn" else kda_ref
    rec = ref.recurrent_gated_delta_rule if algo == "gdn" else ref.recurrent_kda
    chk = ref.chunk_gated_delta_rule if algo == "gdn" else ref.chunk_kda
    o_r, s_r = rec(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu)
    o_c, s_c = chk(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, chunk_size=chunk)
    assert_rel_close("o", o_c, o_r, 2e-6)
    assert_rel_close("state", s_c, s_r, 2e-6)
