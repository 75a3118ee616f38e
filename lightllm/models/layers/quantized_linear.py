"""Linear weights that may be block-FP8: the one `linear` every projection of the model calls.

A layer holds each projection either as a plain tensor in the model dtype or as an `Fp8Weight` (float8_e4m3fn
values and fp32 scales per `block` tile, experts stacked on a leading dim); `linear(x, weight)` runs the matching
GEMM. Which form a weight takes is decided at load (`WeightLoader.linear`), never in the forward.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

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


def stack_experts(parts: Iterable[LinearWeight], count: int) -> LinearWeight:
    """`count` weights, one per expert, as the loader makes them (all FP8 or all plain) -> the stacked `[E, N, K]`
    form. Each part is copied into the stack as it comes and then dropped: the device never holds every expert
    twice, and a part's load-time temporaries are freed before the next part's, of the same sizes, reuse them (live
    parts interleaved with freed temporaries would leave the allocator segments it cannot return)."""
    parts = iter(parts)
    first = next(parts)
    fp8 = isinstance(first, Fp8Weight)
    tensors = (first.weight, first.weight_scale_inv) if fp8 else (first,)
    stacked = [t.new_empty((count, *t.shape)) for t in tensors]
    for e, part in enumerate(itertools.chain([first], parts)):
        if isinstance(part, Fp8Weight) != fp8:
            raise ValueError("experts of one projection mix FP8 and plain weights")
        if e == count:
            raise ValueError(f"more than {count} expert weights")
        for out, t in zip(stacked, (part.weight, part.weight_scale_inv) if fp8 else (part,)):
            out[e].copy_(t)
        del part
    if e + 1 != count:
        raise ValueError(f"{e + 1} expert weights, expected {count}")
    return Fp8Weight(*stacked, first.block) if fp8 else stacked[0]


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
