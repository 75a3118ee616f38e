"""Replay plain decode (W = 1) in one launch: read the canonical state S0 and the committed history, write only the
new record and, on a fold, the state tile this program owns.

One program per (V tile, row, value head). With `h = cursor[slot]` committed records in buffer `p = parity[slot]`
and the token's cumulative gate `G = G_h + g`:

    u = beta (v - S0^T (e^G k_hat) - sum_j u_j c_j(k_hat)),    c_j(x) = (e^{G_h - G_j} k_hat_j) . (e^g x)
    o = S0^T (e^G q_hat) + sum_j u_j c_j(q_hat) + u (k_hat . q_hat)

so S0 is contracted with two vectors and never written, and the history adds `h` fp32 rows of the tile's columns.
The per-(row, head) scalars (l2norm, gates, history weights) are recomputed by each V tile from L2: cheaper than
a second launch and a coefficient round trip through memory.

Fold, decided per row on the device (`common.replay_folds` at width 1): each program rebuilds S_h on its own `[K, BV]` columns as
`e^{G_h} S0 + sum_j (e^{G_h - G_j} k_hat_j) u_j^T` (fp32 FMAs, records streamed one by one, so the fold costs no
registers beyond the tile), writes it rounded to the state dtype and continues from the rounded value with an
empty history. Only this program reads those columns, and the record goes to position 0 of buffer `1 - p`
while every reader in the launch reads buffer `p`, so no program overwrites what another still reads. The
cursor kernel applies the same predicate after the step (`kernels/cursor.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightllm.linear_att.bundles import ReplayBuffers, TokenInputs
from lightllm.linear_att.kernels.common import (
    BATCH_VARYING_ARGS,
    fold_if_full,
    gate_activation,
    history_weights,
    l2norm,
    program_heads,
    project_token,
    replay_folds,
    sigmoid,
    tile_offsets,
)
from lightllm.linear_att.kernels.launch import state_shape, verify_launch_args


@triton.heuristics({"USE_LOWER_BOUND": lambda args: args["lower_bound"] is not None})
@triton.jit(do_not_specialize=BATCH_VARYING_ARGS)
def replay_decode_kernel(
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
    BL: tl.constexpr,
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
    live = tl.load(widths + i_n) > 0
    slot = tl.load(slots + i_n).to(tl.int64)

    tile = tile_offsets(i_v, K, V, GK, BK, BV, BG)
    o_k, m_k, o_v, m_v, o_g, m_g, m_kv = tile
    o_l = tl.arange(0, BL)

    # issued before the cursor: the state tile and the token are in flight while the cursor and the records come
    p_s = ssm + slot * stride_ssm_s + i_hv * K * V + o_k[:, None] * V + o_v[None, :]
    b_s_raw = tl.load(p_s, mask=m_kv & live, other=0)  # [BK, BV] state dtype
    b_qr = tl.load(q + i_n * stride_q_n + i_h * K + o_k, mask=m_k, other=0)
    b_kr = tl.load(k + i_n * stride_q_n + i_h * K + o_k, mask=m_k, other=0)
    b_vr = tl.load(v + i_n * stride_v_n + i_hv * V + o_v, mask=m_v, other=0)
    b_gr = tl.load(graw + i_n * stride_g_n + i_hv * GK + o_g, mask=m_g, other=0)
    b_br = tl.load(braw + i_n * stride_b_n + i_hv)
    b_a_log = tl.load(A_log + i_hv).to(tl.float32)
    b_dt_bias = tl.load(dt_bias + i_hv * GK + o_g, mask=m_g, other=0).to(tl.float32)

    h = tl.load(cursor + slot, mask=live, other=0)
    par = tl.load(parity + slot, mask=live, other=0).to(tl.int64)
    fold = live & replay_folds(h, 1, L)
    m_l = live & (o_l < h)
    p_hk = hist_k + slot * stride_hk_s + par * stride_hk_b + i_h * K
    p_hu = hist_u + slot * stride_hu_s + par * stride_hu_b + i_hv * V
    p_hg = hist_g + slot * stride_hg_s + par * stride_hg_b + i_hv * GK
    b_hk = tl.load(p_hk + o_l[:, None] * stride_hk_l + o_k[None, :], mask=m_l[:, None] & m_k[None, :], other=0)
    b_hg = tl.load(p_hg + o_l[:, None] * stride_hg_l + o_g[None, :], mask=m_l[:, None] & m_g[None, :], other=0)
    b_hu = tl.load(p_hu + o_l[:, None] * stride_hu_l + o_v[None, :], mask=m_l[:, None] & m_v[None, :], other=0)
    b_hkw, b_gh = history_weights(b_hk, b_hg, m_l, h)  # [BL, BK] e^{G_h - G_j} k_hat_j, [BG] G_h

    b_s = b_s_raw.to(tl.float32)
    history = (p_hk, p_hg, p_hu, stride_hk_l, stride_hg_l, stride_hu_l)
    b_s, b_hkw, b_hu, b_gh, h, buf = fold_if_full(fold, b_s, b_hkw, b_hu, b_gh, p_s, history, h, par, tile)

    # the token
    b_q = l2norm(b_qr.to(tl.float32)) * scale
    b_k = l2norm(b_kr.to(tl.float32))
    b_v = b_vr.to(tl.float32)
    b_g = tl.where(m_g, gate_activation(b_gr.to(tl.float32), b_a_log, b_dt_bias, lower_bound, USE_LOWER_BOUND), 0.0)
    b_beta = sigmoid(b_br.to(tl.float32))
    b_G = b_gh + b_g  # cumulative gate since S0: what the record stores
    b_eg, b_eG = tl.exp(b_g), tl.exp(b_G)

    # S0 contracted with e^G k_hat and e^G q_hat, the history with its weights
    b_u = b_beta * (b_v - project_token(b_s, b_hu, b_hkw, b_k, b_eG, b_eg))  # [BV]
    b_yq = project_token(b_s, b_hu, b_hkw, b_q, b_eG, b_eg)
    b_o = b_yq + b_u * tl.sum(b_k * b_q, 0)

    stride_o_n, _ = o_strides
    tl.store(o + i_n * stride_o_n + i_hv * V + o_v, tl.where(live, b_o, 0.0).to(o.dtype.element_ty), mask=m_v)
    # records (one writer each: u per V tile, G per value head, k_hat per key group)
    tl.store(hist_u + slot * stride_hu_s + buf * stride_hu_b + h * stride_hu_l + i_hv * V + o_v, b_u, mask=m_v & live)
    first_tile = live & (i_v == 0)
    p_rg = hist_g + slot * stride_hg_s + buf * stride_hg_b + h * stride_hg_l + i_hv * GK + o_g
    tl.store(p_rg, b_G, mask=m_g & first_tile)
    key_owner = first_tile & (i_hv % (HV // H) == 0)
    p_rk = hist_k + slot * stride_hk_s + buf * stride_hk_b + h * stride_hk_l + i_h * K + o_k
    tl.store(p_rk, b_k, mask=m_k & key_owner)


def replay_decode_triton(
    tokens: TokenInputs, state: ReplayBuffers, slots, widths, *, block_v: int, num_warps: int, num_stages: int
) -> torch.Tensor:
    """The W = 1 case of `replay_verify_triton` (inputs already checked there). Returns o `[N, 1, HV, V]`."""
    N, _, H, K = tokens.q.shape
    HV, V = tokens.v.shape[2:]
    GK, L = tokens.graw.shape[-1], state.replay_capacity
    o = torch.empty_like(tokens.v)
    if N == 0:
        return o
    replay_decode_kernel[(triton.cdiv(V, block_v), N, HV)](
        *verify_launch_args(tokens, state.pointers, state.strides, slots, widths, o),
        **state_shape(H, HV, K, V, GK, block_v),
        L=L,
        BL=triton.next_power_of_2(L),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return o
