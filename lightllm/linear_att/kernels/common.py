"""Shared `@triton.jit` building blocks of the linear-attention kernels (GDN and KDA alike).

Every kernel calls these, so the preprocessing (l2norm, gate, beta) and the per-token delta-rule step are the same
instructions in every mode: native and compact (its verify and its merge of pending records) are bitwise equal
because they share `delta_rule_step` / `add_rank_one`, and every replay fold (in the verify kernels and
standalone) is `fold_tile_from_records`.

Gate width `BG` is 1 for GDN (one gate per value head, broadcast over the K rows) and `BK` for KDA.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Kernel arguments that are slices of a step's packed per-row metadata, at offsets that vary with the batch, or
# counts of its rows. A compiled launch specialises on an integer being 1 or a multiple of 16 and on a pointer
# being 16-byte aligned, so each would compile a new variant in the middle of a serving step whenever the batch
# changes; every kernel passes this to `triton.jit(do_not_specialize=...)` (names it lacks are ignored).
BATCH_VARYING_ARGS = ("slots", "widths", "accepted", "conv_offset", "cu_seqlens", "has_initial_state", "N")


@triton.jit
def program_heads(H: tl.constexpr, HV: tl.constexpr):
    """(V tile, row, value head, key head) of a program of a one-layer launch over the grid (V tiles, rows, value
    heads); the value heads of a key head are consecutive."""
    i_v, i_n, i_hv = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    return i_v, i_n, i_hv, i_hv // (HV // H)


@triton.jit
def layer_program_heads(H: tl.constexpr, HV: tl.constexpr):
    """(V tile, row, layer, value head, key head) of a program of a launch over a stack of layers, grid (V tiles,
    rows, layers x value heads)."""
    i_v, i_n, i_lhv = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    i_l, i_hv = i_lhv // HV, i_lhv % HV
    return i_v, i_n, i_l, i_hv, i_hv // (HV // H)


@triton.jit
def tile_offsets(
    i_v, K: tl.constexpr, V: tl.constexpr, GK: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BG: tl.constexpr
):
    """A program's place in one head, as one tuple the building blocks below take (`tile`): offsets and masks of
    the keys `o_k, m_k [BK]`, of its V tile `o_v, m_v [BV]` (tile `i_v`), of the gate channels `o_g, m_g [BG]`,
    and the mask `m_kv` of its `[BK, BV]` state tile."""
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_g = tl.arange(0, BG)
    m_k, m_v, m_g = o_k < K, o_v < V, o_g < GK
    return o_k, m_k, o_v, m_v, o_g, m_g, m_k[:, None] & m_v[None, :]


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def softplus(x):
    # threshold 20 like torch.nn.functional.softplus; clamp the exp argument so the unused lane cannot overflow
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def l2norm(b_x):
    """`x / sqrt(sum(x^2) + 1e-6)` of a 1-D fp32 block."""
    return b_x / tl.sqrt(tl.sum(b_x * b_x, 0) + 1e-6)


@triton.jit
def gate_activation(b_graw, b_a_log, b_dt_bias, lower_bound, USE_LOWER_BOUND: tl.constexpr):
    """Log decay g <= 0 from the raw gate logits (fp32, any block shape broadcastable with `b_dt_bias`)."""
    b_x = b_graw + b_dt_bias
    if USE_LOWER_BOUND:
        # KDA's bounded ("safe") gate: g in (lower_bound, 0)
        return lower_bound * sigmoid(tl.exp(b_a_log) * b_x)
    else:
        return -tl.exp(b_a_log) * softplus(b_x)


@triton.jit
def add_rank_one(b_s, b_k, b_u):
    """`S + k uᵀ` on a `[BK, BV]` tile: the update of a verified token and of a merged compact record alike, as one
    explicit fused multiply-add per element. Left to itself the compiler fuses whichever product has a single use:
    `k u` in the verify (the decayed tile also feeds `Sᵀ k`), possibly the decay product in the merge; the explicit
    form gives both the same rounding, so a merged state is native's bit for bit."""
    b_kk, b_uu = tl.broadcast(b_k[:, None], b_u[None, :])
    return tl.fma(b_kk, b_uu, b_s)


