"""Gated DeltaNet in plain torch fp32: the oracle every GDN path is tested against.

Independent of the kernels on purpose: it imports only `reference_common.py` (what both algorithms' oracles share,
itself importing only torch) and states the math of `docs/state_modes.md` §1 once, slowly, so a kernel bug cannot
hide in a helper shared with the kernel.

Layout: packed varlen tokens. q, k `[T, H, K]`, v `[T, HV, V]`, g `[T, HV]` (log decay, <= 0), beta `[T, HV]`,
`cu_seqlens [N + 1]` row offsets (None = one row), states `[N, HV, K, V]` (rows = key channels).
Value head `hv` reads key head `hv // (HV // H)`.
Per token:  S <- e^g S;  u = beta (v - S^T k̂);  S <- S + k̂ u^T;  o = S^T q̂,
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


def gdn_gate(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """g = -exp(A_log) * softplus(a + dt_bias): a `[..., HV]`, A_log / dt_bias `[HV]` -> fp32 `[..., HV]`."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias.float(), beta=1.0, threshold=20.0)


def gdn_beta(b: torch.Tensor) -> torch.Tensor:
    """beta = sigmoid(b) in fp32."""
    return torch.sigmoid(b.float())


def recurrent_gated_delta_rule(q, k, v, g, beta, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token GDN (`reference_common.recurrent_delta_rule`: options scale, initial_state, cu_seqlens,
    round_state_to)."""
    return recurrent_delta_rule(q, k, v, g, beta, **options)


def chunk_gated_delta_rule(q, k, v, g, beta, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked GDN (same results as the recurrent form up to fp32 rounding).

    Inside a chunk with state S at its start and local cumulative gates G_t = sum_{s<=t} g_s:
      u_t + sum_{s<t} beta_t e^{G_t - G_s} (k̂_s . k̂_t) u_s = beta_t (v_t - e^{G_t} S^T k̂_t)   (unit-lower solve)
      o_t = e^{G_t} S^T q̂_t + sum_{s<=t} e^{G_t - G_s} (k̂_s . q̂_t) u_s
      S  <- e^{G_C} S + sum_s e^{G_C - G_s} k̂_s u_s^T
    Only differences G_t - G_s with s <= t are exponentiated, so every factor is in (0, 1].
    """
    return chunked_delta_rule(q, k, v, g, beta, _chunk, **options)


def _chunk(S, qc, kc, vc, bc, G):
    """One chunk of the form above: G `[HV, C]`."""
    causal, strict = chunk_masks(qc.shape[1])
    decay = (G[:, :, None] - G[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # e^{G_t - G_s}, s <= t
    A = (bc[:, :, None] * (kc @ kc.transpose(-1, -2)) * decay).masked_fill(~strict, 0.0)
    U = solve_unit_lower(A, bc[:, :, None] * (vc - G.exp()[:, :, None] * (kc @ S)))
    oc = G.exp()[:, :, None] * (qc @ S) + ((qc @ kc.transpose(-1, -2)) * decay) @ U
    w_end = (G[:, -1:] - G).exp()  # [HV, C]
    return oc, G[:, -1].exp()[:, None, None] * S + (kc * w_end[:, :, None]).transpose(-1, -2) @ U
