"""Column blocks of a row-major `[T, N]` tensor copied into separate contiguous tensors in one launch.

Contract (the torch path, the CPU path and the reference): `[p.contiguous() for p in x.split(sizes, dim=-1)]`,
values bit for bit (a copy). A fused projection's output (GDN's `q|k|v | z | b | a`) is split into the parts the
next kernels read contiguously; eager torch spends one copy kernel per part, the kernel one launch for all of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

# elements of one program's tile; narrow parts put several rows in one program
TILE_ELEMENTS = 2048
MAX_BLOCK_C = 1024


def split_columns_torch(x: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """`x [..., N]`, `sizes` summing to N -> `[..., sizes[k]]` contiguous tensors (a part that already is
    contiguous comes back as the view itself)."""
    return [p.contiguous() for p in x.split(list(sizes), dim=-1)]


# the token count varies from step to step: no variant per batch size; the sizes are the model's
@triton.jit(do_not_specialize=["n_rows"])
def split_columns_kernel(
    x,  # [n_rows, sum(SIZES)] rows at stride_x
    outs,  # tuple: [n_rows, SIZES[k]] contiguous
    n_rows,
    stride_x,
    SIZES: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # axis 1 enumerates the column blocks of part 0, then those of part 1, ...: a program copies one part's columns
    o_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    m_r = o_r < n_rows
    i_c = tl.program_id(1)
    first_block = 0
    start = 0
    for k in tl.static_range(len(SIZES)):
        num_blocks = tl.cdiv(SIZES[k], BLOCK_C)
        if (i_c >= first_block) & (i_c < first_block + num_blocks):
            o_c = (i_c - first_block) * BLOCK_C + tl.arange(0, BLOCK_C)
            m = m_r[:, None] & (o_c < SIZES[k])[None, :]
            b = tl.load(x + o_r[:, None] * stride_x + (start + o_c)[None, :], mask=m)
            tl.store(outs[k] + o_r[:, None] * SIZES[k] + o_c[None, :], b, mask=m)
        first_block += num_blocks
        start += SIZES[k]


def split_columns_triton(
    x: torch.Tensor, sizes: Sequence[int], outs: Sequence[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """The Triton launch (CUDA tensors, or any under TRITON_INTERPRET=1): `x [T, N]` (rows at any stride, unit
    stride within a row), `sizes` summing to N -> new contiguous `[T, sizes[k]]` tensors, or `outs` when given."""
    sizes = tuple(int(s) for s in sizes)
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x [T, N] with unit stride within a row expected, got {tuple(x.shape)} {x.stride()}")
    if not sizes or min(sizes) < 0 or sum(sizes) != x.shape[1]:
        raise ValueError(f"sizes {sizes} must be non-negative and sum to x's {x.shape[1]} columns")
    n_rows = x.shape[0]
    if outs is None:
        outs = [torch.empty((n_rows, s), dtype=x.dtype, device=x.device) for s in sizes]
    elif len(outs) != len(sizes) or any(
        o.shape != (n_rows, s) or o.dtype != x.dtype or not o.is_contiguous() for o, s in zip(outs, sizes)
    ):
        raise ValueError(f"outs must be contiguous [{n_rows}, size] tensors of x's dtype for sizes {sizes}")
    if n_rows and sum(sizes):
        block_c = min(triton.next_power_of_2(max(sizes)), MAX_BLOCK_C)
        block_r = max(1, min(16, TILE_ELEMENTS // block_c))
        grid = (triton.cdiv(n_rows, block_r), sum(triton.cdiv(s, block_c) for s in sizes))
        split_columns_kernel[grid](
            x, tuple(outs), n_rows, x.stride(0), SIZES=sizes, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4
        )
    return list(outs)


def split_columns(x: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """`x`'s column blocks of `sizes` as contiguous tensors (module docstring): Triton for CUDA rows with unit stride
    within a row, torch otherwise. One row's parts are contiguous views already, which torch returns without a copy."""
    if x.is_cuda and x.dim() == 2 and x.stride(1) == 1 and x.shape[0] > 1:
        return split_columns_triton(x, sizes)
    return split_columns_torch(x, sizes)
