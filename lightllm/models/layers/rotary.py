"""Rotary position embedding on the leading `rotary_dim` dims of each head (rotate-half convention).

Qwen3-Next rotates the first quarter of each 256-dim head; Qwen3.5's interleaved M-RoPE is the same map for
text-only inputs because its three position streams coincide. A config's linear or YaRN scaling
(`RopeScaling`) rescales the frequencies once, at build: neither depends on the sequence length.
"""

from __future__ import annotations

import math

import torch

from lightllm.kernels.qk_norm_rope import rope_cos_sin, rope_rotate
from lightllm.models.config import RopeScaling


def rope_inv_freq(rotary_dim: int, theta: float, scaling: RopeScaling | None, device) -> torch.Tensor:
    """`[rotary_dim // 2]` fp32 inverse frequencies, rescaled as `scaling` says."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor

    # YaRN: a dim that turns r times over the original context has index d(r); dims below d(beta_fast) keep their
    # frequency (extrapolate), dims above d(beta_slow) are divided by the factor (interpolate), a ramp between
    def dim_of(rotations: float) -> float:
        turns = scaling.original_max_position_embeddings / (rotations * 2 * math.pi)
        return rotary_dim * math.log(turns) / (2 * math.log(theta))

    low, high = dim_of(scaling.beta_fast), dim_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    return inv_freq / scaling.factor * ramp + inv_freq * (1 - ramp)


class Rotary:
    def __init__(
        self, rotary_dim: int, theta: float, device: torch.device | str = "cpu", scaling: RopeScaling | None = None
    ):
        self.rotary_dim = rotary_dim
        self.inv_freq = rope_inv_freq(rotary_dim, theta, scaling, device)
        self.attention_factor = scaling.attention_factor if scaling is not None else 1.0

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`positions [T]` int -> `cos, sin [T, rotary_dim]` in `dtype` (angles computed in fp32), each scaled by
        the attention factor (YaRN's temperature; 1 otherwise)."""
        return rope_cos_sin(positions, self.inv_freq, self.attention_factor, dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`x [T, heads, head_dim]` -> rotated copy; dims past `rotary_dim` pass through."""
        return rope_rotate(x, cos, sin)
