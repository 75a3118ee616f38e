"""RMSNorm in the two conventions of the supported checkpoints, plus the gated output norms of GDN and KDA.

All statistics are computed in fp32. Qwen stores zero-centred weights and scales by `1 + w` in fp32 before
casting back; Kimi casts the normalised activations back first and scales by `w` in the activation dtype. One
fused kernel per norm on CUDA (`lightllm.kernels.rms_norm`), its torch form elsewhere.
"""

from __future__ import annotations

import torch

from lightllm.kernels.rms_norm import (
    CAST_THEN_WEIGHT,
    FP32_WEIGHT,
    SIGMOID_GATE,
    SILU_GATE,
    ZERO_CENTERED,
    rms_norm_rows,
)


def _convention(zero_centered: bool) -> int:
    return ZERO_CENTERED if zero_centered else CAST_THEN_WEIGHT


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """`x [..., D]`, `weight [D]` -> same shape and dtype as `x`."""
    return rms_norm_rows(x, weight, eps, _convention(zero_centered))[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rms_norm(x + residual), x + residual)`: the residual stream's add and the next norm in one pass."""
    return rms_norm_rows(x, weight, eps, _convention(zero_centered), residual=residual)


def gated_rms_norm_silu(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm (Qwen): `w · norm(x) · silu(gate)` per head; `x, gate [..., V]`, `weight [V]`."""
    return rms_norm_rows(x, weight, eps, CAST_THEN_WEIGHT, gate, SILU_GATE)[0]


def gated_rms_norm_sigmoid(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """KDA output norm (Kimi): `w · norm(x) · sigmoid(gate)` entirely in fp32, then cast to `x`'s dtype."""
    return rms_norm_rows(x, weight, eps, FP32_WEIGHT, gate, SIGMOID_GATE)[0]
