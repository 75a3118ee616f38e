"""Linear weights that may be block-FP8: the one `linear` every projection of the model calls.

A layer holds each projection either as a plain tensor in the model dtype or as an `Fp8Weight` (float8_e4m3fn
values and fp32 scales per `block` tile, experts stacked on a leading dim); `linear(x, weight)` runs the matching
GEMM. Which form a weight takes is decided at load (`WeightLoader.linear`), never in the forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightllm.kernels.fp8 import dequantize_weight_blocks, fp8_block_linear, quantize_weight_blocks
from lightllm.kernels.fp8.configs import warmup_token_counts


class Fp8Weight(nn.Module):
    """`weight [..., N, K]` float8_e4m3fn and `weight_scale_inv [..., ceil(N / bn), ceil(K / bk)]` fp32 with
    `weight ≈ fp8 · scale` per `block = (bn, bk)` tile (partial tiles at the edges)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]):
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale_inv", scale)
        self.block = block

    @classmethod
    def quantize(cls, w: torch.Tensor, block: tuple[int, int]) -> Fp8Weight:
        return cls(*quantize_weight_blocks(w, block), block)

    @classmethod
    def stack(cls, parts: list[Fp8Weight]) -> Fp8Weight:
        """Per-expert weights of one shape -> one `[E, N, K]` weight (the fused MoE's layout)."""
        return cls(
            torch.stack([p.weight for p in parts]), torch.stack([p.weight_scale_inv for p in parts]), parts[0].block
        )

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def __getitem__(self, expert: int) -> Fp8Weight:
        """Expert `expert` of a stacked weight (views, no copy)."""
        return Fp8Weight(self.weight[expert], self.weight_scale_inv[expert], self.block)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_weight_blocks(self.weight, self.weight_scale_inv, self.block, dtype)

    def extra_repr(self) -> str:
        return f"shape={list(self.weight.shape)}, block={list(self.block)}"


# a projection as a layer holds it
LinearWeight = torch.Tensor | Fp8Weight


def linear(x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` for either form of weight; the output has x's dtype."""
    if isinstance(weight, Fp8Weight):
        return fp8_block_linear(x, weight.weight, weight.weight_scale_inv, bias, weight.block)
    return F.linear(x, weight, bias)


def set_weight(module: nn.Module, name: str, weight: LinearWeight | None) -> None:
    """Attach a loaded projection: a tensor as a buffer, an Fp8Weight as a submodule (its buffers inside)."""
    if isinstance(weight, Fp8Weight):
        setattr(module, name, weight)
    else:
        module.register_buffer(name, weight)


def stack_experts(parts: list[LinearWeight]) -> LinearWeight:
    """One weight per expert -> the stacked `[E, N, K]` form (all FP8 or all plain, as the loader made them)."""
    if all(isinstance(p, Fp8Weight) for p in parts):
        return Fp8Weight.stack(parts)
    assert not any(isinstance(p, Fp8Weight) for p in parts), "experts of one projection mix FP8 and plain weights"
    return torch.stack(parts)


def warmup_fp8_linears(model: nn.Module, act_dtype: torch.dtype, backend: str | None = None) -> int:
    """Run each distinct FP8 projection shape of `model` once per launch configuration of the GEMM (activation
    quantization included) on zeros, so that no serving step compiles one: call at start-up on CUDA. Stacked expert
    weights are the fused MoE's (`MoE.warmup_fused`). Returns the launches run."""
    shapes: dict[tuple, Fp8Weight] = {}
    for m in model.modules():
        if isinstance(m, Fp8Weight) and m.weight.dim() == 2:
            shapes.setdefault((tuple(m.weight.shape), m.block), m)
    launches = 0
    for w in shapes.values():
        n, k = w.shape
        for tokens in warmup_token_counts(n, k, w.block, w.weight.device):
            x = torch.zeros(tokens, w.shape[1], dtype=act_dtype, device=w.weight.device)
            fp8_block_linear(x, w.weight, w.weight_scale_inv, block=w.block, backend=backend)
            launches += 1
    return launches
