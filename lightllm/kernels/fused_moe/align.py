"""Token-expert pairs sorted by expert and padded to whole `block_m` blocks, on the device, in fixed shapes.

Pair `p = t * top_k + j` is token t's j-th choice. The pairs are laid out expert after expert (stable: in pair
order within an expert), each expert's run padded with the sentinel `num_pairs` up to a multiple of `block_m`, so
every block of `block_m` rows belongs to one expert. At most `min(E, num_pairs)` experts are non-empty, so the
padded length never exceeds `num_pairs + min(E, num_pairs) * (block_m - 1)`: every output is sized by that bound
(host shapes only, no `.item()`), blocks past the real end name expert E and are skipped by the GEMMs. Integer
scatter-adds and a stable sort make the layout identical on every run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton


@dataclass(frozen=True)
class ExpertBlocks:
    # [num_blocks * block_m] int32: the pair id of each padded row, `num_pairs` on padding rows
    sorted_pairs: torch.Tensor
    # [num_blocks] int32: the expert of each block, `num_experts` past the last real block
    block_expert: torch.Tensor
    block_m: int
    num_pairs: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert.shape[0]


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks of the worst-case padded layout (a host bound used to size grids and buffers)."""
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """`ids [T, top_k]` (int32/int64 expert ids in 0..E-1) -> the padded per-expert layout of its pairs."""
    flat = ids.reshape(-1).long()
    num_pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    pad_start = pad_end - padded
    count_start = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)
    sorted_expert = flat[order]
    rank = torch.arange(num_pairs, device=device) - count_start[sorted_expert]
    num_blocks = max_blocks(num_pairs, num_experts, block_m)
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[pad_start[sorted_expert] + rank] = order.to(torch.int32)
    block_start = torch.arange(num_blocks, device=device) * block_m
    # the first expert whose padded run ends after the block's start owns it; empty experts own nothing
    block_expert = torch.searchsorted(pad_end, block_start, right=True).to(torch.int32)
    return ExpertBlocks(sorted_pairs, block_expert, block_m, num_pairs)
