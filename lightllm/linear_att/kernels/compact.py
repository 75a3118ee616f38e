"""Compact mode: verify from the canonical state without writing it, then commit the accepted prefix once.

`compact_verify_kernel` runs native's serial recurrence (same helper, same per-token rounding) from `ssm [S, HV, K,
V]`, writes the outputs and the raw window (k, v as given; activated g and beta in fp32) and never the state.
`compact_commit_kernel` covers all layers in one launch: it re-reads the state, replays the accepted tokens from
the window with the identical step and rounding, and writes the state once. Both use the "serial" tiling of
native verify, so compact == native bitwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightllm.linear_att.kernels.common import delta_rule_step, l2norm, load_token


@triton.heuristics({"USE_LOWER_BOUND": lambda args: args["lower_bound"] is not None})
@triton.jit
def compact_verify_kernel(
    q,
    k,
    v,
    graw,
    braw,
    A_log,
    dt_bias,
    ssm,
    win_k,
    win_v,
    win_g,
    win_beta,
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
    stride_wk_s,
    stride_wk_w,
    stride_wv_s,
    stride_wv_w,
    stride_wg_s,
    stride_wg_w,
    stride_wb_s,
    stride_wb_w,
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
    # single writers of the per-head window records: the first V tile writes g / beta, and the first value head
    # of a key group writes k (every program of the group reads k from its own registers, never from memory)
    first_tile = i_v == 0
    key_owner = first_tile & (i_hv % (HV // H) == 0)

    b_a_log = tl.load(A_log + i_hv).to(tl.float32)
    b_dt_bias = tl.load(dt_bias + i_hv * GK + o_g, mask=m_g, other=0).to(tl.float32)  # [BG]
    p_s = ssm + slot * stride_ssm_s + i_hv * K * V + o_k[:, None] * V + o_v[None, :]
    b_s = tl.load(p_s, mask=m_kv & (width > 0), other=0).to(tl.float32)  # [BK, BV]

    p_o = o + i_n * stride_o_n + i_hv * V + o_v
    for s in range(0, width):
        b_q, b_k, b_v, b_g, b_beta, b_kr = load_token(
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
        b_s = b_s.to(p_s.dtype.element_ty).to(tl.float32)

        p_wk = win_k + slot * stride_wk_s + s * stride_wk_w + i_h * K + o_k
        tl.store(p_wk, b_kr.to(p_wk.dtype.element_ty), mask=m_k & key_owner)
        p_wv = win_v + slot * stride_wv_s + s * stride_wv_w + i_hv * V + o_v
        tl.store(p_wv, b_v.to(p_wv.dtype.element_ty), mask=m_v)
        p_wg = win_g + slot * stride_wg_s + s * stride_wg_w + i_hv * GK + o_g
        tl.store(p_wg, b_g, mask=m_g & first_tile)
        tl.store(win_beta + slot * stride_wb_s + s * stride_wb_w + i_hv, b_beta, mask=first_tile)
    for s in range(width, WMAX):
        tl.store(p_o + s * stride_o_w, tl.zeros([BV], dtype=p_o.dtype.element_ty), mask=m_v)


def compact_verify_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    graw: torch.Tensor,
    braw: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm: torch.Tensor,
    win_k: torch.Tensor,
    win_v: torch.Tensor,
    win_g: torch.Tensor,
    win_beta: torch.Tensor,
    slots: torch.Tensor,
    widths: torch.Tensor,
    *,
    scale: float | None = None,
    lower_bound: float | None = None,
    config=None,
) -> torch.Tensor:
    """Compact verify of one layer (see `ops.compact_verify`); outputs bitwise equal to `native_verify_triton`.

    ssm `[S, HV, K, V]` read only. In place, tokens s < W of each row: win_k `[S, Wmax, H, K]`, win_v
    `[S, Wmax, HV, V]` (activation dtype, the raw k / v), win_g `[S, Wmax, HV, GK]`, win_beta `[S, Wmax, HV]`
    (fp32 activated gate / beta). Returns o `[N, Wmax, HV, V]` (dtype of v, zeros for s >= W).
    """
    from lightllm.linear_att.kernels.launch import check_verify_inputs, serial_config

    N, WMAX, H, K = q.shape
    HV, V, GK = v.shape[2], v.shape[3], graw.shape[-1]
    check_verify_inputs(q, k, v, graw, braw, A_log, dt_bias, slots, widths)
    assert ssm.dim() == 4 and ssm.shape[1:] == (HV, K, V) and ssm.stride(1) == K * V and ssm.stride(3) == 1
    _check_window(win_k, win_v, win_g, win_beta, H, HV, K, V, GK, WMAX, leading=1)
    assert win_g.dtype == win_beta.dtype == torch.float32
    cfg = config or serial_config(ssm.dtype, v.dtype, H, HV, K, V, GK, WMAX, ssm.device)
    o = torch.empty_like(v)
    if N == 0:
        return o
    BV = min(cfg.block_v, triton.next_power_of_2(V))
    compact_verify_kernel[(triton.cdiv(V, BV), N, HV)](
        q,
        k,
        v,
        graw,
        braw,
        A_log,
        dt_bias,
        ssm,
        win_k,
        win_v,
        win_g,
        win_beta,
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
        win_k.stride(0),
        win_k.stride(1),
        win_v.stride(0),
        win_v.stride(1),
        win_g.stride(0),
        win_g.stride(1),
        win_beta.stride(0),
        win_beta.stride(1),
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


def _check_window(win_k, win_v, win_g, win_beta, H, HV, K, V, GK, WMAX, leading):
    lead = tuple(win_k.shape[:leading])
    assert win_k.shape == (*lead, win_k.shape[leading], H, K) and win_k.shape[leading] >= WMAX, (
        f"win_k {tuple(win_k.shape)} does not hold a width-{WMAX} window of {H}x{K} keys"
    )
    wl = win_k.shape[: leading + 1]
    assert win_v.shape == (*wl, HV, V) and win_g.shape == (*wl, HV, GK) and win_beta.shape == (*wl, HV)
    for t in (win_k, win_v, win_g, win_beta):
        assert t.stride(-1) == 1 and (t.dim() == leading + 2 or t.stride(-2) == t.shape[-1])


@triton.jit
def compact_commit_kernel(
    ssm,
    win_k,
    win_v,
    win_g,
    win_beta,
    slots,
    widths,
    accepted,
    stride_ssm_l,
    stride_ssm_s,
    stride_wk_l,
    stride_wk_s,
    stride_wk_w,
    stride_wv_l,
    stride_wv_s,
    stride_wv_w,
    stride_wg_l,
    stride_wg_s,
    stride_wg_w,
    stride_wb_l,
    stride_wb_s,
    stride_wb_w,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    GK: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BG: tl.constexpr,
):
    i_v, i_n, i_lhv = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    i_l, i_hv = i_lhv // HV, i_lhv % HV
    i_h = i_hv // (HV // H)
    width = tl.load(widths + i_n)
    # padding rows (width 0) commit nothing; accepted is clamped to the window so a stale count cannot overrun it
    num_acc = tl.minimum(tl.load(accepted + i_n), width)
    num_acc = tl.where(width > 0, num_acc, 0)
    slot = tl.load(slots + i_n).to(tl.int64)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_g = tl.arange(0, BG)
    m_k, m_v, m_g = o_k < K, o_v < V, o_g < GK
    m_kv = m_k[:, None] & m_v[None, :]

    p_s = ssm + i_l * stride_ssm_l + slot * stride_ssm_s + i_hv * K * V + o_k[:, None] * V + o_v[None, :]
    b_s = tl.load(p_s, mask=m_kv & (num_acc > 0), other=0).to(tl.float32)  # [BK, BV]
    for s in range(0, num_acc):
        b_k = tl.load(
            win_k + i_l * stride_wk_l + slot * stride_wk_s + s * stride_wk_w + i_h * K + o_k, mask=m_k, other=0
        ).to(tl.float32)  # [BK]
        b_v = tl.load(
            win_v + i_l * stride_wv_l + slot * stride_wv_s + s * stride_wv_w + i_hv * V + o_v, mask=m_v, other=0
        ).to(tl.float32)  # [BV]
        b_g = tl.load(
            win_g + i_l * stride_wg_l + slot * stride_wg_s + s * stride_wg_w + i_hv * GK + o_g, mask=m_g, other=0
        )  # [BG]
        b_beta = tl.load(win_beta + i_l * stride_wb_l + slot * stride_wb_s + s * stride_wb_w + i_hv)
        b_s = delta_rule_step(b_s, l2norm(b_k), b_v, tl.exp(b_g), b_beta)
        b_s = b_s.to(p_s.dtype.element_ty).to(tl.float32)
    tl.store(p_s, b_s.to(p_s.dtype.element_ty), mask=m_kv & (num_acc > 0))


def compact_commit_triton(
    ssm: torch.Tensor,
    win_k: torch.Tensor,
    win_v: torch.Tensor,
    win_g: torch.Tensor,
    win_beta: torch.Tensor,
    slots: torch.Tensor,
    widths: torch.Tensor,
    accepted: torch.Tensor,
    *,
    config=None,
) -> None:
    """Commit the accepted prefix of every row into the canonical state, all layers in one launch.

    ssm `[NL, S, HV, K, V]` (in place: `ssm[:, slot]` <- state after the first `accepted[i]` window tokens,
    native's op order and per-token rounding), win_* `[NL, S, Wmax, ...]` as written by `compact_verify_triton`,
    slots / widths / accepted `[N]` int32 (accepted in [1, widths[i]]; rows with width 0 are skipped).
    """
    from lightllm.linear_att.kernels.launch import serial_config

    NL, _, HV, K, V = ssm.shape
    H, WMAX, GK = win_k.shape[3], win_k.shape[2], win_g.shape[-1]
    N = slots.shape[0]
    assert ssm.stride(2) == K * V and ssm.stride(3) == V and ssm.stride(4) == 1
    _check_window(win_k, win_v, win_g, win_beta, H, HV, K, V, GK, WMAX, leading=2)
    assert win_k.shape[0] == NL and accepted.shape == widths.shape == (N,)
    cfg = config or serial_config(ssm.dtype, win_v.dtype, H, HV, K, V, GK, WMAX, ssm.device)
    if N == 0 or NL == 0:
        return
    BV = min(cfg.block_v, triton.next_power_of_2(V))
    compact_commit_kernel[(triton.cdiv(V, BV), N, NL * HV)](
        ssm,
        win_k,
        win_v,
        win_g,
        win_beta,
        slots,
        widths,
        accepted,
        ssm.stride(0),
        ssm.stride(1),
        *win_k.stride()[:3],
        *win_v.stride()[:3],
        *win_g.stride()[:3],
        *win_beta.stride()[:3],
        H=H,
        HV=HV,
        K=K,
        V=V,
        GK=GK,
        BK=triton.next_power_of_2(K),
        BV=BV,
        BG=triton.next_power_of_2(GK),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
