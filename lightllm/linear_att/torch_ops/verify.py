"""Torch twins of native verify, compact verify and compact commit (one window loop shared by the verifies).

Vectorised over rows and heads; the only Python loop is over the <= Wmax window tokens. The running state is
rounded to the storage dtype after every token, outputs are read before that rounding. Compact verify first merges
the slot's pending records (`_merged_states`, shared with compact commit: `S <- diag(e^g) S + k̂ uᵀ` per record),
then verifies from the merged state and records each token's `k̂`, `u` and `g`.
"""

from __future__ import annotations

import torch

from lightllm.linear_att.torch_ops.prep import (
    activate_gates,
    add_rank_one,
    delta_step,
    expand_heads,
    l2norm,
    read_out,
)


def _prepare(tokens):
    """(q̂·scale, k̂ per key head, v fp32, g, beta) of a `TokenInputs`."""
    t = tokens
    g, beta = activate_gates(t.graw, t.braw, t.A_log, t.dt_bias, t.lower_bound)
    return l2norm(t.q) * t.kernel_scale, l2norm(t.k), t.v.float(), g, beta


def _run_window(S, q_hat, k_hat, v, g, beta, widths, state_dtype, on_token, o):
    """Step every row through its window. S `[N, HV, K, V]` fp32 (updated in place, rounded per token); q_hat,
    k_hat per key head. on_token(s, rows, S_rounded, u) is called after token s for the rows whose width exceeds
    s; o `[N, Wmax, HV, V]` receives the outputs."""
    num_v_heads = v.shape[-2]
    for s in range(q_hat.shape[1]):
        rows = (widths > s).nonzero().squeeze(1)
        if rows.numel() == 0:
            break
        k_s = expand_heads(k_hat[rows, s], num_v_heads)
        S_new, u = delta_step(S[rows], k_s, v[rows, s], g[rows, s], beta[rows, s])
        o[rows, s] = read_out(S_new, expand_heads(q_hat[rows, s], num_v_heads)).to(o.dtype)
        S_new = S_new.to(state_dtype)
        on_token(s, rows, S_new, u)
        S[rows] = S_new.float()


def native_verify(tokens, state, slots, widths):
    """See `lightllm.linear_att.ops.native_verify`."""
    ssm, ssm_index = state.ssm, state.ssm_index
    sl, w = slots.long(), widths.long()
    q_hat, k_hat, vf, g, beta = _prepare(tokens)
    S = ssm[sl, ssm_index[sl].long()].float()
    o = torch.zeros_like(tokens.v)

    def write(s, rows, S_rounded, u):
        ssm[sl[rows], s] = S_rounded

    _run_window(S, q_hat, k_hat, vf, g, beta, w, ssm.dtype, write, o)
    return o


def compact_verify(tokens, state, slots, widths):
    """See `lightllm.linear_att.ops.compact_verify`."""
    ssm, win_k, win_u, win_g, pending, parity = state.pointers
    sl, w = slots.long(), widths.long()
    q_hat, k_hat, vf, g, beta = _prepare(tokens)
    # padding rows neither merge nor verify: their pending records wait for the slot's next verify
    num_pending = torch.where(w > 0, pending[sl].long().clamp(max=tokens.v.shape[1]), 0)
    buf = parity[sl].long()
    S = _merged_states(ssm, win_k, win_u, win_g, sl, num_pending, buf)
    o = torch.zeros_like(tokens.v)
    write_buf = 1 - buf

    def write(s, rows, S_rounded, u):
        dst, b = sl[rows], write_buf[rows]
        win_k[dst, b, s] = k_hat[rows, s]
        win_u[dst, b, s] = u
        win_g[dst, b, s] = g[rows, s]

    _run_window(S, q_hat, k_hat, vf, g, beta, w, ssm.dtype, write, o)
    return o


def _merged_states(ssm, win_k, win_u, win_g, sl, num_pending, buf):
    """fp32 states of slots `sl` after their `num_pending` records of window buffer `buf` (all `[n]`); one layer:
    ssm `[S, HV, K, V]`, win_* `[S, 2, Wmax, ...]`. Writes the merged state back for the rows with pending records."""
    S = ssm[sl].float()
    k_hat = expand_heads(win_k[sl, buf], ssm.shape[1])
    u, g = win_u[sl, buf], win_g[sl, buf]
    for s in range(win_k.shape[2]):
        rows = (num_pending > s).nonzero().squeeze(1)
        if rows.numel() == 0:
            break
        S_new = add_rank_one(S[rows] * g[rows, s].exp()[..., None], k_hat[rows, s], u[rows, s])
        S[rows] = S_new.to(ssm.dtype).float()
    merged = num_pending > 0
    ssm[sl[merged]] = S[merged].to(ssm.dtype)
    return S


def compact_commit(state, slots):
    """See `lightllm.linear_att.ops.compact_commit`."""
    ssm, win_k, win_u, win_g, pending, parity = state.pointers
    sl = slots.long()
    if sl.numel() == 0:
        return
    num_pending = pending[sl].long().clamp(max=win_k.shape[3])
    buf = parity[sl].long()
    for layer in range(ssm.shape[0]):
        _merged_states(ssm[layer], win_k[layer], win_u[layer], win_g[layer], sl, num_pending, buf)


def native_accept(ssm_index, conv_offset, slots, widths, accepted):
    """See `lightllm.linear_att.ops.native_accept`."""
    live = widths.long() > 0
    sl = slots.long()[live]
    last = accepted[live].to(ssm_index.dtype) - 1
    ssm_index[sl] = last
    conv_offset[sl] = last.to(conv_offset.dtype)
