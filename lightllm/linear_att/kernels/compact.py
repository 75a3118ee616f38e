"""Compact mode ("lazy commit"): one read and one write of the state per step.

Per slot the state keeps `ssm [S, HV, K, V]`, two raw-window buffers `win_* [S, 2, Wmax, ...]`, `pending [S]` (the
accepted tokens of the last verified window, not yet in `ssm`) and `parity [S]` (the buffer holding that window).
`accept` only sets `pending` and flips `parity`; no kernel runs.

`compact_verify_kernel` (one layer) reads the state tile, merges the `pending` tokens of buffer `parity` into it
with native's step and per-token rounding (`merge_window_tokens`), writes the merged tile once (only when
`pending > 0`), then runs native's serial recurrence from the merged tile in registers: it writes the outputs and the
new raw window (k, v as given; activated g and beta in fp32) into buffer `1 - parity`. Programs of one launch share
records (V tiles and the value heads of a key group read the same k / g / beta), so a launch reads only buffer
`parity` and writes only buffer `1 - parity`: no program overwrites a record another one still reads.

`compact_commit_kernel` (all layers, one launch) is the standalone merge: `CompactState.settle`, checkpoint export
and prefill use it to bring `ssm` up to date. Both kernels use the "serial" tiling of native verify and the same
merge helper, so compact == native bitwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightllm.linear_att.kernels.common import delta_rule_step, l2norm, load_token


@triton.jit
def merge_window_tokens(
    b_s,
    p_s,
    p_wk,
    p_wv,
    p_wg,
    p_wb,
    stride_wk_w,
    stride_wv_w,
    stride_wg_w,
    stride_wb_w,
    num_tokens,
    o_k,
    m_k,
    o_v,
    m_v,
    o_g,
    m_g,
):
    """Replay the first `num_tokens` tokens of a stored window onto the fp32 tile `b_s [BK, BV]` and write it.

    Same step and per-token rounding (to the element type of `p_s`) as native verify. `p_wk / p_wv / p_wg / p_wb`
    point at token 0 of one window buffer, at the program's key head / value head. The tile at `p_s` is written
    (once, already rounded) only when `num_tokens > 0`. Returns the merged fp32 tile.
    """
    for s in range(0, num_tokens):
        b_k = tl.load(p_wk + s * stride_wk_w + o_k, mask=m_k, other=0).to(tl.float32)  # [BK]
        b_v = tl.load(p_wv + s * stride_wv_w + o_v, mask=m_v, other=0).to(tl.float32)  # [BV]
        b_g = tl.load(p_wg + s * stride_wg_w + o_g, mask=m_g, other=0)  # [BG]
        b_beta = tl.load(p_wb + s * stride_wb_w)
        b_s = delta_rule_step(b_s, l2norm(b_k), b_v, tl.exp(b_g), b_beta)
        b_s = b_s.to(p_s.dtype.element_ty).to(tl.float32)
    tl.store(p_s, b_s.to(p_s.dtype.element_ty), mask=m_k[:, None] & m_v[None, :] & (num_tokens > 0))
    return b_s


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
    pending,
    parity,
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
    stride_wk_b,
    stride_wk_w,
    stride_wv_s,
    stride_wv_b,
    stride_wv_w,
    stride_wg_s,
    stride_wg_b,
    stride_wg_w,
    stride_wb_s,
    stride_wb_b,
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
    # padding rows touch no state, so they merge nothing (their pending tokens wait for the next real verify); the
    # count is clamped to the buffer so a stale value cannot overrun it
    num_pending = tl.where(width > 0, tl.minimum(tl.load(pending + slot), WMAX), 0)
    buf_read = tl.load(parity + slot).to(tl.int64)
    buf_write = 1 - buf_read

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_g = tl.arange(0, BG)
    m_k, m_v, m_g = o_k < K, o_v < V, o_g < GK
    m_kv = m_k[:, None] & m_v[None, :]
    # single writers of the per-head window records: the first V tile writes g / beta, and the first value head
    # of a key group writes k (every program of the group reads the new k from its own registers)
    first_tile = i_v == 0
    key_owner = first_tile & (i_hv % (HV // H) == 0)

    b_a_log = tl.load(A_log + i_hv).to(tl.float32)
    b_dt_bias = tl.load(dt_bias + i_hv * GK + o_g, mask=m_g, other=0).to(tl.float32)  # [BG]
    p_s = ssm + slot * stride_ssm_s + i_hv * K * V + o_k[:, None] * V + o_v[None, :]
    b_s = tl.load(p_s, mask=m_kv & (width > 0), other=0).to(tl.float32)  # [BK, BV]
    b_s = merge_window_tokens(
        b_s,
        p_s,
        win_k + slot * stride_wk_s + buf_read * stride_wk_b + i_h * K,
        win_v + slot * stride_wv_s + buf_read * stride_wv_b + i_hv * V,
        win_g + slot * stride_wg_s + buf_read * stride_wg_b + i_hv * GK,
        win_beta + slot * stride_wb_s + buf_read * stride_wb_b + i_hv,
        stride_wk_w,
        stride_wv_w,
        stride_wg_w,
        stride_wb_w,
        num_pending,
        o_k,
        m_k,
        o_v,
        m_v,
        o_g,
        m_g,
    )

    p_o = o + i_n * stride_o_n + i_hv * V + o_v
    p_wk = win_k + slot * stride_wk_s + buf_write * stride_wk_b + i_h * K + o_k
    p_wv = win_v + slot * stride_wv_s + buf_write * stride_wv_b + i_hv * V + o_v
    p_wg = win_g + slot * stride_wg_s + buf_write * stride_wg_b + i_hv * GK + o_g
    p_wb = win_beta + slot * stride_wb_s + buf_write * stride_wb_b + i_hv
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

        tl.store(p_wk + s * stride_wk_w, b_kr.to(p_wk.dtype.element_ty), mask=m_k & key_owner)
        tl.store(p_wv + s * stride_wv_w, b_v.to(p_wv.dtype.element_ty), mask=m_v)
        tl.store(p_wg + s * stride_wg_w, b_g, mask=m_g & first_tile)
        tl.store(p_wb + s * stride_wb_w, b_beta, mask=first_tile)
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
    pending: torch.Tensor,
    parity: torch.Tensor,
    slots: torch.Tensor,
    widths: torch.Tensor,
    *,
    scale: float | None = None,
    lower_bound: float | None = None,
    config=None,
) -> torch.Tensor:
    """Compact verify of one layer (see `ops.compact_verify`); outputs bitwise equal to `native_verify_triton`.

    In place for rows with W > 0: `ssm [S, HV, K, V]` of the slot gets its `pending` tokens from window buffer
    `parity` merged (written only when pending > 0); the row's W raw tokens go to buffer `1 - parity` of win_k
    `[S, 2, Wmax, H, K]`, win_v `[S, 2, Wmax, HV, V]` (activation dtype), win_g `[S, 2, Wmax, HV, GK]`, win_beta
    `[S, 2, Wmax, HV]` (fp32). pending / parity `[S]` int32 are read only. Returns o `[N, Wmax, HV, V]`.
    """
    from lightllm.linear_att.kernels.launch import check_verify_inputs, serial_config

    N, WMAX, H, K = q.shape
    HV, V, GK = v.shape[2], v.shape[3], graw.shape[-1]
    check_verify_inputs(q, k, v, graw, braw, A_log, dt_bias, slots, widths)
    assert ssm.dim() == 4 and ssm.shape[1:] == (HV, K, V) and ssm.stride(1) == K * V and ssm.stride(3) == 1
    _check_window(win_k, win_v, win_g, win_beta, H, HV, K, V, GK, WMAX, leading=1)
    _check_slot_scalars(pending, parity, ssm.shape[0])
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
        pending,
        parity,
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
        *win_k.stride()[:3],
        *win_v.stride()[:3],
        *win_g.stride()[:3],
        *win_beta.stride()[:3],
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
    """win_* `[*lead, S, 2, W, ...]` with `leading` dims up to and including the slot dim, W >= WMAX."""
    lead = tuple(win_k.shape[:leading])
    assert win_k.shape == (*lead, 2, win_k.shape[leading + 1], H, K) and win_k.shape[leading + 1] >= WMAX, (
        f"win_k {tuple(win_k.shape)} does not hold two width-{WMAX} windows of {H}x{K} keys"
    )
    wl = win_k.shape[: leading + 2]
    assert win_v.shape == (*wl, HV, V) and win_g.shape == (*wl, HV, GK) and win_beta.shape == (*wl, HV)
    assert win_g.dtype == win_beta.dtype == torch.float32
    for t in (win_k, win_v, win_g, win_beta):
        assert t.stride(-1) == 1 and (t.dim() == leading + 3 or t.stride(-2) == t.shape[-1])


def _check_slot_scalars(pending, parity, num_slots):
    for name, t in (("pending", pending), ("parity", parity)):
        assert t.shape == (num_slots,) and t.dtype == torch.int32, f"{name} must be int32 [{num_slots}]"


@triton.jit
def compact_commit_kernel(
    ssm,
    win_k,
    win_v,
    win_g,
    win_beta,
    pending,
    parity,
    slots,
    stride_ssm_l,
    stride_ssm_s,
    stride_wk_l,
    stride_wk_s,
    stride_wk_b,
    stride_wk_w,
    stride_wv_l,
    stride_wv_s,
    stride_wv_b,
    stride_wv_w,
    stride_wg_l,
    stride_wg_s,
    stride_wg_b,
    stride_wg_w,
    stride_wb_l,
    stride_wb_s,
    stride_wb_b,
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
):
    i_v, i_n, i_lhv = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    i_l, i_hv = i_lhv // HV, i_lhv % HV
    i_h = i_hv // (HV // H)
    slot = tl.load(slots + i_n).to(tl.int64)
    num_pending = tl.minimum(tl.load(pending + slot), WMAX)
    buf = tl.load(parity + slot).to(tl.int64)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_g = tl.arange(0, BG)
    m_k, m_v, m_g = o_k < K, o_v < V, o_g < GK
    m_kv = m_k[:, None] & m_v[None, :]

    p_s = ssm + i_l * stride_ssm_l + slot * stride_ssm_s + i_hv * K * V + o_k[:, None] * V + o_v[None, :]
    b_s = tl.load(p_s, mask=m_kv & (num_pending > 0), other=0).to(tl.float32)  # [BK, BV]
    merge_window_tokens(
        b_s,
        p_s,
        win_k + i_l * stride_wk_l + slot * stride_wk_s + buf * stride_wk_b + i_h * K,
        win_v + i_l * stride_wv_l + slot * stride_wv_s + buf * stride_wv_b + i_hv * V,
        win_g + i_l * stride_wg_l + slot * stride_wg_s + buf * stride_wg_b + i_hv * GK,
        win_beta + i_l * stride_wb_l + slot * stride_wb_s + buf * stride_wb_b + i_hv,
        stride_wk_w,
        stride_wv_w,
        stride_wg_w,
        stride_wb_w,
        num_pending,
        o_k,
        m_k,
        o_v,
        m_v,
        o_g,
        m_g,
    )


def compact_commit_triton(
    ssm: torch.Tensor,
    win_k: torch.Tensor,
    win_v: torch.Tensor,
    win_g: torch.Tensor,
    win_beta: torch.Tensor,
    pending: torch.Tensor,
    parity: torch.Tensor,
    slots: torch.Tensor,
    *,
    config=None,
) -> None:
    """Merge the pending tokens of every row's slot into the state, all layers in one launch (`ops.compact_commit`).

    ssm `[NL, S, HV, K, V]` (in place: `ssm[:, slot]` <- the state after the first `pending[slot]` tokens of window
    buffer `parity[slot]`, native's op order and per-token rounding; untouched when pending is 0), win_*
    `[NL, S, 2, Wmax, ...]` as written by `compact_verify_triton`, pending / parity `[S]` and slots `[N]` int32.
    `pending` is left as it is (the caller clears it).
    """
    from lightllm.linear_att.kernels.launch import serial_config

    NL, S, HV, K, V = ssm.shape
    H, WMAX, GK = win_k.shape[4], win_k.shape[3], win_g.shape[-1]
    N = slots.shape[0]
    assert ssm.stride(2) == K * V and ssm.stride(3) == V and ssm.stride(4) == 1
    _check_window(win_k, win_v, win_g, win_beta, H, HV, K, V, GK, WMAX, leading=2)
    _check_slot_scalars(pending, parity, S)
    assert win_k.shape[:2] == (NL, S) and slots.shape == (N,) and slots.dtype == torch.int32
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
        pending,
        parity,
        slots,
        ssm.stride(0),
        ssm.stride(1),
        *win_k.stride()[:4],
        *win_v.stride()[:4],
        *win_g.stride()[:4],
        *win_beta.stride()[:4],
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
