"""SwiGLU's activation `silu(gate) · up` of a `[T, 2I]` gate|up projection, in one launch.

Contract (the torch path, the CPU path and the reference): `F.silu(gate) * up` with `gate, up = x.chunk(2, -1)`,
as eager torch rounds it in `x`'s dtype `dt`: `round_dt(round_dt(silu(gate)) · up)`, where `silu(g) = g / (1 +
exp(-g))` is computed in fp32 and rounded once to `dt`, and the product of the two `dt` values is computed in fp32
(exact for bf16 and fp16) and rounded once more. The kernel computes the same expression with the same roundings:
IEEE division and libdevice's `expf`, the functions torch's CUDA silu calls, so on a GPU it gives torch's numbers
bit for bit. Under Triton's interpreter (no libdevice) the exponential is numpy's, which may differ from torch's CPU
one in the last fp32 bit, and so rarely by one unit of `dt` after the rounding.

Eager torch spends two kernels on it (the silu of a strided view, then the product) and a `[T, I]` intermediate;
the kernel reads `x` once and writes the contiguous `[T, I]` output once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from lightllm.kernels.torch_exp import libdevice_exp, torch_exp

# columns of one program's tile: a program handles one row, so a decode-sized launch spreads over many programs and
# each thread runs the exact exponential and division on few elements (its latency is the launch's)
MAX_BLOCK_C = 1024


def silu_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """`x [..., 2I]` -> `[..., I]` in x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# the token count is the grid's first dimension, no argument: one compiled variant whatever the batch
@triton.jit
def silu_mul_kernel(
    x,  # [T, 2 * INTER] rows at stride_x: gate | up
    out,  # [T, INTER] contiguous
    stride_x,
    INTER: tl.constexpr,  # the model's: a compile-time row width lets loads and stores vectorize
    LIBDEVICE_EXP: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    o_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = o_c < INTER
    p_g = x + i_t * stride_x + o_c
    b_g = tl.load(p_g, mask=m, other=0.0).to(tl.float32)
    b_u = tl.load(p_g + INTER, mask=m, other=0.0)
    b_e = torch_exp(-b_g, LIBDEVICE_EXP)
    # torch's silu rounds to the activation dtype before the product
    b_s = tl.math.div_rn(b_g, 1.0 + b_e).to(b_u.dtype).to(tl.float32)
    tl.store(out + i_t * INTER + o_c, (b_s * b_u.to(tl.float32)).to(b_u.dtype), mask=m)


def silu_mul_triton(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton launch (CUDA tensors, or any under TRITON_INTERPRET=1): `x [T, 2I]` (rows at any stride, unit
    stride within a row) -> `[T, I]` contiguous in x's dtype: a new tensor, or `out` when given."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(f"x [T, 2I] with unit stride within a row expected, got {tuple(x.shape)} {x.stride()}")
    n_rows, inter = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty((n_rows, inter), dtype=x.dtype, device=x.device)
    elif out.shape != (n_rows, inter) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{n_rows}, {inter}] tensor of x's dtype")
    if n_rows and inter:
        block_c = min(triton.next_power_of_2(inter), MAX_BLOCK_C)
        silu_mul_kernel[(n_rows, triton.cdiv(inter, block_c))](
            x,
            out,
            x.stride(0),
            INTER=inter,
            LIBDEVICE_EXP=libdevice_exp(silu_mul_kernel),
            BLOCK_C=block_c,
            num_warps=4,
        )
    return out


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) · up` of `x [..., 2I]` = gate | up (module docstring): Triton for CUDA rows with unit stride within
    a row, torch otherwise."""
    if x.is_cuda and x.dim() == 2 and x.stride(1) == 1:
        return silu_mul_triton(x)
    return silu_mul_torch(x)
