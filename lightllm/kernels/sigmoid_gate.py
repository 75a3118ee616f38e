"""Gated attention's output gate: `o · sigmoid(gate)` per head, flattened to `[T, H · D]`, in one launch.

Contract (the torch path, the CPU path and the reference): `round_dt(o · round_dt(sigmoid(gate)))` in `o`'s dtype
`dt`, the sigmoid `1 / (1 + exp(-g))` computed in fp32, as the eager `o.reshape(t, -1) * torch.sigmoid(gate.reshape(t,
-1))` rounds; with torch's exponential and IEEE division (`torch_exp.py`), so on a GPU it gives torch's numbers. The
gate is a strided view (each head's half of the query projection's rows), which eager torch first copies; the
kernel reads it in place: one read of each input, one write, instead of three kernels and two intermediates.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightllm.kernels.torch_exp import libdevice_exp, torch_exp

BLOCK = 1024


def sigmoid_gate_torch(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """`o, gate [T, H, D]` (any strides) -> `[T, H · D]` in o's dtype."""
    t = o.shape[0]
    return o.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))


# the token count varies from step to step, and strides that scale with it: no variant per batch
@triton.jit(do_not_specialize=["stride_ot", "stride_oh", "stride_gt", "stride_gh"])
def sigmoid_gate_kernel(
    o,  # [T, H, D] at (stride_ot, stride_oh, 1)
    gate,  # [T, H, D] at (stride_gt, stride_gh, 1)
    out,  # [T, H * D] contiguous
    stride_ot,
    stride_oh,
    stride_gt,
    stride_gh,
    H: tl.constexpr,
    D: tl.constexpr,
    LIBDEVICE_EXP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    o_c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = o_c < H * D
    o_h, o_d = (o_c // D).to(tl.int64), o_c % D
    b_o = tl.load(o + i_t * stride_ot + o_h * stride_oh + o_d, mask=m, other=0.0)
    b_g = tl.load(gate + i_t * stride_gt + o_h * stride_gh + o_d, mask=m, other=0.0).to(tl.float32)
    b_s = tl.math.div_rn(1.0, 1.0 + torch_exp(-b_g, LIBDEVICE_EXP)).to(b_o.dtype).to(tl.float32)
    tl.store(out + i_t * (H * D) + o_c, (b_o.to(tl.float32) * b_s).to(out.dtype.element_ty), mask=m)


def sigmoid_gate_triton(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The Triton launch (CUDA tensors, or any under TRITON_INTERPRET=1)."""
    if o.dim() != 3 or gate.shape != o.shape or o.stride(-1) != 1 or gate.stride(-1) != 1:
        raise ValueError(f"o and gate [T, H, D] with unit stride within a head expected, got {tuple(o.shape)}")
    t, h, d = o.shape
    out = torch.empty((t, h * d), dtype=o.dtype, device=o.device)
    if t:
        grid = (t, triton.cdiv(h * d, BLOCK))
        sigmoid_gate_kernel[grid](
            o,
            gate,
            out,
            o.stride(0),
            o.stride(1),
            gate.stride(0),
            gate.stride(1),
            H=h,
            D=d,
            LIBDEVICE_EXP=libdevice_exp(sigmoid_gate_kernel),
            BLOCK=BLOCK,
            num_warps=4,
        )
    return out


def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """`o · sigmoid(gate)` as `[T, H · D]` (module docstring): Triton on CUDA, torch otherwise."""
    if o.is_cuda:
        return sigmoid_gate_triton(o, gate)
    return sigmoid_gate_torch(o, gate)
