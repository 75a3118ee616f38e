"""Replay decode/verify entry point, and the "inline" projection as PREPARE + FORWARD: read the canonical state S0
and the committed history, never write S0 except on a fold.

With `h = cursor[slot]` committed records in buffer `p = parity[slot]` (k_hat_j per key head, u_j per value head,
cumulative gate G_j since S0, all fp32) and the window's cumulative gates G_s (through token s), token s needs

    S_{h+s}^T (e^{g_s} x) = S0^T (e^{G_s} x) + sum_j u_j ((e^{G_s - G_j} k_hat_j) . x),  x in {k_hat_s, q_hat_s}

where j runs over the committed records and the window tokens r < s (key side) / r <= s (query side). Every
weight is a forward decay e^{<= 0}. The window's corrected values solve a unit lower-triangular system,
(I + diag(beta) B_k) u = beta (v - X_k S0 - A_k U), so every u_s and o_s is a fixed linear combination of
the S0 rows, the committed u records and the window's v rows, with coefficients that depend only on k, q, g and
beta -- not on S0, U or v:

    u = M v - (M X_k) S0 - (M A_k) U,      M = (I + diag(beta) B_k)^{-1} diag(beta)
    o = (B_q M) v + (X_q - B_q M X_k) S0 + (A_q - B_q M A_k) U

For the "inline" projection, `replay_prepare_kernel` (one program per (row, value head)) computes those
coefficients once -- l2norm, gates, cumulative decays, history weights, the triangular solve -- into an fp32 scratch `coef [N, HV, 2 Wmax, K + L +
Wmax]` (rows 0..Wmax-1: u_s, rows Wmax..2Wmax-1: o_s; columns: S0 rows | committed records | window v rows), and
writes the window's k_hat (one writer per key group) and G records. `replay_forward_kernel` (one program per (V
tile, row, value head)) is then a lean state read: contract the S0 tile, the u records and the v rows with the
coefficient rows, write u records and o. The V tiles of a (row, head) no longer repeat the history weighting,
and no program runs a serial window loop.

Fold, decided per row on the device: if `h + W > L`, the prepare program of (row, head) writes S_h =
e^{G_h} S0 + K~^T U into `ssm` (fp32 FMAs per V chunk, rounded once; the helper every fold uses)
and the coefficients are taken relative to S_h with an empty history; the window's records go to positions
0..W-1 of buffer `1 - p`, otherwise to h..h+W-1 of buffer `p`. Readers in a launch only read buffer `p` at
positions < h, so no program overwrites a record another program (another V tile, another value head of the key
group) still reads; the forward, a later launch, reads the S_h the prepare wrote.

Which kernels run: plain decode (W = 1) is one launch, `kernels/replay_decode.py`, under either projection. For
W > 1, "inline" is the prepare + forward pair below (the forward contracts the operands token by token as
CUDA-core reductions, no layout conversion of the state tile), and "precompute" is one launch,
`kernels/replay_window.py`, which builds the window's coefficient rows in registers and contracts the state with
all of them at once as dots. Every contraction that can feed u (hence the state) runs in tf32x3 or fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightllm.linear_att.kernels.common import (
    fold_tile_from_records,
    gate_activation,
    history_weights,
    l2norm_rows,
    row_of,
    sigmoid,
)
from lightllm.linear_att.kernels.replay_decode import replay_decode_triton
from lightllm.linear_att.kernels.replay_window import replay_window_triton


@triton.heuristics({"USE_LOWER_BOUND": lambda args: args["lower_bound"] is not None})
@triton.jit
def replay_prepare_kernel(
    q,
    k,
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
    coef,
    scale,
    lower_bound,
    stride_q_n,
    stride_q_w,
    stride_g_n,
    stride_g_w,
    stride_b_n,
    stride_b_w,
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
    stride_c_n,
    stride_c_h,
    stride_c_r,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    GK: tl.constexpr,
    L: tl.constexpr,
    WMAX: tl.constexpr,
    BK: tl.constexpr,
    BG: tl.constexpr,
    BL: tl.constexpr,
    BW: tl.constexpr,
    BVF: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr,
):
    i_n, i_hv = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_h = i_hv // (HV // H)
    width = tl.load(widths + i_n)
    slot = tl.load(slots + i_n).to(tl.int64)
    live = width > 0
    h = tl.load(cursor + slot, mask=live, other=0)
    par = tl.load(parity + slot, mask=live, other=0).to(tl.int64)
    fold = live & (h + width > L)

    o_k = tl.arange(0, BK)
    o_g = tl.arange(0, BG)
    o_l = tl.arange(0, BL)
    o_w = tl.arange(0, BW)
    m_k, m_g = o_k < K, o_g < GK
    m_l = o_l < h
    m_w = o_w < width

    # committed keys and gates of buffer `par` (records past h are never loaded)
    p_hk = hist_k + slot * stride_hk_s + par * stride_hk_b + o_l[:, None] * stride_hk_l + i_h * K + o_k[None, :]
    b_hk = tl.load(p_hk, mask=m_l[:, None] & m_k[None, :], other=0)  # [BL, BK]
    p_hg = hist_g + slot * stride_hg_s + par * stride_hg_b + o_l[:, None] * stride_hg_l + i_hv * GK + o_g[None, :]
    b_hg = tl.load(p_hg, mask=m_l[:, None] & m_g[None, :], other=0)  # [BL, BG]
    b_hkw, b_gh = history_weights(b_hk, b_hg, m_l, h)  # [BL, BK], [BG]
    if fold:
        # S_h into `ssm` (rounded once); the window then starts from it with an empty history
        p_fk = hist_k + slot * stride_hk_s + par * stride_hk_b + i_h * K
        p_fg = hist_g + slot * stride_hg_s + par * stride_hg_b + i_hv * GK
        p_fu = hist_u + slot * stride_hu_s + par * stride_hu_b + i_hv * V
        p_s = ssm + slot * stride_ssm_s + i_hv * K * V + o_k[:, None] * V
        for i_v in range(0, tl.cdiv(V, BVF)):
            o_v = i_v * BVF + tl.arange(0, BVF)
            m_v = o_v < V
            m_kv = m_k[:, None] & m_v[None, :]
            b_s = tl.load(p_s + o_v[None, :], mask=m_kv, other=0).to(tl.float32)
            b_s = fold_tile_from_records(
                b_s, b_gh, p_fk, p_fg, p_fu, stride_hk_l, stride_hg_l, stride_hu_l, h, o_k, m_k, o_g, m_g, o_v, m_v
            )
            tl.store(p_s + o_v[None, :], b_s.to(p_s.dtype.element_ty), mask=m_kv)
        b_hkw = tl.zeros([BL, BK], dtype=tl.float32)
        b_gh = tl.zeros([BG], dtype=tl.float32)
    h = tl.where(fold, 0, h)

    # the window: q_hat, k_hat [BW, BK], gates [BW, BG], beta [BW] (rows >= width are zero)
    m_wk = m_w[:, None] & m_k[None, :]
    p_q = q + i_n * stride_q_n + o_w[:, None] * stride_q_w + i_h * K + o_k[None, :]
    b_q = l2norm_rows(tl.load(p_q, mask=m_wk, other=0).to(tl.float32)) * scale
    p_k = k + i_n * stride_q_n + o_w[:, None] * stride_q_w + i_h * K + o_k[None, :]
    b_k = l2norm_rows(tl.load(p_k, mask=m_wk, other=0).to(tl.float32))
    b_a_log = tl.load(A_log + i_hv).to(tl.float32)
    b_dt_bias = tl.load(dt_bias + i_hv * GK + o_g, mask=m_g, other=0).to(tl.float32)
    p_g = graw + i_n * stride_g_n + o_w[:, None] * stride_g_w + i_hv * GK + o_g[None, :]
    b_g = tl.load(p_g, mask=m_w[:, None] & m_g[None, :], other=0).to(tl.float32)
    b_g = gate_activation(b_g, b_a_log, b_dt_bias[None, :], lower_bound, USE_LOWER_BOUND)
    b_g = tl.where(m_w[:, None], b_g, 0.0)  # [BW, BG]
    b_beta = sigmoid(tl.load(braw + i_n * stride_b_n + o_w * stride_b_w + i_hv, mask=m_w, other=0).to(tl.float32))
    b_beta = tl.where(m_w, b_beta, 0.0)
    b_gr = tl.cumsum(b_g, 0)  # [BW, BG] decay of token s since the base state (S0, or S_h after a fold)
    b_G = b_gh[None, :] + b_gr  # [BW, BG] cumulative gate since S0: what the record stores

    # one pass over the window's rows s: B[s, r] = (e^{G_s - G_r} k_hat_r) . x_s (strictly lower for keys, lower
    # for queries), x_s e^{G_s} for S0 and (e^{G_s - G_h} x_s) . K~_j for the committed records, then the forward
    # substitution of (I + diag(beta) B_k) [M | C_u] = diag(beta) [I | -X_k | -A_k] and the o rows
    # [B_q M | X_q + B_q C_u]; rows are stored as they are finished
    b_csu = tl.zeros([BW, BK], dtype=tl.float32)  # -M X_k
    b_chu = tl.zeros([BW, BL], dtype=tl.float32)  # -M A_k
    b_m = tl.zeros([BW, BW], dtype=tl.float32)  # M
    m_st = live & (o_w < WMAX)
    m_cl = o_l < L
    p_c = coef + i_n * stride_c_n + i_hv * stride_c_h
    for s in range(0, width):
        m_s = o_w == s
        b_ks, b_qs = row_of(b_k, m_s), row_of(b_q, m_s)  # [BK]
        b_grs, b_Gs = row_of(b_gr, m_s), row_of(b_G, m_s)  # [BG]
        b_beta_s = row_of(b_beta[:, None], m_s)  # [1]
        b_decay = tl.exp(tl.where((o_w <= s)[:, None], b_grs[None, :] - b_gr, 0.0))  # [BW, BG]
        b_kw = b_k * b_decay  # [BW, BK]
        b_bk = tl.where(o_w < s, tl.sum(b_kw * b_ks[None, :], 1), 0.0)  # [BW]
        b_bq = tl.where(o_w <= s, tl.sum(b_kw * b_qs[None, :], 1), 0.0)
        b_ers = tl.exp(b_grs)
        b_aks = tl.sum(b_hkw * (b_ks * b_ers)[None, :], 1)  # [BL]
        b_aqs = tl.sum(b_hkw * (b_qs * b_ers)[None, :], 1)
        b_eas = tl.exp(b_Gs)
        b_csu_s = -b_beta_s * (b_ks * b_eas + tl.sum(b_bk[:, None] * b_csu, 0))
        b_chu_s = -b_beta_s * (b_aks + tl.sum(b_bk[:, None] * b_chu, 0))
        b_m_s = b_beta_s * (m_s.to(tl.float32) - tl.sum(b_bk[:, None] * b_m, 0))
        b_csu = tl.where(m_s[:, None], b_csu_s[None, :], b_csu)
        b_chu = tl.where(m_s[:, None], b_chu_s[None, :], b_chu)
        b_m = tl.where(m_s[:, None], b_m_s[None, :], b_m)
        # coefficient rows: u_s at row s, o_s at row WMAX + s; columns S0 | records | window v
        p_u = p_c + s * stride_c_r
        p_o = p_c + (WMAX + s) * stride_c_r
        tl.store(p_u + o_k, b_csu_s, mask=m_k & live)
        tl.store(p_u + K + o_l, b_chu_s, mask=m_cl & live)
        tl.store(p_u + K + L + o_w, b_m_s, mask=m_st)
        tl.store(p_o + o_k, b_qs * b_eas + tl.sum(b_bq[:, None] * b_csu, 0), mask=m_k & live)
        tl.store(p_o + K + o_l, b_aqs + tl.sum(b_bq[:, None] * b_chu, 0), mask=m_cl & live)
        tl.store(p_o + K + L + o_w, tl.sum(b_bq[:, None] * b_m, 0), mask=m_st)

    # records of this window (one writer each: G per value head, k_hat per key group)
    buf = tl.where(fold, 1 - par, par)
    m_rec = live & m_w
    p_rg = hist_g + slot * stride_hg_s + buf * stride_hg_b + (h + o_w[:, None]) * stride_hg_l + i_hv * GK
    tl.store(p_rg + o_g[None, :], b_G, mask=m_rec[:, None] & m_g[None, :])
    p_rk = hist_k + slot * stride_hk_s + buf * stride_hk_b + (h + o_w[:, None]) * stride_hk_l + i_h * K
    key_owner = i_hv % (HV // H) == 0
    tl.store(p_rk + o_k[None, :], b_k, mask=(m_rec & key_owner)[:, None] & m_k[None, :])


@triton.jit
def _contract(b_s, b_hu, b_v, p_row, o_k, m_k, o_l, m_l, o_w, m_w, K: tl.constexpr, L: tl.constexpr):
    """One coefficient row against the operands: S0 `[BK, BV]`, records `[BL, BV]`, window v `[BWV, BV]`."""
    b_cs = tl.load(p_row + o_k, mask=m_k, other=0)
    b_ch = tl.load(p_row + K + o_l, mask=m_l, other=0)
    b_cv = tl.load(p_row + K + L + o_w, mask=m_w, other=0)
    b_y = tl.sum(b_s * b_cs[:, None], 0) + tl.sum(b_hu * b_ch[:, None], 0)
    return b_y + tl.sum(b_v * b_cv[:, None], 0)


@triton.jit
def replay_forward_kernel(
    v,
    ssm,
    hist_u,
    cursor,
    parity,
    slots,
    widths,
    coef,
    o,
    stride_v_n,
    stride_v_w,
    stride_o_n,
    stride_o_w,
    stride_ssm_s,
    stride_hu_s,
    stride_hu_b,
    stride_hu_l,
    stride_c_n,
    stride_c_h,
    stride_c_r,
    K: tl.constexpr,
    V: tl.constexpr,
    L: tl.constexpr,
    WMAX: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BL: tl.constexpr,
    BWV: tl.constexpr,
):
    i_v, i_n, i_hv = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    width = tl.load(widths + i_n)
    slot = tl.load(slots + i_n).to(tl.int64)
    live = width > 0
    h = tl.load(cursor + slot, mask=live, other=0)
    par = tl.load(parity + slot, mask=live, other=0).to(tl.int64)
    fold = live & (h + width > L)
    # after a fold (done by the prepare launch) `ssm` holds S_h and the history is empty
    h = tl.where(fold, 0, h)
    buf = tl.where(fold, 1 - par, par)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_l = tl.arange(0, BL)
    o_w = tl.arange(0, BWV)
    m_k, m_v = o_k < K, o_v < V
    m_l = live & (o_l < h)
    m_w = o_w < width

    p_s = ssm + slot * stride_ssm_s + i_hv * K * V + o_k[:, None] * V + o_v[None, :]
    b_s = tl.load(p_s, mask=m_k[:, None] & m_v[None, :] & live, other=0).to(tl.float32)  # [BK, BV]
    p_hu = hist_u + slot * stride_hu_s + par * stride_hu_b + o_l[:, None] * stride_hu_l + i_hv * V + o_v[None, :]
    b_hu = tl.load(p_hu, mask=m_l[:, None] & m_v[None, :], other=0)  # [BL, BV]
    p_v = v + i_n * stride_v_n + o_w[:, None] * stride_v_w + i_hv * V + o_v[None, :]
    b_v = tl.load(p_v, mask=m_w[:, None] & m_v[None, :], other=0).to(tl.float32)  # [BWV, BV]
    p_c = coef + i_n * stride_c_n + i_hv * stride_c_h
    p_o = o + i_n * stride_o_n + i_hv * V + o_v
    p_ru = hist_u + slot * stride_hu_s + buf * stride_hu_b + h * stride_hu_l + i_hv * V + o_v

    # token by token: CUDA-core reductions, no window loop state
    for s in range(0, width):
        b_u = _contract(b_s, b_hu, b_v, p_c + s * stride_c_r, o_k, m_k, o_l, m_l, o_w, m_w, K, L)
        b_o = _contract(b_s, b_hu, b_v, p_c + (WMAX + s) * stride_c_r, o_k, m_k, o_l, m_l, o_w, m_w, K, L)
        tl.store(p_o + s * stride_o_w, b_o.to(p_o.dtype.element_ty), mask=m_v)
        tl.store(p_ru + s * stride_hu_l, b_u, mask=m_v)
    for s in range(width, WMAX):
        tl.store(p_o + s * stride_o_w, tl.zeros([BV], dtype=p_o.dtype.element_ty), mask=m_v)


_SCRATCH: dict[tuple, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []


def _coef_scratch(N: int, HV: int, WMAX: int, K: int, L: int, device: torch.device) -> torch.Tensor:
    """The prepare -> forward coefficient buffer `[N, HV, 2 Wmax, K + L + Wmax]` fp32, shared by every call of one
    shape (stream-ordered: each call's prepare overwrites what its forward reads). It grows to the largest N seen;
    a replaced buffer is kept alive, since a CUDA graph captured earlier may still use it. Serving warms up eagerly
    at the largest batch first, so graph capture finds the buffer allocated."""
    key = (device, HV, WMAX, K, L)
    buf = _SCRATCH.get(key)
    if buf is None or buf.shape[0] < N:
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.empty(max(N, 1), HV, 2 * WMAX, K + L + WMAX, dtype=torch.float32, device=device)
        _SCRATCH[key] = buf
    return buf[:N]


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
    """Replay verify of one layer (see `ops.replay_verify`), fold decided on the device: prepare, then forward.

    ssm `[S, HV, K, V]` (state dtype; in place only for rows that fold: `ssm[slot] <- S_h`); hist_k `[S, 2, L, H, K]`,
    hist_u `[S, 2, L, HV, V]`, hist_g `[S, 2, L, HV, GK]` fp32 (in place: the window's records, positions h..h+W-1
    of buffer p, or 0..W-1 of buffer 1-p on a fold); cursor / parity `[S]` int32 (read only); slots / widths `[N]`
    int32. Returns o `[N, Wmax, HV, V]` (dtype of v, zeros for s >= W). `config`: a `KernelConfig` or None (the
    forward's tiling; on the GPU the prepare folds in V chunks of 16 columns, which keeps its register count at
    the window's, 72 for GDN W=1 L=16 on sm_90; the interpreter uses the forward's BV).
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
    BV = block_v(cfg, V, ssm.device)
    scale = K**-0.5 if scale is None else scale
    one_launch = replay_decode_triton if WMAX == 1 else replay_window_triton if projection == "precompute" else None
    if one_launch is not None:
        return one_launch(
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
            scale=scale,
            lower_bound=lower_bound,
            block_v=BV,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    o = torch.empty_like(v)
    if N == 0:
        return o
    coef = _coef_scratch(N, HV, WMAX, K, L, ssm.device)
    BK = triton.next_power_of_2(K)
    BL = max(16, triton.next_power_of_2(L))
    # window blocks of at least 4 rows on the GPU: Triton 3.6 miscompiled the GDN prepare at 2 rows (K = 16, one
    # gate per head; the test is test_replay_short_windows_match_twin); padded rows are masked like any row >= W
    min_rows = 4 if ssm.is_cuda else 1
    replay_prepare_kernel[(N, HV)](
        q,
        k,
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
        coef,
        scale,
        lower_bound,
        q.stride(0),
        q.stride(1),
        graw.stride(0),
        graw.stride(1),
        braw.stride(0),
        braw.stride(1),
        ssm.stride(0),
        *hist_k.stride()[:3],
        *hist_u.stride()[:3],
        *hist_g.stride()[:3],
        *coef.stride()[:3],
        H=H,
        HV=HV,
        K=K,
        V=V,
        GK=GK,
        L=L,
        WMAX=WMAX,
        BK=BK,
        BG=triton.next_power_of_2(GK),
        BL=BL,
        BW=max(min_rows, triton.next_power_of_2(WMAX)),
        BVF=16 if ssm.is_cuda else BV,
        num_warps=prepare_num_warps(GK) if ssm.is_cuda else 1,
        num_stages=1,
    )
    replay_forward_kernel[(triton.cdiv(V, BV), N, HV)](
        v,
        ssm,
        hist_u,
        cursor,
        parity,
        slots,
        widths,
        coef,
        o,
        v.stride(0),
        v.stride(1),
        o.stride(0),
        o.stride(1),
        ssm.stride(0),
        *hist_u.stride()[:3],
        *coef.stride()[:3],
        K=K,
        V=V,
        L=L,
        WMAX=WMAX,
        BK=BK,
        BV=BV,
        BL=BL,
        BWV=max(min_rows, triton.next_power_of_2(WMAX)),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return o


def prepare_num_warps(GK: int) -> int:
    """Warps of the prepare kernel: KDA's per-channel gates (`[L, K]` history gates) need 8 to stay unspilled."""
    return 8 if GK > 1 else 4


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
