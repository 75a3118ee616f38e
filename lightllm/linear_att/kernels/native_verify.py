"""Native decode/verify: one state slot per window position (`ssm [S, Wmax, HV, K, V]`).

A program owns one (V tile, row, value head): it reads the current slot `ssm_index[slot]` once, keeps the
`[K, BV]` tile in registers through the window and writes the state after token s into slot s. Every token's
state is rounded to the storage dtype before the next token reads it; the output is taken before that rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightllm.linear_att.kernels.common import delta_rule_step, load_token


@triton.heuristics({"USE_LOWER_BOUND": lambda args: args["lower_bound"] is not None})
@triton.jit
def native_verify_kernel(
    q,
    k,
    v,
    graw,
    braw,
    A_log,
    dt_bias,
    ssm,
    ssm_index,
    slots,
    widths,
    o,
    scale,
    lower_bound,
    stride_q_n,
    stride_q_w,
    stride_v_n,
    stride_v_w,
    stride_g_n,
    stride_g_w,
    stride_b_n,
    stride_b_w,
    stride_o_n,
    stride_o_w,
    stride_ssm_s,
    stride_ssm_w,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    GK: tl.constexpr,
    WMAX: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BG: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr,
):
    i_v, i_n, i_hv = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    i_h = i_hv // (HV // H)
    width = tl.load(widths + i_n)
    slot = tl.load(slots + i_n).to(tl.int64)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_g = tl.arange(0, BG)
    m_k, m_v, m_g = o_k < K, o_v < V, o_g < GK
    m_kv = m_k[:, None] & m_v[None, :]

    b_a_log = tl.load(A_log + i_hv).to(tl.float32)
    b_dt_bias = tl.load(dt_bias + i_hv * GK + o_g, mask=m_g, other=0).to(tl.float32)  # [BG]
    # padding rows (width 0) never touch the state: the load is masked off entirely
    i_src = tl.load(ssm_index + slot, mask=width > 0, other=0).to(tl.int64)
    p_s = ssm + slot * stride_ssm_s + i_hv * K * V + o_k[:, None] * V + o_v[None, :]
    b_s = tl.load(p_s + i_src * stride_ssm_w, mask=m_kv & (width > 0), other=0).to(tl.float32)  # [BK, BV]

    p_o = o + i_n * stride_o_n + i_hv * V + o_v
    for s in range(0, width):
        b_q, b_k, b_v, b_g, b_beta, _ = load_token(
            q + i_n * stride_q_n + s * stride_q_w + i_h * K,
            k + i_n * stride_q_n + s * stride_q_w + i_h * K,
            v + i_n * stride_v_n + s * stride_v_w + i_hv * V,
            graw + i_n * stride_g_n + s * stride_g_w + i_hv * GK,
            braw + i_n * stride_b_n + s * stride_b_w + i_hv,
            b_a_log,
            b_dt_bias,
            lower_bound,
            scale,
            o_k,
            m_k,
            o_v,
            m_v,
            o_g,
            m_g,
            USE_LOWER_BOUND,
        )
        b_s = delta_rule_step(b_s, b_k, b_v, tl.exp(b_g), b_beta)
        b_o = tl.sum(b_s * b_q[:, None], 0)  # [BV]
        tl.store(p_o + s * stride_o_w, b_o.to(p_o.dtype.element_ty), mask=m_v)
        # round to the storage dtype: the next token (and every later reader) sees exactly the stored state
        b_s = b_s.to(p_s.dtype.element_ty)
        tl.store(p_s + s * stride_ssm_w, b_s, mask=m_kv)
        b_s = b_s.to(tl.float32)
    for s in range(width, WMAX):
        tl.store(p_o + s * stride_o_w, tl.zeros([BV], dtype=p_o.dtype.element_ty), mask=m_v)


def native_verify_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    graw: torch.Tensor,
    braw: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm: torch.Tensor,
    ssm_index: torch.Tensor,
    slots: torch.Tensor,
    widths: torch.Tensor,
    *,
    scale: float | None = None,
    lower_bound: float | None = None,
    config=None,
) -> torch.Tensor:
    """Native verify of one layer (see `ops.native_verify`).

    q, k `[N, Wmax, H, K]`, v `[N, Wmax, HV, V]` (activation dtype), graw `[N, Wmax, HV, GK]`, braw `[N, Wmax, HV]`,
    A_log `[HV]`, dt_bias `[HV, GK]` fp32; ssm `[S, Wmax_s, HV, K, V]` (state dtype, in place: slot s <- state after
    window token s, s < W); ssm_index `[S]`, slots / widths `[N]` int32. Returns o `[N, Wmax, HV, V]` (dtype of v,
    zeros for tokens s >= W). `config`: a `KernelConfig` (block_v, num_warps, num_stages); None = tuned/default.
    """
    from lightllm.linear_att.kernels.launch import check_verify_inputs, serial_config

    N, WMAX, H, K = q.shape
    HV, V, GK = v.shape[2], v.shape[3], graw.shape[-1]
    check_verify_inputs(q, k, v, graw, braw, A_log, dt_bias, slots, widths)
    assert ssm.dim() == 5 and ssm.shape[2:] == (HV, K, V) and ssm.stride(2) == K * V and ssm.is_contiguous(), (
        f"ssm must be a contiguous [S, Wmax, {HV}, {K}, {V}] buffer, got {tuple(ssm.shape)}"
    )
    cfg = config or serial_config(ssm.dtype, v.dtype, H, HV, K, V, GK, WMAX, ssm.device)
    o = torch.empty_like(v)
    if N == 0:
        return o
    BV = min(cfg.block_v, triton.next_power_of_2(V))
    grid = (triton.cdiv(V, BV), N, HV)
    native_verify_kernel[grid](
        q,
        k,
        v,
        graw,
        braw,
        A_log,
        dt_bias,
        ssm,
        ssm_index,
        slots,
        widths,
        o,
        K**-0.5 if scale is None else scale,
        lower_bound,
        q.stride(0),
        q.stride(1),
        v.stride(0),
        v.stride(1),
        graw.stride(0),
        graw.stride(1),
        braw.stride(0),
        braw.stride(1),
        o.stride(0),
        o.stride(1),
        ssm.stride(0),
        ssm.stride(1),
        H=H,
        HV=HV,
        K=K,
        V=V,
        GK=GK,
        WMAX=WMAX,
        BK=triton.next_power_of_2(K),
        BV=BV,
        BG=triton.next_power_of_2(GK),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return o
