"""Dense SwiGLU feed-forward: `down(silu(gate(x)) · up(x))`; gate/up column-parallel, down row-parallel."""

from __future__ import annotations

import torch
from torch import nn

from lightllm.kernels.silu_mul import silu_mul
from lightllm.models.layers.quantized_linear import linear, set_weight
from lightllm.models.loader import Shapes, WeightLoader


class SwiGLU(nn.Module):
    """Weights `gate_proj, up_proj [I, H]`, `down_proj [H, I]` (local shards). Output is a TP partial sum."""

    NAMES = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, intermediate_size: int, names: tuple[str, str, str] = NAMES):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.names = names

    def checkpoint_shapes(self, prefix: str, hidden: int) -> Shapes:
        gate, up, down = self.names
        i = self.intermediate_size
        return {
            f"{prefix}{gate}.weight": (i, hidden),
            f"{prefix}{up}.weight": (i, hidden),
            f"{prefix}{down}.weight": (hidden, i),
        }

    def load(self, w: WeightLoader, prefix: str) -> None:
        gate, up, down = (f"{prefix}{n}.weight" for n in self.names)
        gate_up = torch.cat([w.get_linear(gate, 0), w.get_linear(up, 0)])
        set_weight(self, "gate_up", w.linear(gate_up, gate, up))
        set_weight(self, "down", w.linear(w.get_linear(down, 1), down))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(silu_mul(linear(x, self.gate_up)), self.down)
