"""Torch twins of native verify, compact verify and compact commit (one window loop shared by all three).

Vectorised over rows and heads; the only Python loop is over the <= Wmax window tokens. The running state is
rounded to the storage dtype after every token, outputs are read before that rounding.
"""

from __future__ import annotations

import torch

from lightllm.linear_att.torch_ops.prep import (
    activate_gates,
    default_scale,
    delta_step,
    expand_heads,
    l2norm,
    read_out,
)


def _prepare(q, k, v, graw, braw, A_log, dt_bias, scale, lower_bound):
    num_v_heads = v.shape[-2]
    scale = default_scale(q.shape[-1], scale)
    q_hat = expand_heads(l2norm(q) * scale, num_v_heads)
    k_hat = expand_heads(l2norm(k), num_v_heads)
    g, beta = activate_gates(graw, braw, A_log, dt_bias, lower_bound)
    return q_hat, k_hat, v.float(), g, beta


def _run_window(S, q_hat, k_hat, v, g, beta, widths, state_dtype, on_token, o=None, out_dtype=None):
    """Step every row through its window. S `[N, HV, K, V]` fp32 (updated in place, rounded per token).

    on_token(s, rows, S_rounded) is called after token s for the rows whose width exceeds s.
    With q_hat given, o `[N, Wmax, HV, V]` receives the outputs.
    """
    for s in range(q_hat.shape[1] if q_hat is not None else k_hat.shape[1]):
        rows = (widths > s).nonzero().squeeze(1)
        if rows.numel() == 0:
            break
        S_new, _ = delta_step(S[rows], k_hat[rows, s], v[rows, s], g[rows, s], beta[rows, s])
        if q_hat is not None:
            o[rows, s] = read_out(S_new, q_hat[rows, s]).to(out_dtype)
        S_new = S_new.to(state_dtype)
        on_token(s, rows, S_new)
        S[rows] = S_new.float()


def native_verify(q, k, v, graw, braw, A_log, dt_bias, ssm, ssm_index, slots, widths, *, scale=None, lower_bound=None):
    """See `lightllm.linear_att.ops.native_verify`."""
    num_rows, max_width, num_v_heads, head_v = v.shape
    sl, w = slots.long(), widths.long()
    q_hat, k_hat, vf, g, beta = _prepare(q, k, v, graw, braw, A_log, dt_bias, scale, lower_bound)
    S = ssm[sl, ssm_index[sl].long()].float()
    o = torch.zeros(num_rows, max_width, num_v_heads, head_v, dtype=v.dtype, device=v.device)

    def write(s, rows, S_rounded):
        ssm[sl[rows], s] = S_rounded

    _run_window(S, q_hat, k_hat, vf, g, beta, w, ssm.dtype, write, o, v.dtype)
    return o


def compact_verify(
    q,
    k,
    v,
    graw,
    braw,
    A_log,
    dt_bias,
    ssm,
    win_k,
    win_v,
    win_g,
    win_beta,
    slots,
    widths,
    *,
    scale=None,
    lower_bound=None,
):
    """See `lightllm.linear_att.ops.compact_verify`."""
    num_rows, max_width, num_v_heads, head_v = v.shape
    sl, w = slots.long(), widths.long()
    q_hat, k_hat, vf, g, beta = _prepare(q, k, v, graw, braw, A_log, dt_bias, scale, lower_bound)
    S = ssm[sl].float()
    o = torch.zeros(num_rows, max_width, num_v_heads, head_v, dtype=v.dtype, device=v.device)

    def write(s, rows, S_rounded):
        dst = sl[rows]
        win_k[dst, s] = k[rows, s].to(win_k.dtype)
        win_v[dst, s] = v[rows, s].to(win_v.dtype)
        win_g[dst, s] = g[rows, s]
        win_beta[dst, s] = beta[rows, s]

    _run_window(S, q_hat, k_hat, vf, g, beta, w, ssm.dtype, write, o, v.dtype)
    return o


def compact_commit(ssm, win_k, win_v, win_g, win_beta, slots, widths, accepted):
    """See `lightllm.linear_att.ops.compact_commit`."""
    live = widths.long() > 0
    sl = slots.long()[live]
    acc = accepted.long()[live]
    if sl.numel() == 0:
        return
    num_v_heads = ssm.shape[2]
    for layer in range(ssm.shape[0]):
        S = ssm[layer, sl].float()
        k_hat = expand_heads(l2norm(win_k[layer, sl]), num_v_heads)
        _run_window(
            S,
            None,
            k_hat,
            win_v[layer, sl].float(),
            win_g[layer, sl],
            win_beta[layer, sl],
            acc,
            ssm.dtype,
            lambda s, rows, S_rounded: None,
        )
        ssm[layer, sl] = S.to(ssm.dtype)
