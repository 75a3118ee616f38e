"""Torch twins of the replay operators: verify with on-device fold, accept, fold.

The state after h committed records is rebuilt in fp32 from the canonical state S0 and the records
(`S_h = diag(e^{G_h}) S0 + sum_j diag(e^{G_h - G_j}) k̂_j u_j^T`); records past the cursor are never read, not
even multiplied by zero, so poisoned (NaN) stale records cannot leak. Inside the window the state stays fp32.
"""

from __future__ import annotations

import torch

from lightllm.linear_att.torch_ops.prep import (
    activate_gates,
    delta_step,
    expand_heads,
    l2norm,
    read_out,
)


def replay_folds(h: torch.Tensor, width: torch.Tensor, replay_capacity: int) -> torch.Tensor:
    """The replay fold rule (twin of `kernels/common.replay_folds`): a row of `width` over `h` committed records
    folds iff its records would not fit in the replay_capacity."""
    return h + width > replay_capacity


def _total_gate(hist_g: torch.Tensor, cursor: torch.Tensor) -> torch.Tensor:
    """G_h of each row: hist_g `[n, L, HV, GK]`, cursor `[n]` -> `[n, HV, GK]` (0 where h == 0)."""
    idx = (cursor - 1).clamp(min=0)
    last = hist_g[torch.arange(cursor.numel(), device=cursor.device), idx]
    return torch.where((cursor > 0)[:, None, None], last, torch.zeros_like(last))


def history_state(S0, hist_k, hist_u, hist_g, cursor):
    """S_h in fp32. S0 `[n, HV, K, V]`, hist_k `[n, L, H, K]`, hist_u `[n, L, HV, V]`, hist_g `[n, L, HV, GK]`,
    cursor `[n]` (records 0..h-1 are read). Returns `(S_h, G_h)`."""
    num_v_heads, cap = S0.shape[1], hist_k.shape[1]
    valid = (torch.arange(cap, device=S0.device)[None, :] < cursor[:, None])[..., None, None]  # [n, L, 1, 1]
    G_h = _total_gate(hist_g, cursor)
    k_hist = torch.where(valid, expand_heads(hist_k.float(), num_v_heads), 0.0)  # [n, L, HV, K]
    u_hist = torch.where(valid, hist_u.float(), 0.0)
    weight = torch.where(valid, (G_h[:, None] - hist_g).exp(), 0.0)  # [n, L, HV, GK], in (0, 1]
    S_h = S0.float() * G_h.exp()[..., None] + torch.einsum("nlhk,nlhv->nhkv", k_hist * weight, u_hist)
    return S_h, G_h


def replay_verify(tokens, state, slots, widths, *, projection="inline"):
    """See `lightllm.linear_att.ops.replay_verify` (`projection` only changes the Triton schedule)."""
    q, k, v, graw, braw, A_log, dt_bias = tokens.pointers
    ssm, hist_k, hist_u, hist_g, cursor, parity = state.pointers
    num_rows, max_width, num_v_heads, head_v = v.shape
    cap = state.replay_capacity
    o = torch.zeros(num_rows, max_width, num_v_heads, head_v, dtype=v.dtype, device=v.device)
    live = (widths.long() > 0).nonzero().squeeze(1)
    if live.numel() == 0:
        return o
    sl = slots.long()[live]
    w = widths.long()[live]
    h = cursor[sl].long()
    p = parity[sl].long()
    fold = replay_folds(h, w, cap)
    scale = tokens.kernel_scale
    k_hat_key = l2norm(k[live])  # [n, Wmax, H, K]: records are stored per key head
    q_hat = expand_heads(l2norm(q[live]) * scale, num_v_heads)
    k_hat = expand_heads(k_hat_key, num_v_heads)
    g, beta = activate_gates(graw[live], braw[live], A_log, dt_bias, tokens.lower_bound)
    vf = v[live].float()

    S_h, G_h = history_state(ssm[sl], hist_k[sl, p], hist_u[sl, p], hist_g[sl, p], h)
    # a folding row continues from what `ssm` will hold, so later reads see the same state this window used
    S_folded = S_h.to(ssm.dtype)
    if bool(fold.any()):
        ssm[sl[fold]] = S_folded[fold]
    S = torch.where(fold[:, None, None, None], S_folded.float(), S_h)
    G = torch.where(fold[:, None, None], torch.zeros_like(G_h), G_h)
    buf = torch.where(fold, 1 - p, p)
    base = torch.where(fold, torch.zeros_like(h), h)
    for s in range(max_width):
        rows = (w > s).nonzero().squeeze(1)
        if rows.numel() == 0:
            break
        S_new, u = delta_step(S[rows], k_hat[rows, s], vf[rows, s], g[rows, s], beta[rows, s])
        o[live[rows], s] = read_out(S_new, q_hat[rows, s]).to(v.dtype)
        S[rows] = S_new
        G[rows] = G[rows] + g[rows, s]
        dst, b, pos = sl[rows], buf[rows], base[rows] + s
        hist_k[dst, b, pos] = k_hat_key[rows, s]
        hist_u[dst, b, pos] = u
        hist_g[dst, b, pos] = G[rows]
    return o


def replay_accept(cursor, parity, conv_offset, slots, widths, accepted, replay_capacity):
    """See `lightllm.linear_att.ops.replay_accept`."""
    live = widths.long() > 0
    sl = slots.long()[live]
    w = widths[live].to(cursor.dtype)
    a = accepted[live].to(cursor.dtype)
    h = cursor[sl]
    fold = replay_folds(h, w, replay_capacity)
    cursor[sl] = torch.where(fold, a, h + a)
    parity[sl] = torch.where(fold, 1 - parity[sl], parity[sl])
    conv_offset[sl] = (a - 1).to(conv_offset.dtype)


def replay_fold(state, slots, *, out=None):
    """See `lightllm.linear_att.ops.replay_fold`."""
    ssm, hist_k, hist_u, hist_g, cursor, parity = state.pointers
    sl = slots.long()
    if sl.numel() == 0:
        return
    h = cursor[sl].long()
    p = parity[sl].long()
    for layer in range(ssm.shape[0]):
        S_h, _ = history_state(ssm[layer, sl], hist_k[layer, sl, p], hist_u[layer, sl, p], hist_g[layer, sl, p], h)
        if out is None:
            ssm[layer, sl] = S_h.to(ssm.dtype)
        else:
            out[layer] = S_h.to(out.dtype)
