"""Torch twins of native verify, compact verify and compact commit (one window loop shared by all three).

Vectorised over rows and heads; the only Python loop is over the <= Wmax window tokens. The running state is
rounded to the storage dtype after every token, outputs are read before that rounding. Compact verify first merges
the slot's pending tokens (`_merged_states`, shared with compact commit), then verifies from the merged state.
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
    pending,
    parity,
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
    # padding rows neither merge nor verify: their pending tokens wait for the slot's next verify
    num_pending = torch.where(w > 0, pending[sl].long().clamp(max=max_width), 0)
    buf = parity[sl].long()
    S = _merged_states(ssm, win_k, win_v, win_g, win_beta, sl, num_pending, buf)
    o = torch.zeros(num_rows, max_width, num_v_heads, head_v, dtype=v.dtype, device=v.device)
    write_buf = 1 - buf

    def write(s, rows, S_rounded):
        dst, b = sl[rows], write_buf[rows]
        win_k[dst, b, s] = k[rows, s].to(win_k.dtype)
        win_v[dst, b, s] = v[rows, s].to(win_v.dtype)
        win_g[dst, b, s] = g[rows, s]
        win_beta[dst, b, s] = beta[rows, s]

    _run_window(S, q_hat, k_hat, vf, g, beta, w, ssm.dtype, write, o, v.dtype)
    return o


def _merged_states(ssm, win_k, win_v, win_g, win_beta, sl, num_pending, buf):
    """fp32 states of slots `sl` after their `num_pending` tokens of window buffer `buf` (all `[n]`); one layer:
    ssm `[S, HV, K, V]`, win_* `[S, 2, Wmax, ...]`. Writes the merged state back for the rows with pending tokens."""
    S = ssm[sl].float()
    k_hat = expand_heads(l2norm(win_k[sl, buf]), ssm.shape[1])
    no_output = lambda s, rows, S_rounded: None  # noqa: E731
    _run_window(S, None, k_hat, win_v[sl, buf].float(), win_g[sl, buf], win_beta[sl, buf], num_pending, ssm.dtype,
                no_output)  # fmt: skip
    merged = num_pending > 0
    ssm[sl[merged]] = S[merged].to(ssm.dtype)
    return S


def compact_commit(ssm, win_k, win_v, win_g, win_beta, pending, parity, slots):
    """See `lightllm.linear_att.ops.compact_commit`."""
    sl = slots.long()
    if sl.numel() == 0:
        return
    num_pending = pending[sl].long().clamp(max=win_k.shape[3])
    buf = parity[sl].long()
    for layer in range(ssm.shape[0]):
        _merged_states(ssm[layer], win_k[layer], win_v[layer], win_g[layer], win_beta[layer], sl, num_pending, buf)
