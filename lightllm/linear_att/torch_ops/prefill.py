"""Torch chunked prefill (the CPU path of `ops.chunk_delta_rule`), batched over rows and heads.

Rows are padded to a common number of chunks with no-op tokens (g = 0, beta = 0, k = v = 0: decay 1, zero
update), so the only Python loop is over chunks. Within a chunk (state S at its start, G_t the local cumulative
gate, D_ts = e^{G_t - G_s} for s <= t, in (0, 1]):
  (I + A) U = beta (v - S^T (e^{G_t} ⊙ k̂_t)),  A_ts = beta_t (k̂_t ⊙ D_ts) . k̂_s  for s < t
  o_t = S^T (e^{G_t} ⊙ q̂_t) + sum_{s<=t} ((q̂_t ⊙ D_ts) . k̂_s) u_s
  S  <- diag(e^{G_C}) S + sum_s (e^{G_C - G_s} ⊙ k̂_s) u_s^T
"""

from __future__ import annotations

import torch

from lightllm.linear_att.torch_ops.prep import default_scale, expand_heads, l2norm

CHUNK_SIZE = 32


def _pad_rows(x: torch.Tensor, row_of_token, pos_in_row, num_rows: int, padded_len: int) -> torch.Tensor:
    """Packed `[T, ...]` -> `[N, padded_len, ...]` fp32, zeros elsewhere."""
    out = torch.zeros(num_rows, padded_len, *x.shape[1:], dtype=torch.float32, device=x.device)
    out[row_of_token, pos_in_row] = x.float()
    return out


def _pair_dot(a: torch.Tensor, D: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum_c a_t[c] D_ts[c] b_s[c]: a, b `[N, HV, C, K]`, D `[N, HV, C, C, GK]` -> `[N, HV, C, C]`."""
    if D.shape[-1] == 1:
        return (a @ b.transpose(-1, -2)) * D[..., 0]
    return torch.einsum("nhtc,nhtsc,nhsc->nhts", a, D, b)


def chunk_delta_rule(q, k, v, g, beta, initial_state, cu_seqlens, *, scale=None, chunk_size: int = CHUNK_SIZE):
    """See `lightllm.linear_att.ops.chunk_delta_rule`."""
    num_tokens, num_v_heads, head_v = v.shape
    head_k = k.shape[-1]
    cu = torch.tensor([0, num_tokens], device=v.device) if cu_seqlens is None else cu_seqlens.long()
    num_rows = cu.numel() - 1
    lens = cu[1:] - cu[:-1]
    dev = v.device
    if initial_state is None:
        S = torch.zeros(num_rows, num_v_heads, head_k, head_v, dtype=torch.float32, device=dev)
    else:
        S = initial_state.float().clone()
    if num_tokens == 0:
        return torch.zeros_like(v), S
    num_chunks = -(-int(lens.max()) // chunk_size)
    padded_len = num_chunks * chunk_size
    row_of_token = torch.repeat_interleave(torch.arange(num_rows, device=dev), lens)
    pos_in_row = torch.arange(num_tokens, device=dev) - cu[:-1][row_of_token]

    def heads_first(x):
        return _pad_rows(x, row_of_token, pos_in_row, num_rows, padded_len).transpose(1, 2)

    scale = default_scale(head_k, scale)
    q_hat = heads_first(expand_heads(l2norm(q) * scale, num_v_heads))  # [N, HV, Tp, K]
    k_hat = heads_first(expand_heads(l2norm(k), num_v_heads))
    vp = heads_first(v)  # [N, HV, Tp, V]
    gp = heads_first(g)  # [N, HV, Tp, GK]
    bp = heads_first(beta)  # [N, HV, Tp]
    o = torch.zeros(num_rows, num_v_heads, padded_len, head_v, dtype=torch.float32, device=dev)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=dev).tril()
    strict = causal.tril(-1)
    eye = torch.eye(chunk_size, device=dev)
    for c in range(num_chunks):
        span = slice(c * chunk_size, (c + 1) * chunk_size)
        qc, kc, vc, bc = q_hat[:, :, span], k_hat[:, :, span], vp[:, :, span], bp[:, :, span]
        G = gp[:, :, span].cumsum(2)  # [N, HV, C, GK]
        diff = (G[:, :, :, None] - G[:, :, None, :]).masked_fill(~causal[:, :, None], float("-inf"))
        D = diff.exp()  # [N, HV, C, C, GK]
        A = (bc[..., None] * _pair_dot(kc, D, kc)).masked_fill(~strict, 0.0)
        rhs = bc[..., None] * (vc - (G.exp() * kc) @ S)
        U = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        o[:, :, span] = (G.exp() * qc) @ S + _pair_dot(qc, D, kc) @ U
        k_end = (G[:, :, -1:] - G).exp() * kc
        S = G[:, :, -1].exp()[..., None] * S + k_end.transpose(-1, -2) @ U
    o_packed = o.transpose(1, 2)[row_of_token, pos_in_row]
    return o_packed.to(v.dtype), S
