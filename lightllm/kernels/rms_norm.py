"""RMSNorm over the last dimension in one pass per row, in the conventions the supported checkpoints use, with the
residual add before it and the output gate after it fused in.

`y = norm(x) · scale`, `norm(x) = x / sqrt(mean(x²) + eps)` computed in fp32, where the weight enters as:
- `ZERO_CENTERED` (Qwen): `norm(x) · (1 + w)` in fp32, then cast to the activation dtype;
- `CAST_THEN_WEIGHT` (Kimi's RMSNorm, the GDN output norm): `norm(x)` cast to the activation dtype first, then
  times `w` in that dtype;
- `FP32_WEIGHT` (the KDA output norm): `norm(x) · w` in fp32.
A gate (`silu` or `sigmoid` of a second input, in fp32) multiplies the result before the final cast; a residual
`r` makes the input `x + r` rounded to the activation dtype, which is also written out (the next residual).

The torch functions are the contract, the CPU path and the reference; `rms_norm_rows` dispatches: Triton for CUDA
tensors (rows of any stride, unit stride within a row), torch otherwise. Eager torch spends five to seven
kernels and fp32 intermediates of the whole activation on one norm; this is one read and one write.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

ZERO_CENTERED, CAST_THEN_WEIGHT, FP32_WEIGHT = 0, 1, 2
NO_GATE, SILU_GATE, SIGMOID_GATE = 0, 1, 2
# elements of one program's tile: rows of a short dimension share a program
TILE_ELEMENTS = 4096


def _normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_mode: int,
    gate: torch.Tensor | None = None,
    gate_kind: int = NO_GATE,
) -> torch.Tensor:
    """`x [..., D]`, `weight [D]` (and `gate` shaped as `x`) -> same shape and dtype as `x`."""
    if weight_mode == ZERO_CENTERED:
        y = _normalize(x, eps) * (1.0 + weight.float())
    elif weight_mode == CAST_THEN_WEIGHT:
        y = weight * _normalize(x, eps).to(x.dtype)
    else:
        y = weight.float() * _normalize(x, eps)
    if gate_kind == SILU_GATE:
        y = y.float() * F.silu(gate.float())
    elif gate_kind == SIGMOID_GATE:
        y = y.float() * torch.sigmoid(gate.float())
    return y.to(x.dtype)


@triton.jit(do_not_specialize=["n_rows", "dim", "stride_x", "stride_g", "stride_r", "stride_o", "stride_ro", "eps"])
def rms_norm_kernel(
    x,  # [n_rows, dim] rows at stride_x
    gate,  # [n_rows, dim] (GATE_KIND != 0)
    residual,  # [n_rows, dim] (HAS_RESIDUAL)
    weight,  # [dim]
    out,  # [n_rows, dim]
    residual_out,  # [n_rows, dim] (HAS_RESIDUAL): x + residual in x's dtype
    n_rows,
    dim,
    stride_x,
    stride_g,
    stride_r,
    stride_o,
    stride_ro,
    eps,
    WEIGHT_MODE: tl.constexpr,
    GATE_KIND: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    o_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    o_d = tl.arange(0, BLOCK_D)
    m_r, m_d = o_r < n_rows, o_d < dim
    m = m_r[:, None] & m_d[None, :]
    b_x = tl.load(x + o_r[:, None] * stride_x + o_d[None, :], mask=m, other=0.0)
    if HAS_RESIDUAL:
        b_r = tl.load(residual + o_r[:, None] * stride_r + o_d[None, :], mask=m, other=0.0)
        b_x = (b_x.to(tl.float32) + b_r.to(tl.float32)).to(b_x.dtype)
        tl.store(residual_out + o_r[:, None] * stride_ro + o_d[None, :], b_x, mask=m)
    b_xf = b_x.to(tl.float32)
    b_inv = tl.rsqrt(tl.sum(b_xf * b_xf, axis=1) / dim + eps)
    b_n = b_xf * b_inv[:, None]
    b_w = tl.load(weight + o_d, mask=m_d, other=0.0)
    if WEIGHT_MODE == 0:
        b_y = b_n * (1.0 + b_w.to(tl.float32))[None, :]
    elif WEIGHT_MODE == 1:
        b_y = (b_n.to(b_x.dtype).to(tl.float32) * b_w.to(tl.float32)[None, :]).to(b_x.dtype).to(tl.float32)
    else:
        b_y = b_n * b_w.to(tl.float32)[None, :]
    if GATE_KIND != 0:
        b_g = tl.load(gate + o_r[:, None] * stride_g + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        if GATE_KIND == 1:
            b_y = b_y * (b_g / (1.0 + tl.exp(-b_g)))
        else:
            b_y = b_y * (1.0 / (1.0 + tl.exp(-b_g)))
    tl.store(out + o_r[:, None] * stride_o + o_d[None, :], b_y.to(out.dtype.element_ty), mask=m)


def _rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """`t [..., dim]` as `[rows, dim]` with unit stride within a row (a view where the layout allows)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, dim)
    except RuntimeError:
        return t.reshape(-1, dim)


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_mode: int,
    gate: torch.Tensor | None = None,
    gate_kind: int = NO_GATE,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The Triton launch (CUDA tensors, or any under TRITON_INTERPRET=1): `(y, x + residual)` (the second None
    without a residual), contiguous tensors shaped as `x`: new ones, or `out` / `residual_out` when given."""
    dim = x.shape[-1]
    if weight.shape != (dim,) or (gate is not None and gate.shape != x.shape):
        raise ValueError(f"weight [{dim}] and a gate shaped as x {tuple(x.shape)} expected")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError("the residual must have x's shape and dtype")
    if weight_mode == CAST_THEN_WEIGHT and weight.dtype != x.dtype:
        raise ValueError("a weight applied after the cast must have x's dtype")
    x2 = _rows(x, dim)
    g2 = _rows(gate, dim) if gate is not None else x2
    r2 = _rows(residual, dim) if residual is not None else x2
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    res_out = (torch.empty_like(out) if residual_out is None else residual_out) if residual is not None else out
    if not (out.shape == res_out.shape == x.shape and out.is_contiguous() and res_out.is_contiguous()):
        raise ValueError("out and residual_out must be contiguous and shaped as x")
    o2, ro2 = out.view(-1, dim), res_out.view(-1, dim)
    n_rows = x2.shape[0]
    if n_rows and dim:
        block_d = triton.next_power_of_2(dim)
        block_r = max(1, min(16, TILE_ELEMENTS // block_d))
        rms_norm_kernel[(triton.cdiv(n_rows, block_r),)](
            x2,
            g2,
            r2,
            weight,
            o2,
            ro2,
            n_rows,
            dim,
            x2.stride(0),
            g2.stride(0),
            r2.stride(0),
            o2.stride(0),
            ro2.stride(0),
            eps,
            WEIGHT_MODE=weight_mode,
            GATE_KIND=gate_kind if gate is not None else NO_GATE,
            HAS_RESIDUAL=residual is not None,
            BLOCK_R=block_r,
            BLOCK_D=block_d,
            num_warps=8 if block_r * block_d >= 2048 else 4,
        )
    return out, (res_out if residual is not None else None)


def rms_norm_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_mode: int,
    gate: torch.Tensor | None = None,
    gate_kind: int = NO_GATE,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(norm of (x + residual), x + residual)` in the given convention (module docstring); Triton on CUDA, torch
    otherwise. The sum is None without a residual."""
    if x.is_cuda and not (weight_mode == CAST_THEN_WEIGHT and weight.dtype != x.dtype):
        return rms_norm_triton(x, weight, eps, weight_mode, gate, gate_kind, residual)
    if residual is not None:
        x = x + residual
    return rms_norm_torch(x, weight, eps, weight_mode, gate, gate_kind), (x if residual is not None else None)
