"""RMSNorm in the two conventions of the supported checkpoints, plus the gated output norms of GDN and KDA.

All statistics are computed in fp32. Qwen stores zero-centred weights and scales by `1 + w` in fp32 before
casting back; Kimi casts the normalised activations back first and scales by `w` in the activation dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """`x [..., D]`, `weight [D]` -> same shape and dtype as `x`."""
    if zero_centered:
        return (_normalize(x, eps) * (1.0 + weight.float())).to(x.dtype)
    return weight * _normalize(x, eps).to(x.dtype)


def gated_rms_norm_silu(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm (Qwen): `w · norm(x) · silu(gate)` per head; `x, gate [..., V]`, `weight [V]`."""
    y = weight * _normalize(x, eps).to(x.dtype)
    return (y * F.silu(gate.float())).to(x.dtype)


def gated_rms_norm_sigmoid(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """KDA output norm (Kimi): `w · norm(x) · sigmoid(gate)` entirely in fp32, then cast to `x`'s dtype."""
    y = weight.float() * _normalize(x, eps)
    return (y * torch.sigmoid(gate.float())).to(x.dtype)
