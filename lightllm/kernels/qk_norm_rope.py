"""The query and key heads of a gated-attention step normalised (zero-centred RMSNorm) and rotated (rotate-half RoPE
on each head's leading `rotary_dim` dims) in one launch.

Contract, per head row `x [D]` of dtype `dt` (the torch path below, which is the CPU path and the reference):
- `y = round_dt(norm(x) · (1 + w))` as `rms_norm_torch(..., ZERO_CENTERED)` computes it;
- on dims `i < rd` with half `h = rd / 2`: `rot(y)_i = -y_{i+h}` for `i < h`, `y_{i-h}` otherwise, and
  `out_i = round_dt(round_dt(y_i · cos_i) + round_dt(rot(y)_i · sin_i))`, with `cos, sin [T, rd]` already in `dt`
  (`rope_cos_sin`: angles `position · inv_freq` in fp32, scaled by YaRN's attention factor, then rounded);
- dims `>= rd` are `y` unchanged.
Each product and the sum round to `dt` as eager torch does (the launch turns fp fusion off for it), so on a GPU
the results equal eager torch's but for the norm's fp32 sum order and, in fp32, the hardware's approximate rsqrt.
Eager torch spends two norm kernels, a dozen elementwise kernels and their intermediates
per attention layer on this; the kernel reads each head once (its rotation partner again, from L1) and writes it
once. `cos, sin` depend only on the step's positions: computed once per step and shared by every layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightllm.kernels.rms_norm import ZERO_CENTERED, rms_norm_torch

# elements of one program's tile (heads x padded head dim)
TILE_ELEMENTS = 2048
# the launch's compile options: without fp fusion, because LLVM otherwise narrows each rounded product to a 16-bit
# multiply and contracts it with the sum into one 16-bit fused multiply-add (`fma.rn.bf16x2`), skipping the product's
# rounding that eager torch does
LAUNCH_OPTIONS = {"num_warps": 4, "enable_fp_fusion": False}


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`positions [T]` int, `inv_freq [rd / 2]` fp32 -> `cos, sin [T, rd]` in `dtype` (angles in fp32, each scaled
    by the attention factor, YaRN's temperature, where it is not 1)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    if attention_factor == 1.0:
        return emb.cos().to(dtype), emb.sin().to(dtype)
    return (emb.cos() * attention_factor).to(dtype), (emb.sin() * attention_factor).to(dtype)


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x [T, heads, D]`, `cos, sin [T, rd]` -> a rotated copy in x's dtype; dims past `rd` pass through."""
    rd = cos.shape[-1]
    if rd == 0:
        return x
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


