"""In-kernel preprocessing shared by every torch twin: gates, beta, q/k l2norm, grouped value heads.

One function per quantity, so native, compact and replay see bitwise identical inputs on the torch path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6


def activate_gates(
    graw: torch.Tensor,
    braw: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """graw `[..., HV, GK]`, braw `[..., HV]`, A_log `[HV]`, dt_bias `[HV, GK]` -> fp32 `(g, beta)`, same shapes."""
    x = graw.float() + dt_bias.float()
    rate = A_log.float().exp()[:, None]
    if lower_bound is None:
        g = -rate * F.softplus(x, beta=1.0, threshold=20.0)
    else:
        g = lower_bound * torch.sigmoid(rate * x)
    return g, torch.sigmoid(braw.float())


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last dim, in fp32."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def expand_heads(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """`[..., H, D]` per key head -> `[..., HV, D]`: value head hv reads key head hv // (HV // H)."""
    return x.repeat_interleave(num_v_heads // x.shape[-2], dim=-2)


def default_scale(head_k_dim: int, scale: float | None) -> float:
    return head_k_dim**-0.5 if scale is None else scale


def delta_step(
    S: torch.Tensor, k_hat: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule, fp32, decay first.

    S `[n, HV, K, V]`, k_hat `[n, HV, K]`, v `[n, HV, V]`, g `[n, HV, GK]` (GK = 1 or K), beta `[n, HV]`.
    Returns `(S_new, u)` with u `[n, HV, V]`. Contractions are elementwise products summed over K so that the
    result of a row does not depend on how many rows are batched with it (native == compact bitwise).
    """
    S = S * g.exp()[..., None]
    u = beta[..., None] * (v - (S * k_hat[..., None]).sum(-2))
    return add_rank_one(S, k_hat, u), u


def add_rank_one(S: torch.Tensor, k_hat: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`S + k̂ uᵀ`: S `[n, HV, K, V]`, k_hat `[n, HV, K]`, u `[n, HV, V]` (a verified token and a merged compact
    record take this one update, so they round alike)."""
    return S + k_hat[..., None] * u[..., None, :]


def read_out(S: torch.Tensor, q_hat: torch.Tensor) -> torch.Tensor:
    """o = S^T q_hat: S `[n, HV, K, V]`, q_hat `[n, HV, K]` -> `[n, HV, V]` fp32."""
    return (S * q_hat[..., None]).sum(-2)
