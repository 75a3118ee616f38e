"""Rotary position embedding on the leading `rotary_dim` dims of each head (rotate-half convention).

Qwen3-Next rotates the first quarter of each 256-dim head; Qwen3.5's interleaved M-RoPE is the same map for
text-only inputs because its three position streams coincide.
"""

from __future__ import annotations

import torch


class Rotary:
    def __init__(self, rotary_dim: int, theta: float, device: torch.device | str = "cpu"):
        self.rotary_dim = rotary_dim
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim
        self.inv_freq = 1.0 / (theta**exponents)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`positions [T]` int -> `cos, sin [T, rotary_dim]` in `dtype` (angles computed in fp32)."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`x [T, heads, head_dim]` -> rotated copy; dims past `rotary_dim` pass through."""
        if self.rotary_dim == 0:
            return x
        rd = self.rotary_dim
        rot, rest = x[..., :rd], x[..., rd:]
        half = rd // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        cos, sin = cos[:, None, :], sin[:, None, :]
        return torch.cat((rot * cos + rotated * sin, rest), dim=-1)