@triton.jit
def round_like(b_s, p_s):
    """The fp32 tile rounded to the element type of `p_s` (the state's storage dtype), back in fp32."""
    return b_s.to(p_s.dtype.element_ty).to(tl.float32)


@triton.jit
def delta_rule_step(b_s, b_k, b_v, b_decay, b_beta):
    """One token of the gated delta rule on a `[BK, BV]` fp32 state tile.

    `b_k [BK]` normalised key, `b_v [BV]`, `b_decay` = e^g (`[1]` for GDN, `[BK]` for KDA), `b_beta` scalar.
    S <- diag(e^g) S;  u = beta (v - S^T k);  S <- S + k u^T.  Returns the new tile (not rounded) and `u [BV]`.
    """
    b_s = b_s * b_decay[:, None]
    b_u = b_beta * (b_v - tl.sum(b_s * b_k[:, None], 0))
    return add_rank_one(b_s, b_k, b_u), b_u


@triton.jit
def load_token(
    p_q,
    p_k,
    p_v,
    p_graw,
    p_braw,
    b_a_log,
    b_dt_bias,
    lower_bound,
    scale,
    tile,
    USE_LOWER_BOUND: tl.constexpr,
):
    """Load and preprocess one window token: returns (q_hat * scale, k_hat, v, g, beta) in fp32.

    `p_*` point at the token's head rows; `tile` is `tile_offsets`'.
    """
    o_k, m_k, o_v, m_v, o_g, m_g, _ = tile
    b_q = tl.load(p_q + o_k, mask=m_k, other=0).to(tl.float32)  # [BK]
    # the key stays in its input dtype until every load of the token is issued: converted at its load, it makes the
    # compiler schedule the serial kernel's token loop measurably worse on sm_90, in native and compact verify alike
    # (test/benchmark/results/h200_linear_att_before_after.md)
    b_kr = tl.load(p_k + o_k, mask=m_k, other=0)  # [BK]
    b_v = tl.load(p_v + o_v, mask=m_v, other=0).to(tl.float32)  # [BV]
    b_graw = tl.load(p_graw + o_g, mask=m_g, other=0).to(tl.float32)  # [BG]
    b_g = gate_activation(b_graw, b_a_log, b_dt_bias, lower_bound, USE_LOWER_BOUND)
    b_beta = sigmoid(tl.load(p_braw).to(tl.float32))
    b_q = l2norm(b_q) * scale
    b_k = l2norm(b_kr.to(tl.float32))
    return b_q, b_k, b_v, b_g, b_beta


@triton.jit
def cumsum_rows(b_x):
    """Inclusive prefix sum over the rows of a small `[BW, X]` block, one row at a time. `tl.cumsum` over a
    `[BW, 1]` block (GDN's one gate per head) fails to lower on sm_90 with Triton 3.6 once the launch specialises
    the pointers (`test/benchmark/registers_linear_att.py` compiles it), so the window kernels use this."""
    o_w = tl.arange(0, b_x.shape[0])
    b_acc = tl.zeros([b_x.shape[1]], dtype=tl.float32)
    b_out = tl.zeros(b_x.shape, dtype=tl.float32)
    for t in tl.static_range(b_x.shape[0]):
        b_acc += tl.sum(tl.where((o_w == t)[:, None], b_x, 0.0), 0)
        b_out = tl.where((o_w == t)[:, None], b_acc[None, :], b_out)
    return b_out


@triton.jit
def history_weights(b_hk, b_hg, m_l, h):
    """Forward-decayed committed keys of one replay history.

    b_hk `[BL, BK]` k_hat_j, b_hg `[BL, BG]` cumulative gates G_j, m_l `[BL]` committed-record mask, h the count.
    Returns (K~ `[BL, BK]` = e^{G_h - G_j} * k_hat_j (zero past h), G_h `[BG]`, zero when h == 0). Every weight is
    e^{<= 0}: the forward form never overflows.
    """
    o_l = tl.arange(0, b_hk.shape[0])
    b_gh = tl.sum(tl.where((o_l == h - 1)[:, None], b_hg, 0.0), 0)  # [BG]
    b_w = tl.exp(tl.where(m_l[:, None], b_gh[None, :] - b_hg, 0.0))  # [BL, BG]
    return tl.where(m_l[:, None], b_hk * b_w, 0.0), b_gh


