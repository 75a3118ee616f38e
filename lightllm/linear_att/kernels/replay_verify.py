"""Replay decode/verify: read the canonical state S0 and the committed history, never write S0 except on a fold.

A program owns one (V tile, row, value head). With `h = cursor[slot]` committed records in buffer `p = parity[slot]`
(k_hat_j per key head, u_j per value head, cumulative gate G_j since S0, all fp32), token s of the window needs

    S_{h+s}^T (e^{g_s} x) = S0^T (e^{G_s} x) + sum_{j <= h+s} u_j ((e^{G_s - G_j} k_hat_j) . x),  x in {k_hat_s, q_hat_s}

(G_s cumulative through token s itself). Every weight is a forward decay e^{<= 0}; each record costs O(K + BV).
The committed part uses K~_j = e^{G_h - G_j} k_hat_j (built once) and e^{G_s - G_h} x; the in-window records stay
in registers (another program may still be writing them to memory). Then u_s = beta_s (v_s - a_k),
o_s = a_q + sum over the window including s.

Fold, decided per row on the device: if `h + W > L`, S_h = e^{G_h} S0 + K~^T U (one dot, `fold_state`) is
written to `ssm` (rounded once) and the window runs from it with an empty history, appending its records at
0..W-1 of buffer `1 - p`; otherwise records go to h..h+W-1 of buffer `p`. Readers only ever read buffer `p` at
positions < h, so no program overwrites a record another program of the same key group or V range still reads.
The fold's dot runs on tensor cores in tf32x3 (fp32-grade for the state): an FMA ("ieee") dot of that shape sets
the whole kernel's register count to 255 with spills, and occupancy is what this memory-bound kernel lives on.

Plain decode (W = 1) has its own straight-line path: no window loop, no one-hot row extraction.

Projection: "inline" contracts S0 per token in registers (no tensor cores); "precompute" contracts S0 with all
window keys and queries up front as `tl.dot`s (the key side feeds u, hence the state: `STATE_PRECISION`; the
query side only feeds outputs: `OUT_PRECISION`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightllm.linear_att.kernels.common import (
    fold_state,
    gate_activation,
    history_weights,
    l2norm_rows,
    load_token,
    sigmoid,
)


@triton.jit
def _row(b_x, m_s):
    """Row `s` (given as the one-hot mask `m_s [BW]`) of a `[BW, X]` block."""
    return tl.sum(tl.where(m_s[:, None], b_x, 0.0), 0)


@triton.jit
def _history_project(b_s, b_hkw, b_hu, b_x, b_dx, b_rx):
    """S_h^T (e^{g} x) for one contraction vector: S0^T (e^{G} x) + sum_j u_j (K~_j . e^{G - G_h} x).

    b_s `[BK, BV]` S0 tile, b_hkw `[BL, BK]` K~ (zero past h), b_hu `[BL, BV]`, b_x `[BK]`, b_dx = e^{G} and
    b_rx = e^{G - G_h} (`[BG]`, broadcast over K). Cost O(K BV + h (K + BV)): the history never builds a K x V tile.
    """
    b_y = tl.sum(b_s * (b_x * b_dx)[:, None], 0)  # [BV]
    b_c = tl.sum(b_hkw * (b_x * b_rx)[None, :], 1)  # [BL]
    return b_y + tl.sum(b_c[:, None] * b_hu, 0)


@triton.heuristics({"USE_LOWER_BOUND": lambda args: args["lower_bound"] is not None})
@triton.jit
def replay_verify_kernel(
    q,
    k,
    v,
    graw,
    braw,
    A_log,
    dt_bias,
    ssm,
    hist_k,
    hist_u,
    hist_g,
    cursor,
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
    stride_hk_s,
    stride_hk_b,
    stride_hk_l,
    stride_hu_s,
    stride_hu_b,
    stride_hu_l,
    stride_hg_s,
    stride_hg_b,
    stride_hg_l,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    GK: tl.constexpr,
    L: tl.constexpr,
    WMAX: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BG: tl.constexpr,
    BL: tl.constexpr,
    BW: tl.constexpr,
    PRECOMPUTE: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr,
    STATE_PRECISION: tl.constexpr,
    OUT_PRECISION: tl.constexpr,
    FOLD_PRECISION: tl.constexpr,
):
    i_v, i_n, i_hv = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    i_h = i_hv // (HV // H)
    width = tl.load(widths + i_n)
    slot = tl.load(slots + i_n).to(tl.int64)
    live = width > 0
    h = tl.load(cursor + slot, mask=live, other=0)
    par = tl.load(parity + slot, mask=live, other=0).to(tl.int64)
    fold = live & (h + width > L)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_g = tl.arange(0, BG)
    o_l = tl.arange(0, BL)
    m_k, m_v, m_g = o_k < K, o_v < V, o_g < GK
    m_kv = m_k[:, None] & m_v[None, :]
    m_l = o_l < h

    # the state tile is issued first: its DRAM latency overlaps the history and window loads
    p_s = ssm + slot * stride_ssm_s + i_hv * K * V + o_k[:, None] * V + o_v[None, :]
    b_s = tl.load(p_s, mask=m_kv & live, other=0).to(tl.float32)  # [BK, BV]
    # committed history of buffer `par`: records past h (rejected drafts, older generations) are never loaded
    p_hk = hist_k + slot * stride_hk_s + par * stride_hk_b + o_l[:, None] * stride_hk_l + i_h * K + o_k[None, :]
    b_hk = tl.load(p_hk, mask=m_l[:, None] & m_k[None, :], other=0)  # [BL, BK]
    p_hg = hist_g + slot * stride_hg_s + par * stride_hg_b + o_l[:, None] * stride_hg_l + i_hv * GK + o_g[None, :]
    b_hg = tl.load(p_hg, mask=m_l[:, None] & m_g[None, :], other=0)  # [BL, BG]
    p_hu = hist_u + slot * stride_hu_s + par * stride_hu_b + o_l[:, None] * stride_hu_l + i_hv * V + o_v[None, :]
    b_hu = tl.load(p_hu, mask=m_l[:, None] & m_v[None, :], other=0)  # [BL, BV]
    b_hkw, b_gh = history_weights(b_hk, b_hg, m_l, h)  # [BL, BK], [BG]
    if fold:
        # the window continues from the stored (rounded) S_h with an empty history
        b_s = fold_state(b_s, b_hkw, b_hu, b_gh, FOLD_PRECISION).to(p_s.dtype.element_ty)
        tl.store(p_s, b_s, mask=m_kv)
        b_s = b_s.to(tl.float32)
        b_hkw = tl.zeros([BL, BK], dtype=tl.float32)
        b_hu = tl.zeros([BL, BV], dtype=tl.float32)
        b_gh = tl.zeros([BG], dtype=tl.float32)
    h = tl.where(fold, 0, h)

    b_a_log = tl.load(A_log + i_hv).to(tl.float32)
    b_dt_bias = tl.load(dt_bias + i_hv * GK + o_g, mask=m_g, other=0).to(tl.float32)  # [BG]
    # records of this window: positions h.. of buffer `par`, or 0.. of buffer `1 - par` after a fold
    buf = tl.where(fold, 1 - par, par)
    p_ru = hist_u + slot * stride_hu_s + buf * stride_hu_b + h * stride_hu_l + i_hv * V + o_v
    p_rg = hist_g + slot * stride_hg_s + buf * stride_hg_b + h * stride_hg_l + i_hv * GK + o_g
    p_rk = hist_k + slot * stride_hk_s + buf * stride_hk_b + h * stride_hk_l + i_h * K + o_k
    # single writer per record: u per V tile, G per value head, k per key group
    first_tile = i_v == 0
    key_owner = first_tile & (i_hv % (HV // H) == 0)

    if BW == 1:
        # plain decode: one token, no window loop
        b_q, b_k, b_v, b_g, b_beta, _ = load_token(
            q + i_n * stride_q_n + i_h * K,
            k + i_n * stride_q_n + i_h * K,
            v + i_n * stride_v_n + i_hv * V,
            graw + i_n * stride_g_n + i_hv * GK,
            braw + i_n * stride_b_n + i_hv,
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
        b_G = b_gh + b_g  # [BG]
        b_d, b_r = tl.exp(b_G), tl.exp(b_g)
        b_ak = _history_project(b_s, b_hkw, b_hu, b_k, b_d, b_r)
        b_aq = _history_project(b_s, b_hkw, b_hu, b_q, b_d, b_r)
        b_u = b_beta * (b_v - b_ak)
        b_o = tl.where(live, b_aq + b_u * tl.sum(b_k * b_q, 0), 0.0)
        p_o = o + i_n * stride_o_n + i_hv * V + o_v
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=m_v)
        m_rec = live & (h < L)
        tl.store(p_ru, b_u, mask=m_v & m_rec)
        tl.store(p_rg, b_G, mask=m_g & m_rec & first_tile)
        tl.store(p_rk, b_k, mask=m_k & m_rec & key_owner)
    else:
        _window(
            b_s, b_hkw, b_hu, b_gh, q, k, v, graw, braw, o, b_a_log, b_dt_bias, scale, lower_bound, width, live, h,
            i_n, i_h, i_hv, p_ru, p_rg, p_rk, first_tile, key_owner,
            stride_q_n, stride_q_w, stride_v_n, stride_v_w, stride_g_n, stride_g_w, stride_b_n, stride_b_w,
            stride_o_n, stride_o_w, stride_hu_l, stride_hg_l, stride_hk_l,
            K, V, GK, L, WMAX, BK, BV, BG, BL, BW, PRECOMPUTE, USE_LOWER_BOUND, STATE_PRECISION, OUT_PRECISION,
        )  # fmt: skip


@triton.jit
def _window(
    b_s, b_hkw, b_hu, b_gh, q, k, v, graw, braw, o, b_a_log, b_dt_bias, scale, lower_bound, width, live, h,
    i_n, i_h, i_hv, p_ru, p_rg, p_rk, first_tile, key_owner,
    stride_q_n, stride_q_w, stride_v_n, stride_v_w, stride_g_n, stride_g_w, stride_b_n, stride_b_w,
    stride_o_n, stride_o_w, stride_hu_l, stride_hg_l, stride_hk_l,
    K: tl.constexpr, V: tl.constexpr, GK: tl.constexpr, L: tl.constexpr, WMAX: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, BG: tl.constexpr, BL: tl.constexpr, BW: tl.constexpr, PRECOMPUTE: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr, STATE_PRECISION: tl.constexpr, OUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """A verify window of `width` tokens as register blocks `[BW, X]` (rows >= width are zero, never stored)."""
    o_k = tl.arange(0, BK)
    o_v = tl.program_id(0) * BV + tl.arange(0, BV)
    o_g = tl.arange(0, BG)
    o_w = tl.arange(0, BW)
    m_k, m_v, m_g = o_k < K, o_v < V, o_g < GK
    m_w = o_w < width
    m_wk = m_w[:, None] & m_k[None, :]
    p_q = q + i_n * stride_q_n + o_w[:, None] * stride_q_w + i_h * K + o_k[None, :]
    b_q = l2norm_rows(tl.load(p_q, mask=m_wk, other=0).to(tl.float32)) * scale  # [BW, BK]
    p_k = k + i_n * stride_q_n + o_w[:, None] * stride_q_w + i_h * K + o_k[None, :]
    b_k = l2norm_rows(tl.load(p_k, mask=m_wk, other=0).to(tl.float32))  # [BW, BK]
    p_v = v + i_n * stride_v_n + o_w[:, None] * stride_v_w + i_hv * V + o_v[None, :]
    b_v = tl.load(p_v, mask=m_w[:, None] & m_v[None, :], other=0).to(tl.float32)  # [BW, BV]
    p_g = graw + i_n * stride_g_n + o_w[:, None] * stride_g_w + i_hv * GK + o_g[None, :]
    b_g = tl.load(p_g, mask=m_w[:, None] & m_g[None, :], other=0).to(tl.float32)
    b_g = gate_activation(b_g, b_a_log, b_dt_bias[None, :], lower_bound, USE_LOWER_BOUND)
    b_g = tl.where(m_w[:, None], b_g, 0.0)  # [BW, BG]
    b_beta = sigmoid(tl.load(braw + i_n * stride_b_n + o_w * stride_b_w + i_hv, mask=m_w, other=0).to(tl.float32))
    # cumulative gate of each window token since S0 (what its record stores), and its decay relative to G_h
    b_G = b_gh[None, :] + tl.cumsum(b_g, 0)  # [BW, BG]
    b_rel = tl.exp(b_G - b_gh[None, :])  # [BW, BG]

    if PRECOMPUTE:
        # S_h^T of every window key / query at once: S0 part + committed-history part, as tensor-core dots
        b_xk = b_k * b_rel
        b_xq = b_q * b_rel
        b_dh = tl.exp(b_gh)[None, :]
        b_yk = tl.dot(b_xk * b_dh, b_s, input_precision=STATE_PRECISION)  # [BW, BV]
        b_yq = tl.dot(b_xq * b_dh, b_s, input_precision=OUT_PRECISION)  # [BW, BV]
        b_ck = tl.dot(b_xk, tl.trans(b_hkw), input_precision=STATE_PRECISION)  # [BW, BL]
        b_cq = tl.dot(b_xq, tl.trans(b_hkw), input_precision=OUT_PRECISION)  # [BW, BL]
        b_yk += tl.dot(b_ck, b_hu, input_precision=STATE_PRECISION)
        b_yq += tl.dot(b_cq, b_hu, input_precision=OUT_PRECISION)

    b_u = tl.zeros([BW, BV], dtype=tl.float32)
    b_o = tl.zeros([BW, BV], dtype=tl.float32)
    for s in range(0, width):
        m_s = o_w == s
        b_ks = _row(b_k, m_s)  # [BK]
        b_qs = _row(b_q, m_s)  # [BK]
        b_Gs = _row(b_G, m_s)  # [BG]
        if PRECOMPUTE:
            b_ak = _row(b_yk, m_s)  # [BV]
            b_aq = _row(b_yq, m_s)  # [BV]
        else:
            b_ds, b_rs = tl.exp(b_Gs), tl.exp(b_Gs - b_gh)
            b_ak = _history_project(b_s, b_hkw, b_hu, b_ks, b_ds, b_rs)
            b_aq = _history_project(b_s, b_hkw, b_hu, b_qs, b_ds, b_rs)
        # in-window records s' <= s: weights e^{G_s - G_s'} <= 1; row s of b_u is still zero for the key side
        m_le = o_w <= s
        b_kw = tl.where(m_le[:, None], b_k * tl.exp(tl.where(m_le[:, None], b_Gs[None, :] - b_G, 0.0)), 0.0)
        b_ak += tl.sum(tl.sum(b_kw * b_ks[None, :], 1)[:, None] * b_u, 0)
        b_us = _row(b_beta[:, None], m_s) * (_row(b_v, m_s) - b_ak)  # [BV]
        b_u = tl.where(m_s[:, None], b_us[None, :], b_u)
        b_os = b_aq + tl.sum(tl.sum(b_kw * b_qs[None, :], 1)[:, None] * b_u, 0)
        b_o = tl.where(m_s[:, None], b_os[None, :], b_o)

    p_o = o + i_n * stride_o_n + o_w[:, None] * stride_o_w + i_hv * V + o_v[None, :]
    tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=(o_w < WMAX)[:, None] & m_v[None, :])
    m_rec = m_w & (h + o_w < L)
    tl.store(p_ru[None, :] + o_w[:, None] * stride_hu_l, b_u, mask=m_rec[:, None] & m_v[None, :])
    tl.store(p_rg[None, :] + o_w[:, None] * stride_hg_l, b_G, mask=m_rec[:, None] & m_g[None, :] & first_tile)
    tl.store(p_rk[None, :] + o_w[:, None] * stride_hk_l, b_k, mask=m_rec[:, None] & m_k[None, :] & key_owner)


def replay_verify_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    graw: torch.Tensor,
    braw: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm: torch.Tensor,
    hist_k: torch.Tensor,
    hist_u: torch.Tensor,
    hist_g: torch.Tensor,
    cursor: torch.Tensor,
    parity: torch.Tensor,
    slots: torch.Tensor,
    widths: torch.Tensor,
    *,
    projection: str = "inline",
    scale: float | None = None,
    lower_bound: float | None = None,
    config=None,
) -> torch.Tensor:
    """Replay verify of one layer (see `ops.replay_verify`), fold decided on the device.

    ssm `[S, HV, K, V]` (state dtype; in place only for rows that fold: `ssm[slot] <- S_h`); hist_k `[S, 2, L, H, K]`,
    hist_u `[S, 2, L, HV, V]`, hist_g `[S, 2, L, HV, GK]` fp32 (in place: the window's records, positions h..h+W-1
    of buffer p, or 0..W-1 of buffer 1-p on a fold); cursor / parity `[S]` int32 (read only); slots / widths `[N]`
    int32. Returns o `[N, Wmax, HV, V]` (dtype of v, zeros for s >= W). `config`: a `KernelConfig` or None.
    """
    from lightllm.linear_att.kernels.launch import check_verify_inputs, replay_config

    N, WMAX, H, K = q.shape
    HV, V, GK = v.shape[2], v.shape[3], graw.shape[-1]
    L = hist_k.shape[2]
    check_verify_inputs(q, k, v, graw, braw, A_log, dt_bias, slots, widths)
    if projection not in ("inline", "precompute"):
        raise ValueError(f"projection must be 'inline' or 'precompute', got {projection!r}")
    assert L >= WMAX, f"replay capacity {L} must cover the verify width {WMAX}"
    assert ssm.dim() == 4 and ssm.shape[1:] == (HV, K, V) and ssm.stride(1) == K * V and ssm.stride(3) == 1
    _check_history(hist_k, hist_u, hist_g, H, HV, K, V, GK, leading=1)
    cfg = config or replay_config(ssm.dtype, v.dtype, H, HV, K, V, GK, WMAX, L, projection, ssm.device)
    o = torch.empty_like(v)
    if N == 0:
        return o
    BV = block_v(cfg, V, ssm.device)
    precompute = projection == "precompute"
    # tensor-core dots need 16 rows on the GPU; the inline schedule (and the interpreter) keep the block minimal
    BW = triton.next_power_of_2(WMAX)
    if precompute and ssm.is_cuda:
        BW = max(16, BW)
    replay_verify_kernel[(triton.cdiv(V, BV), N, HV)](
        q,
        k,
        v,
        graw,
        braw,
        A_log,
        dt_bias,
        ssm,
        hist_k,
        hist_u,
        hist_g,
        cursor,
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
        *hist_k.stride()[:3],
        *hist_u.stride()[:3],
        *hist_g.stride()[:3],
        H=H,
        HV=HV,
        K=K,
        V=V,
        GK=GK,
        L=L,
        WMAX=WMAX,
        BK=triton.next_power_of_2(K),
        BV=BV,
        BG=triton.next_power_of_2(GK),
        BL=max(16, triton.next_power_of_2(L)),
        BW=BW,
        PRECOMPUTE=precompute,
        STATE_PRECISION="tf32x3",
        OUT_PRECISION="tf32",
        FOLD_PRECISION="tf32x3",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return o


def block_v(cfg, V: int, device: torch.device) -> int:
    """V tile of the replay kernels: tensor-core dots need at least 16 columns on the GPU."""
    bv = min(cfg.block_v, triton.next_power_of_2(V))
    return max(bv, 16) if device.type == "cuda" else bv


def _check_history(hist_k, hist_u, hist_g, H, HV, K, V, GK, leading):
    lead = tuple(hist_k.shape[:leading])
    L = hist_k.shape[leading + 1]
    assert hist_k.shape == (*lead, 2, L, H, K), f"hist_k {tuple(hist_k.shape)}"
    wl = hist_k.shape[: leading + 2]
    assert hist_u.shape == (*wl, HV, V) and hist_g.shape == (*wl, HV, GK), (
        f"hist_u {tuple(hist_u.shape)} / hist_g {tuple(hist_g.shape)} do not match hist_k {tuple(hist_k.shape)}"
    )
    for t in (hist_k, hist_u, hist_g):
        assert t.dtype == torch.float32, "replay history records are fp32"
        assert t.stride(-1) == 1 and t.stride(-2) == t.shape[-1], "history heads must be contiguous"
