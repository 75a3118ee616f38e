"""Kimi Delta Attention in plain torch fp32: the oracle every KDA path is tested against.

Independent of the kernels on purpose, like `gdn/reference.py` (it imports only `reference_common.py`, which
both oracles share); KDA differs from GDN only by its gate: one decay per key channel instead of one per value
head.

Layout: packed varlen tokens. q, k `[T, H, K]`, v `[T, HV, V]`, g `[T, HV, K]` (log decay per key channel, <= 0),
beta `[T, HV]`, `cu_seqlens [N + 1]` (None = one row), states `[N, HV, K, V]` (rows = key channels).
Value head `hv` reads key head `hv // (HV // H)`.
Per token:  S <- diag(e^g) S;  u = beta (v - S^T k̂);  S <- S + k̂ u^T;  o = S^T q̂,
with k̂ = l2norm(k), q̂ = l2norm(q) * scale, l2norm(x) = x / sqrt(sum x^2 + 1e-6).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# l2norm is part of the oracle's interface: tests normalise their own inputs with it
from lightllm.linear_att.reference_common import (  # noqa: F401
    chunk_masks,
    chunked_delta_rule,
    l2norm,
    recurrent_delta_rule,
    solve_unit_lower,
)


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


def recurrent_kda(q, k, v, g, beta, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token KDA (`reference_common.recurrent_delta_rule`: options scale, initial_state, cu_seqlens,
    round_state_to)."""
    return recurrent_delta_rule(q, k, v, g, beta, **options)


def chunk_kda(q, k, v, g, beta, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked KDA (same results as the recurrent form up to fp32 rounding).

    With S the state at the chunk start and G_t = sum_{s<=t} g_s (a K-vector), D_ts = e^{G_t - G_s} per channel:
      u_t + sum_{s<t} beta_t (k̂_t ⊙ D_ts) . k̂_s u_s = beta_t (v_t - S^T (e^{G_t} ⊙ k̂_t))   (unit-lower solve)
      o_t = S^T (e^{G_t} ⊙ q̂_t) + sum_{s<=t} ((q̂_t ⊙ D_ts) . k̂_s) u_s
      S  <- diag(e^{G_C}) S + sum_s (e^{G_C - G_s} ⊙ k̂_s) u_s^T
    Only differences with s <= t are exponentiated: every factor is in (0, 1], nothing can overflow.
    """
    return chunked_delta_rule(q, k, v, g, beta, _chunk, **options)


def _chunk(S, qc, kc, vc, bc, G):
    """One chunk of the form above: G `[HV, C, K]`."""
    causal, strict = chunk_masks(qc.shape[1])
    D = (G[:, :, None, :] - G[:, None, :, :]).masked_fill(~causal[:, :, None], float("-inf")).exp()  # [HV, C, C, K]
    kk = torch.einsum("htc,htsc,hsc->hts", kc, D, kc)
    U = solve_unit_lower((bc[:, :, None] * kk).masked_fill(~strict, 0.0), bc[:, :, None] * (vc - (G.exp() * kc) @ S))
    oc = (G.exp() * qc) @ S + torch.einsum("htc,htsc,hsc->hts", qc, D, kc) @ U
    k_end = (G[:, -1:, :] - G).exp() * kc  # [HV, C, K]
    return oc, G[:, -1, :].exp()[:, :, None] * S + k_end.transpose(-1, -2) @ U
