"""Replay verify of a window (W > 1) in one launch, the "precompute" projection: every coefficient row of the
window is built in registers and the state is contracted with all of them at once as tensor-core dots.

One program per (V tile, row, value head), like `replay_decode.py` (the W = 1 case). With `h` committed records
in buffer `p`, the window's within-window cumulative gates `r_s = g_1 + ... + g_s` and `G_s = G_h + r_s`:

    a_s(x) = e^{r_s} x                                  (decays relative to S_h, <= 1)
    Y(x)   = S0^T (e^{G_h} a_s(x)) + sum_j u_j (a_s(x) . K~_j),    K~_j = e^{G_h - G_j} k_hat_j
    B[s, r](x) = (e^{r_s - r_r} k_hat_r) . x_s          (r < s for keys, r <= s for queries; forward decays only)
    u_s = beta_s (v_s - Y(k_hat)_s - sum_{r<s} B_k[s, r] u_r)
    o_s = Y(q_hat)_s + sum_{r<=s} B_q[s, r] u_r

`Y` for all window rows, keys and queries stacked, is one `[2 BW, K] x [K, BV]` dot against the S0 tile plus one
`[2 BW, L] x [L, BV]` dot against the records; the history weights `a_s . K~_j` are one `[2 BW, K] x [K, L]` dot;
the window pairs `B` are W passes over `[BW, K]` blocks (per-channel decays for KDA, so no `e^{-G}` is ever
formed); the triangular solve for `u` is W steps on `[BV]` vectors, and `o` adds `B_q u` as W^2 V FMAs. Every dot that
feeds `u` (hence the records and the state) runs at `PRECISION` ("tf32x3" or "ieee"). The fold (`h + W > L`) is
the one of `replay_decode.py`: each program rebuilds S_h on its own columns, stores it rounded and continues from
it with an empty history; records go to positions 0..W-1 of buffer `1 - p`, which no reader in the launch reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightllm.linear_att.kernels.common import (
    cumsum_rows,
    fold_if_full,
    gate_activation,
    history_weights,
    l2norm_rows,
    row_of,
    sigmoid,
)


@triton.jit
def _stack(b_a, b_b):
    """`[R, X]` and `[R, X]` -> `[2 R, X]` (rows of `b_a`, then rows of `b_b`)."""
    return tl.reshape(tl.permute(tl.join(b_a, b_b), (2, 0, 1)), (2 * b_a.shape[0], b_a.shape[1]))


@triton.heuristics({"USE_LOWER_BOUND": lambda args: args["lower_bound"] is not None})
@triton.jit
def replay_window_kernel(
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
    USE_LOWER_BOUND: tl.constexpr,
    PRECISION: tl.constexpr,
):
    i_v, i_n, i_hv = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    i_h = i_hv // (HV // H)
    width = tl.load(widths + i_n)
    live = width > 0
    slot = tl.load(slots + i_n).to(tl.int64)
    h = tl.load(cursor + slot, mask=live, other=0)
    par = tl.load(parity + slot, mask=live, other=0).to(tl.int64)
    fold = live & (h + width > L)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_g = tl.arange(0, BG)
    o_l = tl.arange(0, BL)
    o_w = tl.arange(0, BW)
    m_k, m_v, m_g = o_k < K, o_v < V, o_g < GK
    m_kv = m_k[:, None] & m_v[None, :]
    m_l = live & (o_l < h)
    m_w = o_w < width

    # committed records of buffer `par` (never past h)
    p_hk = hist_k + slot * stride_hk_s + par * stride_hk_b + i_h * K
    p_hu = hist_u + slot * stride_hu_s + par * stride_hu_b + i_hv * V
    p_hg = hist_g + slot * stride_hg_s + par * stride_hg_b + i_hv * GK
    b_hk = tl.load(p_hk + o_l[:, None] * stride_hk_l + o_k[None, :], mask=m_l[:, None] & m_k[None, :], other=0)
    b_hg = tl.load(p_hg + o_l[:, None] * stride_hg_l + o_g[None, :], mask=m_l[:, None] & m_g[None, :], other=0)
    b_hkw, b_gh = history_weights(b_hk, b_hg, m_l, h)  # [BL, BK] K~_j, [BG] G_h
    b_hu = tl.load(p_hu + o_l[:, None] * stride_hu_l + o_v[None, :], mask=m_l[:, None] & m_v[None, :], other=0)

    p_s = ssm + slot * stride_ssm_s + i_hv * K * V + o_k[:, None] * V + o_v[None, :]
    b_s = tl.load(p_s, mask=m_kv & live, other=0).to(tl.float32)  # [BK, BV]
    b_s, b_hkw, b_hu, b_gh, h, buf = fold_if_full(
        fold, b_s, b_hkw, b_hu, b_gh, p_s, m_kv, p_hk, p_hg, p_hu, stride_hk_l, stride_hg_l, stride_hu_l, h, par,
        o_k, m_k, o_g, m_g, o_v, m_v,
    )  # fmt: skip

    # the window: q_hat, k_hat [BW, BK], v [BW, BV], gates [BW, BG], beta [BW]; rows >= width are zero
    m_wk = m_w[:, None] & m_k[None, :]
    p_qk = i_n * stride_q_n + o_w[:, None] * stride_q_w + i_h * K + o_k[None, :]
    b_q = l2norm_rows(tl.load(q + p_qk, mask=m_wk, other=0).to(tl.float32)) * scale
    b_k = l2norm_rows(tl.load(k + p_qk, mask=m_wk, other=0).to(tl.float32))
    p_vw = v + i_n * stride_v_n + o_w[:, None] * stride_v_w + i_hv * V + o_v[None, :]
    b_vw = tl.load(p_vw, mask=m_w[:, None] & m_v[None, :], other=0).to(tl.float32)
    b_a_log = tl.load(A_log + i_hv).to(tl.float32)
    b_dt_bias = tl.load(dt_bias + i_hv * GK + o_g, mask=m_g, other=0).to(tl.float32)
    m_wg = m_w[:, None] & m_g[None, :]
    p_g = graw + i_n * stride_g_n + o_w[:, None] * stride_g_w + i_hv * GK + o_g[None, :]
    b_g = gate_activation(tl.load(p_g, mask=m_wg, other=0).to(tl.float32), b_a_log, b_dt_bias[None, :], lower_bound,
                          USE_LOWER_BOUND)  # fmt: skip
    b_gr = cumsum_rows(tl.where(m_wg, b_g, 0.0))  # [BW, BG] r_s
    b_beta = sigmoid(tl.load(braw + i_n * stride_b_n + o_w * stride_b_w + i_hv, mask=m_w, other=0).to(tl.float32))
    b_beta = tl.where(m_w, b_beta, 0.0)

    # Y(k_hat), Y(q_hat): the S0 tile and the records against every window row at once, keys and queries stacked
    # into one [2 BW, K] operand (16 rows cover W <= 8)
    b_er = tl.exp(b_gr)
    b_a = _stack(b_k * b_er, b_q * b_er)  # a_s(x) [2 BW, BK]
    b_c = tl.dot(b_a, tl.trans(b_hkw), input_precision=PRECISION)  # [2 BW, BL] history weights
    b_y = tl.dot(b_a * tl.exp(b_gh)[None, :], b_s, input_precision=PRECISION)
    b_y += tl.dot(b_c, b_hu, input_precision=PRECISION)  # [2 BW, BV]
    b_yk, b_yq = tl.split(tl.permute(tl.reshape(b_y, (2, BW, BV)), (1, 2, 0)))  # [BW, BV] each

    # window pairs B_k (strictly lower) and B_q (lower), one column r per pass
    b_bk = tl.zeros([BW, BW], dtype=tl.float32)
    b_bq = tl.zeros([BW, BW], dtype=tl.float32)
    for r in range(0, width):
        m_r = o_w == r
        b_kr = row_of(b_k, m_r)  # [BK]
        b_grr = row_of(b_gr, m_r)  # [BG]
        b_kd = b_kr[None, :] * tl.exp(tl.where((o_w >= r)[:, None], b_gr - b_grr[None, :], 0.0))  # [BW, BK]
        b_bk = tl.where(m_r[None, :], tl.where(o_w > r, tl.sum(b_k * b_kd, 1), 0.0)[:, None], b_bk)
        b_bq = tl.where(m_r[None, :], tl.where(o_w >= r, tl.sum(b_q * b_kd, 1), 0.0)[:, None], b_bq)

    # u_s by forward substitution, then every o_s in one dot
    b_u = tl.zeros([BW, BV], dtype=tl.float32)
    for s in range(0, width):
        m_s = o_w == s
        b_rhs = row_of(b_vw, m_s) - row_of(b_yk, m_s) - tl.sum(row_of(b_bk, m_s)[:, None] * b_u, 0)
        b_u = tl.where(m_s[:, None], (row_of(b_beta[:, None], m_s) * b_rhs)[None, :], b_u)
    b_o = b_yq + tl.sum(b_bq[:, :, None] * b_u[None, :, :], 1)  # [BW, BW, BV]: W^2 V FMAs per tile

    p_o = o + i_n * stride_o_n + o_w[:, None] * stride_o_w + i_hv * V + o_v[None, :]
    tl.store(p_o, tl.where(m_w[:, None], b_o, 0.0).to(o.dtype.element_ty), mask=(o_w < WMAX)[:, None] & m_v[None, :])
    # records of the window (one writer each: u per V tile, G per value head, k_hat per key group)
    m_rec = live & m_w
    p_ru = hist_u + slot * stride_hu_s + buf * stride_hu_b + (h + o_w[:, None]) * stride_hu_l + i_hv * V
    tl.store(p_ru + o_v[None, :], b_u, mask=m_rec[:, None] & m_v[None, :])
    first_tile = i_v == 0
    p_rg = hist_g + slot * stride_hg_s + buf * stride_hg_b + (h + o_w[:, None]) * stride_hg_l + i_hv * GK
    tl.store(p_rg + o_g[None, :], b_gh[None, :] + b_gr, mask=(m_rec & first_tile)[:, None] & m_g[None, :])
    key_owner = first_tile & (i_hv % (HV // H) == 0)
    p_rk = hist_k + slot * stride_hk_s + buf * stride_hk_b + (h + o_w[:, None]) * stride_hk_l + i_h * K
    tl.store(p_rk + o_k[None, :], b_k, mask=(m_rec & key_owner)[:, None] & m_k[None, :])


def replay_window_triton(
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
    *,
    scale: float,
    lower_bound: float | None,
    block_v: int,
    num_warps: int,
    num_stages: int,
    precision: str = "ieee",
) -> torch.Tensor:
    """The W > 1 "precompute" case of `replay_verify_triton` (inputs already checked there). Returns o
    `[N, Wmax, HV, V]`, zeros past each row's width."""
    N, WMAX, H, K = q.shape
    HV, V, GK = v.shape[2], v.shape[3], graw.shape[-1]
    L = hist_k.shape[2]
    o = torch.empty_like(v)
    if N == 0:
        return o
    # tensor-core dots need 16 rows (2 BW) and 16 columns (BL) on the GPU; the interpreter keeps blocks minimal
    least = 16 if ssm.is_cuda else 1
    replay_window_kernel[(triton.cdiv(V, block_v), N, HV)](
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
        BV=block_v,
        BG=triton.next_power_of_2(GK),
        BL=max(least, triton.next_power_of_2(L)),
        BW=max(least // 2, triton.next_power_of_2(WMAX)),
        PRECISION=precision,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return o
