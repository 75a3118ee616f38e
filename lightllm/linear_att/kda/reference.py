"""Kimi Delta Attention in plain torch fp32: the oracle every KDA path is tested against.

Self-contained on purpose (it imports nothing from `lightllm.linear_att`), like `gdn/reference.py`; KDA differs
from GDN only by its gate: one decay per key channel instead of one per value head.

Layout: packed varlen tokens. q, k `[T, H, K]`, v `[T, HV, V]`, g `[T, HV, K]` (log decay per key channel, <= 0),
beta `[T, HV]`, `cu_seqlens [N + 1]` (None = one row), states `[N, HV, K, V]` (rows = key channels).
Value head `hv` reads key head `hv // (HV // H)`.
Per token:  S <- diag(e^g) S;  u = beta (v - S^T k̂);  S <- S + k̂ u^T;  o = S^T q̂,
with k̂ = l2norm(k), q̂ = l2norm(q) * scale, l2norm(x) = x / sqrt(sum x^2 + 1e-6).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6


def kda_gate(
    f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None = None
) -> torch.Tensor:
    """Per-channel log decay from the gate projection `f [..., HV, K]`; A_log `[HV]`, dt_bias `[HV, K]` -> fp32.

    Default: g = -exp(A_log) * softplus(f + dt_bias) (softplus threshold 20).
    Bounded ("safe") form: g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias)), so g lies in (lower_bound, 0).
    """
    x = f.float() + dt_bias.float()
    rate = A_log.float().exp()[:, None]
    if lower_bound is None:
        return -rate * F.softplus(x, beta=1.0, threshold=20.0)
    return lower_bound * torch.sigmoid(rate * x)


def kda_beta(b: torch.Tensor) -> torch.Tensor:
    """beta = sigmoid(b) in fp32."""
    return torch.sigmoid(b.float())


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last dim, fp32."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _rows(num_tokens: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int]]:
    if cu_seqlens is None:
        return [(0, num_tokens)]
    cu = [int(c) for c in cu_seqlens.tolist()]
    return list(zip(cu[:-1], cu[1:]))


def _expand_heads(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """[T, H, K] -> [T, HV, K]: value head hv reads key head hv // (HV // H)."""
    return x.repeat_interleave(num_v_heads // x.shape[-2], dim=-2)


def _prepare(q, k, v, g, beta, scale):
    num_v_heads = v.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q_hat = _expand_heads(l2norm(q) * scale, num_v_heads)
    k_hat = _expand_heads(l2norm(k), num_v_heads)
    return q_hat, k_hat, v.float(), g.float(), beta.float()


def recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    round_state_to: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token KDA. Returns `(o [T, HV, V] fp32, final_state [N, HV, K, V] fp32)`.

    round_state_to: round the running state to this dtype after every token (native / compact storage rounding);
    the output of a token is read before its rounding.
    """
    q_hat, k_hat, v, g, beta = _prepare(q, k, v, g, beta, scale)
    rows = _rows(q.shape[0], cu_seqlens)
    num_v_heads, head_k, head_v = v.shape[1], k.shape[-1], v.shape[-1]
    o = torch.zeros_like(v)
    finals = []
    for i, (start, end) in enumerate(rows):
        S = torch.zeros(num_v_heads, head_k, head_v) if initial_state is None else initial_state[i].float().clone()
        for t in range(start, end):
            S = S * g[t].exp()[:, :, None]
            u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", S, k_hat[t]))
            S = S + k_hat[t][:, :, None] * u[:, None, :]
            o[t] = torch.einsum("hkv,hk->hv", S, q_hat[t])
            if round_state_to is not None:
                S = S.to(round_state_to).float()
        finals.append(S)
    return o, torch.stack(finals)


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked KDA (same results as the recurrent form up to fp32 rounding).

    With S the state at the chunk start and G_t = sum_{s<=t} g_s (a K-vector), D_ts = e^{G_t - G_s} per channel:
      u_t + sum_{s<t} beta_t (k̂_t ⊙ D_ts) . k̂_s u_s = beta_t (v_t - S^T (e^{G_t} ⊙ k̂_t))   (unit-lower solve)
      o_t = S^T (e^{G_t} ⊙ q̂_t) + sum_{s<=t} ((q̂_t ⊙ D_ts) . k̂_s) u_s
      S  <- diag(e^{G_C}) S + sum_s (e^{G_C - G_s} ⊙ k̂_s) u_s^T
    Only differences with s <= t are exponentiated: every factor is in (0, 1], nothing can overflow.
    """
    q_hat, k_hat, v, g, beta = _prepare(q, k, v, g, beta, scale)
    rows = _rows(q.shape[0], cu_seqlens)
    num_v_heads, head_k, head_v = v.shape[1], k.shape[-1], v.shape[-1]
    o = torch.zeros_like(v)
    finals = []
    for i, (start, end) in enumerate(rows):
        S = torch.zeros(num_v_heads, head_k, head_v) if initial_state is None else initial_state[i].float().clone()
        for c0 in range(start, end, chunk_size):
            c1 = min(c0 + chunk_size, end)
            # head-major views of the chunk: [HV, C, ...]
            qc, kc, vc = q_hat[c0:c1].transpose(0, 1), k_hat[c0:c1].transpose(0, 1), v[c0:c1].transpose(0, 1)
            bc = beta[c0:c1].transpose(0, 1)
            G = g[c0:c1].transpose(0, 1).cumsum(1)  # [HV, C, K]
            n = c1 - c0
            causal = torch.ones(n, n, dtype=torch.bool).tril()
            strict = torch.ones(n, n, dtype=torch.bool).tril(-1)
            diff = (G[:, :, None, :] - G[:, None, :, :]).masked_fill(~causal[:, :, None], float("-inf"))
            D = diff.exp()  # [HV, C, C, K]
            kk = torch.einsum("htc,htsc,hsc->hts", kc, D, kc)
            A = (bc[:, :, None] * kk).masked_fill(~strict, 0.0)
            rhs = bc[:, :, None] * (vc - (G.exp() * kc) @ S)
            eye = torch.eye(n).expand_as(A)
            U = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
            qk = torch.einsum("htc,htsc,hsc->hts", qc, D, kc)
            oc = (G.exp() * qc) @ S + qk @ U
            o[c0:c1] = oc.transpose(0, 1)
            k_end = (G[:, -1:, :] - G).exp() * kc  # [HV, C, K]
            S = G[:, -1, :].exp()[:, :, None] * S + k_end.transpose(-1, -2) @ U
        finals.append(S)
    return o, torch.stack(finals)
