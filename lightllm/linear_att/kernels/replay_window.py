"""Replay verify of a window (W > 1) in one launch: read the canonical state S0 and the committed history, write
only the window's records and, on a fold, the state tile this program owns.

One program per (V tile, row, value head), like the W = 1 kernel (`replay_decode.py`). With `h` committed
records in buffer `p`, the window's cumulative gates `r_s = g_1 + ... + g_s` and `G_s = G_h + r_s`, token s
needs the state after the tokens before it, decayed by its own gate:

    Y_s(x) = S_h^T (e^{r_s} x) + sum_{r<s} u_r ((e^{r_s - r_r} k_hat_r) . x),
    S_h^T (e^{r_s} x) = S0^T (e^{G_s} x) + sum_j u_j (K~_j . e^{r_s} x),       K~_j = e^{G_h - G_j} k_hat_j
    u_s = beta_s (v_s - Y_s(k_hat_s)),        o_s = Y_s(q_hat_s) + u_s (k_hat_s . q_hat_s)

Every weight is a forward decay e^{<= 0} (per channel for KDA): no e^{-G} is formed. The in-window terms are
solved in block form, with no token loop, by both schedules: the pair matrices B_k[s, r] = (e^{r_s - r_r} k_hat_r)
. k_hat_s (r < s) and B_q (r <= s) as one broadcast product each, u = (I + diag(beta) B_k)^{-1} diag(beta)
(v - Y_S(k_hat)) with the unit lower triangular inverse by repeated squaring (`common.unit_lower_inverse`), and
o = Y_S(q_hat) + B_q u, all fp32. On the GPU a program's time follows the number of cross-thread reductions it
runs (each ends in shuffles and, across warps, a shared-memory exchange and a barrier), so everything per-row
(l2norms, pairs, the solve) is one block operation for the whole window.

The projection mode picks how the state part Y_S = S_h^T (e^{r_s} x) is formed (`docs/state_modes.md` §2):
- "inline": S_h is built in registers (e^{G_h} S0 plus the committed records, the fold's own fp32 FMAs, and
  stored rounded only when the window folds), then contracted token by token: one reduction of the tile per token
  and vector, on the raw rows (KDA: decayed per channel), the l2norm factors and GDN's one decay per head applied
  to the `[BW, BV]` results;
- "precompute": S0 and the records against the whole window at once as tensor-core products: the window's key
  and query rows stacked into one `[2 BW, K]` operand (zero rows pad it to the 16 a product needs), in tf32x3 on
  the GPU (three TF32 products, ~fp32 accuracy; plain TF32 would put 1e-3 errors into u and hence the state).
  An fp32 ("ieee") `tl.dot` is no option: Triton lowers it to FMAs that read both operands from shared memory,
  which makes the kernel L1-bound (`test/benchmark/results/h200_profile_models_serving.md`). On the H200 precompute is still ~2.5x slower than
  inline at every launch config timed (`docs/benchmarks.md`), so inline is the default.

Rows past a row's width are zero (g = 0, beta = 0), write no record and store o = 0. A fold (`common.replay_folds`):
each program writes S_h of its own columns rounded once to the state dtype and continues from it with an empty
history; records go to positions 0..W-1 of buffer `1 - p`, which no reader in the launch reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightllm.linear_att.bundles import ReplayBuffers, TokenInputs
from lightllm.linear_att.kernels.common import (
    BATCH_VARYING_ARGS,
    commit_fold,
    cumsum_rows,
    first_half_rows,
    fold_if_full,
    fold_tile_from_records,
    gate_activation,
    history_weights,
    program_heads,
    replay_folds,
    sigmoid,
    small_matmul,
    stack_rows,
    tile_offsets,
    unit_lower_inverse,
)
from lightllm.linear_att.kernels.launch import state_shape, verify_launch_args


@triton.jit
def window_gate_sums(
    p_g, stride_g_w, m_w, o_w, o_g, m_g, b_a_log, b_dt_bias, lower_bound, USE_LOWER_BOUND: tl.constexpr
):
    """The window's cumulative log decays `r_s = g_1 + ... + g_s` as one `[BW, BG]` block (rows past the width
    zero): one gate activation per row and channel. `p_g` points at the row's first token's raw gates."""
    m_wg = m_w[:, None] & m_g[None, :]
    b_gw = tl.load(p_g + o_w[:, None] * stride_g_w + o_g[None, :], mask=m_wg, other=0).to(tl.float32)
    b_gw = gate_activation(b_gw, b_a_log, b_dt_bias[None, :], lower_bound, USE_LOWER_BOUND)
    return cumsum_rows(tl.where(m_wg, b_gw, 0.0))


@triton.heuristics({"USE_LOWER_BOUND": lambda args: args["lower_bound"] is not None})
@triton.jit(do_not_specialize=BATCH_VARYING_ARGS)
def replay_window_kernel(
    tokens,
    state,
    slots,
    widths,
    o,
    scale,
    lower_bound,
    token_strides,
    o_strides,
    state_strides,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    GK: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BG: tl.constexpr,
    L: tl.constexpr,
    WMAX: tl.constexpr,
    BL: tl.constexpr,
    BW: tl.constexpr,
    LOG2_BW: tl.constexpr,
    DOT_PAD: tl.constexpr,
    PRECOMPUTE: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr,
):
    q, k, v, graw, braw, A_log, dt_bias = tokens
    stride_q_n, stride_q_w, stride_v_n, stride_v_w, stride_g_n, stride_g_w, stride_b_n, stride_b_w = token_strides
    ssm, hist_k, hist_u, hist_g, cursor, parity = state
    (
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
    ) = state_strides
    i_v, i_n, i_hv, i_h = program_heads(H, HV)
    width = tl.load(widths + i_n)
    live = width > 0
    slot = tl.load(slots + i_n).to(tl.int64)

    tile = tile_offsets(i_v, K, V, GK, BK, BV, BG)
    o_k, m_k, o_v, m_v, o_g, m_g, m_kv = tile
    o_w = tl.arange(0, BW)

    # issued before the cursor: the state tile is in flight while the cursor and the records come
    p_s = ssm + slot * stride_ssm_s + i_hv * K * V + o_k[:, None] * V + o_v[None, :]
    b_s_raw = tl.load(p_s, mask=m_kv & live, other=0)  # [BK, BV] state dtype
    b_a_log = tl.load(A_log + i_hv).to(tl.float32)
    b_dt_bias = tl.load(dt_bias + i_hv * GK + o_g, mask=m_g, other=0).to(tl.float32)

    h = tl.load(cursor + slot, mask=live, other=0)
    par = tl.load(parity + slot, mask=live, other=0).to(tl.int64)
    fold = live & replay_folds(h, width, L)
    p_hk = hist_k + slot * stride_hk_s + par * stride_hk_b + i_h * K
    p_hu = hist_u + slot * stride_hu_s + par * stride_hu_b + i_hv * V
    p_hg = hist_g + slot * stride_hg_s + par * stride_hg_b + i_hv * GK
    history = (p_hk, p_hg, p_hu, stride_hk_l, stride_hg_l, stride_hu_l)

    # the window as blocks, rows >= width zero: raw q, k [BW, BK], v [BW, BV], beta [BW]
    p_q0 = i_n * stride_q_n + i_h * K
    p_v0 = i_n * stride_v_n + i_hv * V
    p_g0 = i_n * stride_g_n + i_hv * GK
    p_b0 = i_n * stride_b_n + i_hv
    m_w = live & (o_w < width)
    m_wk = m_w[:, None] & m_k[None, :]
    p_wk = p_q0 + o_w[:, None] * stride_q_w + o_k[None, :]
    b_qw = tl.load(q + p_wk, mask=m_wk, other=0).to(tl.float32)
    b_kw = tl.load(k + p_wk, mask=m_wk, other=0).to(tl.float32)
    b_vw = tl.load(v + p_v0 + o_w[:, None] * stride_v_w + o_v[None, :], mask=m_w[:, None] & m_v[None, :], other=0)
    b_vw = b_vw.to(tl.float32)
    b_bw = tl.where(m_w, sigmoid(tl.load(braw + p_b0 + o_w * stride_b_w, mask=m_w, other=0).to(tl.float32)), 0.0)
    # l2norm factors of every row (applied to the rows and, in the inline schedule, after the contractions)
    b_nq = scale / tl.sqrt(tl.sum(b_qw * b_qw, 1) + 1e-6)  # [BW]
    b_nk = 1.0 / tl.sqrt(tl.sum(b_kw * b_kw, 1) + 1e-6)

    b_s = b_s_raw.to(tl.float32)
    if PRECOMPUTE:
        # S0 and the committed history against every window row at once, as tensor-core products
        o_l = tl.arange(0, BL)
        m_l = live & (o_l < h)
        b_hk = tl.load(p_hk + o_l[:, None] * stride_hk_l + o_k[None, :], mask=m_l[:, None] & m_k[None, :], other=0)
        b_hg = tl.load(p_hg + o_l[:, None] * stride_hg_l + o_g[None, :], mask=m_l[:, None] & m_g[None, :], other=0)
        b_hu = tl.load(p_hu + o_l[:, None] * stride_hu_l + o_v[None, :], mask=m_l[:, None] & m_v[None, :], other=0)
        b_hkw, b_gh = history_weights(b_hk, b_hg, m_l, h)  # [BL, BK] K~_j, [BG] G_h
        b_s, b_hkw, b_hu, b_gh, h, buf = fold_if_full(fold, b_s, b_hkw, b_hu, b_gh, p_s, history, h, par, tile)
        b_rw = window_gate_sums(
            graw + p_g0, stride_g_w, m_w, o_w, o_g, m_g, b_a_log, b_dt_bias, lower_bound, USE_LOWER_BOUND
        )
        b_qw = b_qw * b_nq[:, None]
        b_kw = b_kw * b_nk[:, None]
        # a_s(x) = e^{r_s} x, keys and queries stacked into one [2 BW, K] operand
        b_er = tl.exp(b_rw)
        b_a = stack_rows(b_kw * b_er, b_qw * b_er)  # [2 BW, BK]
        for _ in tl.static_range(DOT_PAD):  # zero rows up to the 16 a tensor-core product needs
            b_a = stack_rows(b_a, tl.zeros_like(b_a))
        b_c = tl.dot(b_a, tl.trans(b_hkw), input_precision=PRECISION)  # [2 BW 2^DOT_PAD, BL] K~_j . a_s(x)
        b_y = tl.dot(b_a * tl.exp(b_gh)[None, :], b_s, input_precision=PRECISION)
        b_y += tl.dot(b_c, b_hu, input_precision=PRECISION)  # [2 BW 2^DOT_PAD, BV]
        for _ in tl.static_range(DOT_PAD):
            b_y = first_half_rows(b_y)
        b_yk, b_yq = tl.split(tl.permute(tl.reshape(b_y, (2, BW, BV)), (1, 2, 0)))  # [BW, BV] each
    else:
        # S_h in registers (e^{G_h} S0 plus the committed records, fp32 FMAs: the fold's own arithmetic), stored
        # rounded only when the window folds; then one contraction of the tile per token and vector, on the raw
        # rows (the l2norm factors, and for GDN the decay, are applied to the [BW, BV] results)
        b_gh = tl.load(p_hg + (h - 1) * stride_hg_l + o_g, mask=m_g & (h > 0), other=0)  # G_h
        b_s = fold_tile_from_records(b_s, b_gh, history, h, tile)
        b_s, h, buf = commit_fold(fold, b_s, p_s, m_kv, h, par)
        b_gh = tl.where(fold, 0.0, b_gh)
        b_yk = tl.zeros([BW, BV], dtype=tl.float32)
        b_yq = tl.zeros([BW, BV], dtype=tl.float32)
        if BG == 1:
            # GDN: the window's gates as one block (one activation per row, not one per thread and token); the
            # decays scale the results after the loop
            b_rw = window_gate_sums(
                graw + p_g0, stride_g_w, m_w, o_w, o_g, m_g, b_a_log, b_dt_bias, lower_bound, USE_LOWER_BOUND
            )
        else:
            # KDA: per-channel gates token by token in the rows' layout (a block here would cost a layout change
            # of each row's decays: more instructions, `sass_mix_linear_att.py`)
            b_rw = tl.zeros([BW, BG], dtype=tl.float32)
            b_r = tl.zeros([BG], dtype=tl.float32)
        for s in tl.static_range(WMAX):
            act = live & (s < width)
            b_krow = tl.load(k + p_q0 + s * stride_q_w + o_k, mask=m_k & act, other=0).to(tl.float32)
            b_qrow = tl.load(q + p_q0 + s * stride_q_w + o_k, mask=m_k & act, other=0).to(tl.float32)
            m_s = (o_w == s)[:, None]
            if BG > 1:  # per-channel decays (KDA) ride on the rows
                b_g = tl.load(graw + p_g0 + s * stride_g_w + o_g, mask=m_g, other=0).to(tl.float32)
                b_g = gate_activation(b_g, b_a_log, b_dt_bias, lower_bound, USE_LOWER_BOUND)
                b_r += tl.where(act & m_g, b_g, 0.0)
                b_rw = tl.where(m_s, b_r[None, :], b_rw)
                b_er = tl.exp(b_r)
                b_krow = b_krow * b_er
                b_qrow = b_qrow * b_er
            b_yk = tl.where(m_s, tl.sum(b_s * b_krow[:, None], 0)[None, :], b_yk)
            b_yq = tl.where(m_s, tl.sum(b_s * b_qrow[:, None], 0)[None, :], b_yq)
        b_qw = b_qw * b_nq[:, None]
        b_kw = b_kw * b_nk[:, None]
        if BG > 1:
            b_yk = b_yk * b_nk[:, None]
            b_yq = b_yq * b_nq[:, None]
        else:  # one decay per head (GDN) scales the result rows with the l2norm factors: BW x BV products, not K
            b_yk = b_yk * (b_nk[:, None] * tl.exp(b_rw))
            b_yq = b_yq * (b_nq[:, None] * tl.exp(b_rw))

    # the window's own terms in block form: pairs (e^{r_s - r_r} k_hat_r) . x_s for r <= s (per-channel forward
    # decays), u = (I + diag(beta) B_k)^{-1} diag(beta) (v - Y(k_hat)), o = Y(q_hat) + B_q u; all fp32
    m_le = o_w[:, None] >= o_w[None, :]  # [BW (s), BW (r)]
    b_dec = tl.exp(tl.where(m_le[:, :, None], b_rw[:, None, :] - b_rw[None, :, :], 0.0))  # [BW, BW, BG]
    b_kr = b_kw[None, :, :] * b_dec  # [BW, BW, BK]
    b_bk = tl.where(o_w[:, None] > o_w[None, :], tl.sum(b_kr * b_kw[:, None, :], 2), 0.0)  # strictly lower
    b_bq = tl.where(m_le, tl.sum(b_kr * b_qw[:, None, :], 2), 0.0)  # lower, with the diagonal k_hat_s . q_hat_s
    b_t = unit_lower_inverse(b_bw[:, None] * b_bk, LOG2_BW)
    b_u = small_matmul(b_t, b_bw[:, None] * (b_vw - b_yk))  # [BW, BV]
    b_o = b_yq + small_matmul(b_bq, b_u)

    stride_o_n, stride_o_w = o_strides
    p_o = o + i_n * stride_o_n + o_w[:, None] * stride_o_w + i_hv * V + o_v[None, :]
    tl.store(p_o, tl.where(m_w[:, None], b_o, 0.0).to(o.dtype.element_ty), mask=(o_w < WMAX)[:, None] & m_v[None, :])
    # records at h..h+W-1 of buffer `buf` (one writer each: u per V tile, G per value head, k_hat per key group)
    m_rec = m_w[:, None]
    p_ru = hist_u + slot * stride_hu_s + buf * stride_hu_b + (h + o_w[:, None]) * stride_hu_l + i_hv * V
    tl.store(p_ru + o_v[None, :], b_u, mask=m_rec & m_v[None, :])
    first_tile = i_v == 0
    p_rg = hist_g + slot * stride_hg_s + buf * stride_hg_b + (h + o_w[:, None]) * stride_hg_l + i_hv * GK
    tl.store(p_rg + o_g[None, :], b_gh[None, :] + b_rw, mask=m_rec & first_tile & m_g[None, :])
    key_owner = first_tile & (i_hv % (HV // H) == 0)
    p_rk = hist_k + slot * stride_hk_s + buf * stride_hk_b + (h + o_w[:, None]) * stride_hk_l + i_h * K
    tl.store(p_rk + o_k[None, :], b_kw, mask=m_rec & key_owner & m_k[None, :])


def window_blocks(wmax: int, precompute: bool, on_gpu: bool) -> tuple[int, int]:
    """(BW, DOT_PAD): the window block's rows and how many times precompute doubles its stacked `[2 BW, K]`
    operand with zero rows. On the GPU a tensor-core product needs 16 rows, and window blocks have at least 4 rows
    (Triton 3.6 gives wrong results for 2-row blocks; `test_replay_short_windows_match_twin` checks W = 1..3 on the
    GPU); the interpreter keeps blocks minimal."""
    bw = max(4 if on_gpu else 1, triton.next_power_of_2(wmax))
    dot_pad = max(0, (16 // (2 * bw)).bit_length() - 1) if on_gpu and precompute else 0
    return bw, dot_pad


def replay_window_triton(
    tokens: TokenInputs,
    state: ReplayBuffers,
    slots,
    widths,
    *,
    block_v: int,
    num_warps: int,
    num_stages: int,
    projection: str,
) -> torch.Tensor:
    """The W > 1 case of `replay_verify_triton` (inputs already checked there), either projection. Returns o
    `[N, Wmax, HV, V]`, zeros past each row's width."""
    N, WMAX, H, K = tokens.q.shape
    HV, V = tokens.v.shape[2:]
    GK, L, on_gpu = tokens.graw.shape[-1], state.replay_capacity, state.ssm.is_cuda
    o = torch.empty_like(tokens.v)
    if N == 0:
        return o
    precompute = projection == "precompute"
    BW, dot_pad = window_blocks(WMAX, precompute, on_gpu)
    least_records = 16 if on_gpu and precompute else 1  # the records' side of the tensor-core products
    replay_window_kernel[(triton.cdiv(V, block_v), N, HV)](
        *verify_launch_args(tokens, state.pointers, state.strides, slots, widths, o),
        **state_shape(H, HV, K, V, GK, block_v),
        L=L,
        WMAX=WMAX,
        BL=max(least_records, triton.next_power_of_2(L)),
        BW=BW,
        LOG2_BW=BW.bit_length() - 1,
        DOT_PAD=dot_pad,
        PRECOMPUTE=precompute,
        PRECISION="tf32x3" if on_gpu else "ieee",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return o