def qk_norm_rope_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`q [T, Hq, D]`, `k [T, Hk, D]` (any strides), weights `[D]`, `cos, sin [T, rd]` -> normalised and rotated
    copies, shaped as the inputs."""
    q = rms_norm_torch(q, q_weight, eps, ZERO_CENTERED)
    k = rms_norm_torch(k, k_weight, eps, ZERO_CENTERED)
    return rope_rotate(q, cos, sin), rope_rotate(k, cos, sin)


@triton.jit
def _round(x, dtype: tl.constexpr):
    """fp32 values rounded to `dtype` (as an eager torch op's result is) and back."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _norm_rope_heads(
    x,
    out,
    weight,
    cos,
    sin,
    i_t,
    h0,
    H,
    stride_t,
    stride_h,
    stride_c,
    eps,
    D: tl.constexpr,
    RD: tl.constexpr,
    BH: tl.constexpr,
    BD: tl.constexpr,
):
    """Heads `h0 .. h0 + BH` (masked to H) of token `i_t`: the row, its rotation partners, one store."""
    dt = out.dtype.element_ty
    HALF: tl.constexpr = RD // 2
    o_h = h0 + tl.arange(0, BH)
    o_d = tl.arange(0, BD)
    m_h, m_d = o_h < H, o_d < D
    m = m_h[:, None] & m_d[None, :]
    p_row = x + i_t * stride_t + o_h[:, None].to(tl.int64) * stride_h
    b_x = tl.load(p_row + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    b_inv = tl.rsqrt(tl.sum(b_x * b_x, axis=1) / D + eps)
    b_w = tl.load(weight + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_y = _round(b_x * b_inv[:, None] * (1.0 + b_w)[None, :], dt)
    if RD > 0:
        # the partner of dim i in the rotation, normalised with the row's own factor
        m_r = o_d < RD
        o_p = tl.where(o_d < HALF, o_d + HALF, o_d - HALF)
        m_p = m_h[:, None] & m_r[None, :]
        b_xp = tl.load(p_row + o_p[None, :], mask=m_p, other=0.0).to(tl.float32)
        b_wp = tl.load(weight + o_p, mask=m_r, other=0.0).to(tl.float32)
        b_yp = _round(b_xp * b_inv[:, None] * (1.0 + b_wp)[None, :], dt)
        b_yp = tl.where((o_d < HALF)[None, :], -b_yp, b_yp)
        b_c = tl.load(cos + i_t * stride_c + o_d, mask=m_r, other=0.0).to(tl.float32)
        b_s = tl.load(sin + i_t * stride_c + o_d, mask=m_r, other=0.0).to(tl.float32)
        b_rot = _round(b_y * b_c[None, :], dt) + _round(b_yp * b_s[None, :], dt)
        b_y = tl.where(m_r[None, :], b_rot, b_y)
    p_out = out + (i_t * H + o_h[:, None].to(tl.int64)) * D + o_d[None, :]
    tl.store(p_out, b_y.to(dt), mask=m)


# the token count varies from step to step: specialising on it (or on strides that scale with it) would compile
# variants mid-serving
@triton.jit(do_not_specialize=["stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_c", "eps"])
def qk_norm_rope_kernel(
    q,  # [T, HQ, D] at (stride_qt, stride_qh, 1)
    k,  # [T, HK, D] at (stride_kt, stride_kh, 1)
    q_out,  # [T, HQ, D] contiguous
    k_out,  # [T, HK, D] contiguous
    q_weight,  # [D]
    k_weight,  # [D]
    cos,  # [T, RD] at (stride_c, 1)
    sin,  # [T, RD] at (stride_c, 1)
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_c,
    eps,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    D: tl.constexpr,
    RD: tl.constexpr,
    BH: tl.constexpr,
    BD: tl.constexpr,
):
    # one token per program along axis 0; axis 1: the query head tiles, then the key head tiles
    i_t = tl.program_id(0).to(tl.int64)
    i_p = tl.program_id(1)
    NQ: tl.constexpr = (HQ + BH - 1) // BH
    if i_p < NQ:
        _norm_rope_heads(
            q, q_out, q_weight, cos, sin, i_t, i_p * BH, HQ, stride_qt, stride_qh, stride_c, eps, D, RD, BH, BD
        )
    else:
        _norm_rope_heads(
            k, k_out, k_weight, cos, sin, i_t, (i_p - NQ) * BH, HK, stride_kt, stride_kh, stride_c, eps, D, RD, BH, BD
        )


def qk_norm_rope_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton launch (CUDA tensors, or any under TRITON_INTERPRET=1): contiguous `q, k` outputs."""
    (t, hq, d), hk = q.shape, k.shape[1]
    rd = cos.shape[-1]
    if k.shape != (t, hk, d) or q_weight.shape != (d,) or k_weight.shape != (d,) or q.dtype != k.dtype:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} of one dtype and head dim, weights [{d}] expected")
    if cos.shape != (t, rd) or sin.shape != cos.shape or rd % 2 or rd > d:
        raise ValueError(f"cos and sin [{t}, rd] with an even rd <= {d} expected, got {tuple(cos.shape)}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError("q, k, cos and sin need unit stride within a head (cos and sin alike)")
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, hk, d), dtype=k.dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    block_d = triton.next_power_of_2(d)
    block_h = max(1, min(triton.next_power_of_2(max(hq, hk)), TILE_ELEMENTS // block_d))
    grid = (t, triton.cdiv(hq, block_h) + triton.cdiv(hk, block_h))
    qk_norm_rope_kernel[grid](
        q,
        k,
        q_out,
        k_out,
        q_weight,
        k_weight,
        cos,
        sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        eps,
        HQ=hq,
        HK=hk,
        D=d,
        RD=rd,
        BH=block_h,
        BD=block_d,
        **LAUNCH_OPTIONS,
    )
    return q_out, k_out


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised and rotated `q, k` (module docstring): Triton on CUDA, torch otherwise."""
    if q.is_cuda:
        return qk_norm_rope_triton(q, k, q_weight, k_weight, eps, cos, sin)
    return qk_norm_rope_torch(q, k, q_weight, k_weight, eps, cos, sin)