@triton.jit
def project_token(b_s, b_hu, b_hkw, b_x, b_eG, b_er):
    """`S_h^T (e^{r} x)` through the replay identity, without forming S_h: `S0^T (e^{G} x) + sum_j u_j (K~_j . e^{r} x)`
    on one `[BK, BV]` tile. b_s the S0 tile, b_hu `[BL, BV]` committed u_j, b_hkw `[BL, BK]` K~_j (zero past h), b_x
    `[BK]`, b_eG = e^{G_h + r} and b_er = e^{r} (`[BG]`: `[1]` for GDN, `[BK]` for KDA). fp32 FMAs, reductions over
    the K rows. Returns `[BV]`."""
    b_c = tl.sum(b_hkw * (b_x * b_er)[None, :], 1)  # [BL] weight of each committed record
    return tl.sum(b_s * (b_x * b_eG)[:, None], 0) + tl.sum(b_hu * b_c[:, None], 0)


@triton.jit
def _load_record(history, j, h, tile):
    """Record j of a history buffer: (k_hat_j `[BK]`, G_j `[BG]`, u_j `[BV]`), zeros when j >= h."""
    p_hk, p_hg, p_hu, stride_l, stride_gl, stride_ul = history
    o_k, m_k, o_v, m_v, o_g, m_g, _ = tile
    b_k = tl.load(p_hk + j * stride_l + o_k, mask=m_k & (j < h), other=0)
    b_g = tl.load(p_hg + j * stride_gl + o_g, mask=m_g & (j < h), other=0)
    b_u = tl.load(p_hu + j * stride_ul + o_v, mask=m_v & (j < h), other=0)
    return b_k, b_g, b_u


@triton.jit
def fold_tile_from_records(b_s, b_gh, history, h, tile):
    """S_h = diag(e^{G_h}) S_0 + sum_j (e^{G_h - G_j} k_hat_j) u_j^T on one `[BK, BV]` fp32 tile, streaming the `h`
    records in order (fp32 FMAs, no registers beyond the tile and two prefetched records). `history` = (p_hk, p_hg,
    p_hu, and their record strides): pointers at record 0 of one buffer (key head / value head / value head);
    `b_gh [BG]` is G_h; `tile` is `tile_offsets`'."""
    b_s = b_s * tl.exp(b_gh)[:, None]
    # two records per loop step: one loop overhead per pair, and the next pair loads while this one is added. A
    # missing second record (odd h) loads as zeros and adds exactly 0, so the sum is the same one-by-one sum.
    b_ka, b_ga, b_ua = _load_record(history, 0, h, tile)
    b_kb, b_gb, b_ub = _load_record(history, 1, h, tile)
    for j in range(0, h, 2):
        b_kc, b_gc, b_uc = _load_record(history, j + 2, h, tile)
        b_kd, b_gd, b_ud = _load_record(history, j + 3, h, tile)
        b_s += (b_ka * tl.exp(b_gh - b_ga))[:, None] * b_ua[None, :]
        b_s += (b_kb * tl.exp(b_gh - b_gb))[:, None] * b_ub[None, :]
        b_ka, b_ga, b_ua, b_kb, b_gb, b_ub = b_kc, b_gc, b_uc, b_kd, b_gd, b_ud
    return b_s


@triton.jit
def store_rounded(b_s, p_s, m_kv):
    """Store a folded fp32 tile rounded once to the state dtype; return the rounded value in fp32 (what the window
    continues from, and what every later read of the state sees)."""
    b_sr = b_s.to(p_s.dtype.element_ty)
    tl.store(p_s, b_sr, mask=m_kv)
    return b_sr.to(tl.float32)


@triton.jit
def replay_folds(h, width, L):
    """The replay fold rule: a row of width `width` over `h` committed records folds iff its records would not fit
    in the replay_capacity `L`. The verify kernels and the accept kernel decide with this one function; the torch side
    (`torch_ops/replay.replay_folds`) is its twin."""
    return h + width > L


@triton.jit
def commit_fold(fold, b_s, p_s, m_kv, h, par):
    """The end of a replay verify's fold of one `[BK, BV]` tile that holds S_h: when `fold`, store it rounded once
    to the state dtype and continue from the rounded value. Returns (tile, the cursor the window's records start
    at, the history buffer they go to)."""
    if fold:
        b_s = store_rounded(b_s, p_s, m_kv)
    return b_s, tl.where(fold, 0, h), tl.where(fold, 1 - par, par)


@triton.jit
def fold_if_full(fold, b_s, b_hkw, b_hu, b_gh, p_s, history, h, par, tile):
    """The replay kernels' on-device fold of one `[BK, BV]` tile that holds S0 and contracts the history through
    its weights. When `fold`, S_h replaces the tile (`commit_fold`) and the history becomes empty. Returns (tile,
    history weights `[BL, BK]`, history u `[BL, BV]`, G_h `[BG]`, the cursor the window's records start at, the
    history buffer they go to)."""
    if fold:
        b_s = fold_tile_from_records(b_s, b_gh, history, h, tile)
        b_hkw = tl.zeros(b_hkw.shape, dtype=tl.float32)
        b_hu = tl.zeros(b_hu.shape, dtype=tl.float32)
        b_gh = tl.zeros(b_gh.shape, dtype=tl.float32)
    b_s, h, buf = commit_fold(fold, b_s, p_s, tile[6], h, par)
    return b_s, b_hkw, b_hu, b_gh, h, buf


@triton.jit
def stack_rows(b_a, b_b):
    """`[R, X]` and `[R, X]` -> `[2 R, X]` (rows of `b_a`, then rows of `b_b`)."""
    return tl.reshape(tl.permute(tl.join(b_a, b_b), (2, 0, 1)), (2 * b_a.shape[0], b_a.shape[1]))


@triton.jit
def first_half_rows(b_x):
    """`[2 R, X]` -> its first R rows (the inverse of `stack_rows`)."""
    b_top, _ = tl.split(tl.permute(tl.reshape(b_x, (2, b_x.shape[0] // 2, b_x.shape[1])), (1, 2, 0)))
    return b_top


@triton.jit
def small_matmul(b_a, b_b):
    """`[R, S] x [S, X]` for small R, S (window blocks) as fp32 FMAs: a broadcast product summed over S."""
    return tl.sum(b_a[:, :, None] * b_b[None, :, :], 1)


@triton.jit
def unit_lower_inverse(b_n, LOG2_R: tl.constexpr):
    """`(I + N)^{-1}` of a strictly lower triangular `[R, R]` block N (R = 2^LOG2_R), so N^R = 0 and
    `(I + N)^{-1} = (I - N)(I + N^2)(I + N^4)...`: LOG2_R - 1 squarings, fp32 FMAs, no serial row loop."""
    o_r = tl.arange(0, b_n.shape[0])
    b_eye = (o_r[:, None] == o_r[None, :]).to(tl.float32)
    b_m = -b_n
    b_inv = b_eye + b_m
    for _ in tl.static_range(1, LOG2_R):
        b_m = small_matmul(b_m, b_m)
        b_inv = b_inv + small_matmul(b_inv, b_m)
    return b_inv


__all__ = [
    "cumsum_rows",
    "first_half_rows",
    "add_rank_one",
    "delta_rule_step",
    "commit_fold",
    "fold_if_full",
    "fold_tile_from_records",
    "gate_activation",
    "history_weights",
    "l2norm",
    "load_token",
    "project_token",
    "replay_folds",
    "round_like",
    "sigmoid",
    "small_matmul",
    "softplus",
    "stack_rows",
    "store_rounded",
    "unit_lower_inverse",
]
