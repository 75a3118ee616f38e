"""The serial decode/verify kernel of native and compact mode, and compact's standalone merge.

Both modes run one kernel body (`serial_verify_kernel`, switched by the constexpr `COMPACT`): a program owns one
(V tile, row, value head), keeps the `[K, BV]` fp32 tile in registers through the window and rounds it to the
storage dtype after every token; outputs are read before that rounding. Sharing the body is what makes compact
bitwise equal to native under the same tiling. Each mode looks its tiling up in its own autotune family ("serial",
"compact": native is bound by its W state writes, compact by its per-token work, so their best tiles differ); an
untuned compact shape borrows native's.

Native (`ssm [S, Wmax, HV, K, V]`, `ssm_index [S]`) reads slot `ssm_index[slot]` and writes the state after token s
into slot s: one read and W writes of the state per step.

Compact (`ssm [S, HV, K, V]`, records `win_k / win_u / win_g [S, 2, Wmax, ...]`, `pending`, `parity [S]`) reads the
state once, merges the `pending` accepted tokens of buffer `parity` (`merge_window_tokens`), writes the merged tile
once, then verifies the new window from registers and records each token's `k̂`, `u` and `g` in buffer
`1 - parity`: one read and one write of the state per step. A record holds what the merge needs and the verify
already computed (the normalised key, the corrected value `u = β (v − Sᵀ k̂)` and the log decay, all fp32), so a
merged token is one decay and one rank-one update of the tile, with no reduction over K: the merge costs a fraction
of a verified token, and it reproduces native's per-token state bit for bit (same fp32 inputs, same update).
Programs of one launch share records (the V tiles of a value head share `g`, the value heads of a key group share
`k̂`), so a launch reads only buffer `parity` and writes only buffer `1 - parity`.

`compact_commit_kernel` (any stack of layers, one launch) runs the same merge standalone: checkpoint export (all
layers, into gathered copies) and prefill (per layer, in place) bring the state up to date with it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightllm.linear_att.bundles import CompactBuffers, NativeBuffers, TokenInputs
from lightllm.linear_att.kernels.common import (
    BATCH_VARYING_ARGS,
    add_rank_one,
    delta_rule_step,
    layer_program_heads,
    load_token,
    program_heads,
    round_like,
    tile_offsets,
)
from lightllm.linear_att.kernels.launch import (
    check_verify_inputs,
    filled_block_v,
    serial_config,
    sm_count,
    state_shape,
    verify_launch_args,
)


@triton.jit
def merge_window_tokens(b_s, p_s, window, num_tokens, tile):
    """Apply the first `num_tokens` records of a window buffer to the fp32 tile `b_s [BK, BV]` and write it.

    Per token: `S <- round(diag(e^g) S + k̂ uᵀ)` (native's update and rounding, the element type of `p_s`). `p_wk /
    p_wu / p_wg` (`window`, with their record strides) point at record 0 of one buffer, at the program's key head /
    value head. The tile at `p_s` is written once, already rounded, only when `num_tokens > 0`. Returns the merged
    fp32 tile.
    """
    p_wk, p_wu, p_wg, stride_wk_w, stride_wu_w, stride_wg_w = window
    o_k, m_k, o_v, m_v, o_g, m_g, m_kv = tile
    for s in range(0, num_tokens):
        b_k = tl.load(p_wk + s * stride_wk_w + o_k, mask=m_k, other=0)  # [BK] k̂
        b_u = tl.load(p_wu + s * stride_wu_w + o_v, mask=m_v, other=0)  # [BV]
        b_g = tl.load(p_wg + s * stride_wg_w + o_g, mask=m_g, other=0)  # [BG]
        b_s = round_like(add_rank_one(b_s * tl.exp(b_g)[:, None], b_k, b_u), p_s)
    tl.store(p_s, b_s.to(p_s.dtype.element_ty), mask=m_kv & (num_tokens > 0))
    return b_s


@triton.heuristics({"USE_LOWER_BOUND": lambda args: args["lower_bound"] is not None})
@triton.jit(do_not_specialize=BATCH_VARYING_ARGS)
def serial_verify_kernel(
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
    WMAX: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr,
    COMPACT: tl.constexpr,
):
    q, k, v, graw, braw, A_log, dt_bias = tokens
    stride_q_n, stride_q_w, stride_v_n, stride_v_w, stride_g_n, stride_g_w, stride_b_n, stride_b_w = token_strides
    stride_o_n, stride_o_w = o_strides
    ssm, ssm_index, win_k, win_u, win_g, pending, parity = state
    (
        stride_ssm_s,
        stride_ssm_w,
        stride_wk_s,
        stride_wk_b,
        stride_wk_w,
        stride_wu_s,
        stride_wu_b,
        stride_wu_w,
        stride_wg_s,
        stride_wg_b,
        stride_wg_w,
    ) = state_strides
    i_v, i_n, i_hv, i_h = program_heads(H, HV)
    width = tl.load(widths + i_n)
    slot = tl.load(slots + i_n).to(tl.int64)

    tile = tile_offsets(i_v, K, V, GK, BK, BV, BG)
    o_k, m_k, o_v, m_v, o_g, m_g, m_kv = tile

    b_a_log = tl.load(A_log + i_hv).to(tl.float32)
    b_dt_bias = tl.load(dt_bias + i_hv * GK + o_g, mask=m_g, other=0).to(tl.float32)  # [BG]
    # padding rows (width 0) never touch the state: every state load and store below is masked off for them
    p_s = ssm + slot * stride_ssm_s + i_hv * K * V + o_k[:, None] * V + o_v[None, :]
    if COMPACT:
        # a padding row merges nothing (its pending tokens wait for the slot's next real verify); the count is
        # clamped to the buffer so a stale value cannot overrun it
        num_pending = tl.where(width > 0, tl.minimum(tl.load(pending + slot), WMAX), 0)
        buf_read = tl.load(parity + slot).to(tl.int64)
        buf_write = 1 - buf_read
        b_s = tl.load(p_s, mask=m_kv & (width > 0), other=0).to(tl.float32)  # [BK, BV]
        window = (
            win_k + slot * stride_wk_s + buf_read * stride_wk_b + i_h * K,
            win_u + slot * stride_wu_s + buf_read * stride_wu_b + i_hv * V,
            win_g + slot * stride_wg_s + buf_read * stride_wg_b + i_hv * GK,
            stride_wk_w,
            stride_wu_w,
            stride_wg_w,
        )
        b_s = merge_window_tokens(b_s, p_s, window, num_pending, tile)
        p_wk = win_k + slot * stride_wk_s + buf_write * stride_wk_b + i_h * K + o_k
        p_wu = win_u + slot * stride_wu_s + buf_write * stride_wu_b + i_hv * V + o_v
        p_wg = win_g + slot * stride_wg_s + buf_write * stride_wg_b + i_hv * GK + o_g
        # single writers of the shared records: the first V tile writes g, the first value head of a key group k̂
        first_tile = i_v == 0
        key_owner = first_tile & (i_hv % (HV // H) == 0)
    else:
        i_src = tl.load(ssm_index + slot, mask=width > 0, other=0).to(tl.int64)
        b_s = tl.load(p_s + i_src * stride_ssm_w, mask=m_kv & (width > 0), other=0).to(tl.float32)  # [BK, BV]

    p_o = o + i_n * stride_o_n + i_hv * V + o_v
    for s in range(0, width):
        b_q, b_k, b_v, b_g, b_beta = load_token(
            q + i_n * stride_q_n + s * stride_q_w + i_h * K,
            k + i_n * stride_q_n + s * stride_q_w + i_h * K,
            v + i_n * stride_v_n + s * stride_v_w + i_hv * V,
            graw + i_n * stride_g_n + s * stride_g_w + i_hv * GK,
            braw + i_n * stride_b_n + s * stride_b_w + i_hv,
            b_a_log,
            b_dt_bias,
            lower_bound,
            scale,
            tile,
            USE_LOWER_BOUND,
        )
        b_s, b_u = delta_rule_step(b_s, b_k, b_v, tl.exp(b_g), b_beta)
        b_o = tl.sum(b_s * b_q[:, None], 0)  # [BV]
        tl.store(p_o + s * stride_o_w, b_o.to(p_o.dtype.element_ty), mask=m_v)
        # round to the storage dtype: the next token (and every later reader) sees exactly the stored state
        b_s = round_like(b_s, p_s)
        if COMPACT:
            tl.store(p_wk + s * stride_wk_w, b_k, mask=m_k & key_owner)
            tl.store(p_wu + s * stride_wu_w, b_u, mask=m_v)
            tl.store(p_wg + s * stride_wg_w, b_g, mask=m_g & first_tile)
        else:
            tl.store(p_s + s * stride_ssm_w, b_s.to(p_s.dtype.element_ty), mask=m_kv)
    for s in range(width, WMAX):
        tl.store(p_o + s * stride_o_w, tl.zeros([BV], dtype=p_o.dtype.element_ty), mask=m_v)


@triton.jit(do_not_specialize=BATCH_VARYING_ARGS)
def compact_commit_kernel(
    state,
    slots,
    state_strides,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    GK: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BG: tl.constexpr,
    WMAX: tl.constexpr,
):
    ssm, win_k, win_u, win_g, pending, parity = state
    (
        stride_ssm_l,
        stride_ssm_s,
        stride_wk_l,
        stride_wk_s,
        stride_wk_b,
        stride_wk_w,
        stride_wu_l,
        stride_wu_s,
        stride_wu_b,
        stride_wu_w,
        stride_wg_l,
        stride_wg_s,
        stride_wg_b,
        stride_wg_w,
    ) = state_strides
    i_v, i_n, i_l, i_hv, i_h = layer_program_heads(H, HV)
    slot = tl.load(slots + i_n).to(tl.int64)
    num_pending = tl.minimum(tl.load(pending + slot), WMAX)
    buf = tl.load(parity + slot).to(tl.int64)

    tile = tile_offsets(i_v, K, V, GK, BK, BV, BG)
    o_k, m_k, o_v, m_v, o_g, m_g, m_kv = tile

    p_s = ssm + i_l * stride_ssm_l + slot * stride_ssm_s + i_hv * K * V + o_k[:, None] * V + o_v[None, :]
    b_s = tl.load(p_s, mask=m_kv & (num_pending > 0), other=0).to(tl.float32)  # [BK, BV]
    window = (
        win_k + i_l * stride_wk_l + slot * stride_wk_s + buf * stride_wk_b + i_h * K,
        win_u + i_l * stride_wu_l + slot * stride_wu_s + buf * stride_wu_b + i_hv * V,
        win_g + i_l * stride_wg_l + slot * stride_wg_s + buf * stride_wg_b + i_hv * GK,
        stride_wk_w,
        stride_wu_w,
        stride_wg_w,
    )
    merge_window_tokens(b_s, p_s, window, num_pending, tile)


def _launch_verify(tokens: TokenInputs, slots, widths, state, state_strides, compact: bool, config, algorithm):
    """The one launch of `serial_verify_kernel`: `state` its seven state pointers (ssm, ssm_index, win_k, win_u,
    win_g, pending, parity; a mode passes its own tensors where the other mode's are never read) and
    `state_strides` its eleven state strides; `config` pins the launch configuration, else `algorithm`'s table
    gives it."""

    N, WMAX, H, K = tokens.q.shape
    HV, V = tokens.v.shape[2:]
    GK = tokens.graw.shape[-1]
    check_verify_inputs(tokens, slots, widths)
    ssm = state[0]
    cfg = serial_config(
        config, algorithm, ssm.dtype, tokens.v.dtype, H, HV, K, V, GK, WMAX, ssm.device, tokens.lower_bound, compact
    )
    o = torch.empty_like(tokens.v)
    if N == 0:
        return o
    # a pinned configuration is launched as given; a looked-up one is narrowed for a batch too small to fill the GPU
    BV = min(cfg.block_v, triton.next_power_of_2(V))
    if config is None:
        BV = filled_block_v(cfg.block_v, V, N * HV, sm_count(ssm.device))
    serial_verify_kernel[(triton.cdiv(V, BV), N, HV)](
        *verify_launch_args(tokens, state, state_strides, slots, widths, o),
        **state_shape(H, HV, K, V, GK, BV),
        WMAX=WMAX,
        COMPACT=compact,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return o


def native_verify_triton(tokens: TokenInputs, state: NativeBuffers, slots, widths, *, config=None, algorithm=None):
    """Native verify of one layer (see `ops.native_verify`): in place, slot s of `state.ssm [S, Wmax_s, HV, K, V]`
    <- the state after window token s (s < W) of each row. Returns o `[N, Wmax, HV, V]` (dtype of v, zeros for
    tokens s >= W). `config`: a `KernelConfig` (block_v, num_warps, num_stages) to launch with; None: the one `algorithm` (an
    `Algorithm`; None: the one of the gate width) holds for this shape."""
    ssm, HV, K, V = state.ssm, tokens.v.shape[2], tokens.q.shape[3], tokens.v.shape[3]
    assert ssm.dim() == 5 and ssm.shape[2:] == (HV, K, V) and ssm.is_contiguous(), (
        f"ssm must be a contiguous [S, Wmax, {HV}, {K}, {V}] buffer, got {tuple(ssm.shape)}"
    )
    # the compact pointers are never read (COMPACT is off): the native tensors stand in for them
    index = state.ssm_index
    pointers = (ssm, index, ssm, ssm, ssm, index, index)
    return _launch_verify(tokens, slots, widths, pointers, state.strides + (0,) * 9, False, config, algorithm)


def compact_verify_triton(tokens: TokenInputs, state: CompactBuffers, slots, widths, *, config=None, algorithm=None):
    """Compact verify of one layer (see `ops.compact_verify`); outputs bitwise equal to `native_verify_triton`.

    In place for rows with W > 0: `state.ssm [S, HV, K, V]` of the slot gets its `pending` records from buffer
    `parity` merged (written only when pending > 0); the row's W records go to buffer `1 - parity` of the fp32
    record buffers (`CompactBuffers`). pending / parity are read only. Returns o `[N, Wmax, HV, V]`.
    """
    ssm = state.ssm
    H, HV, K, V, GK = tokens.q.shape[2], tokens.v.shape[2], tokens.q.shape[3], tokens.v.shape[3], tokens.graw.shape[-1]
    assert ssm.dim() == 4 and ssm.shape[1:] == (HV, K, V) and ssm.stride(1) == K * V and ssm.stride(3) == 1
    check_window(state, H, HV, K, V, GK, tokens.q.shape[1], leading=1)
    check_slot_scalars(state.pending, state.parity, ssm.shape[0])
    pointers = (ssm, state.pending, *state.windows, state.pending, state.parity)
    strides = state.strides[:1] + (0,) + state.strides[1:]
    return _launch_verify(tokens, slots, widths, pointers, strides, True, config, algorithm)


def check_window(state: CompactBuffers, H, HV, K, V, GK, WMAX, leading):
    """Record buffers `[*lead, S, 2, W, ...]` fp32 with `leading` dims up to and including the slot dim, W >= WMAX."""
    win_k, win_u, win_g = state.windows
    lead = tuple(win_k.shape[:leading])
    assert win_k.shape == (*lead, 2, win_k.shape[leading + 1], H, K) and win_k.shape[leading + 1] >= WMAX, (
        f"win_k {tuple(win_k.shape)} does not hold two width-{WMAX} windows of {H}x{K} keys"
    )
    wl = win_k.shape[: leading + 2]
    assert win_u.shape == (*wl, HV, V) and win_g.shape == (*wl, HV, GK)
    assert win_k.dtype == win_u.dtype == win_g.dtype == torch.float32, "compact window records are fp32"
    for t in state.windows:
        assert t.stride(-1) == 1 and t.stride(-2) == t.shape[-1]


def check_slot_scalars(pending, parity, num_slots):
    for name, t in (("pending", pending), ("parity", parity)):
        assert t.shape == (num_slots,) and t.dtype == torch.int32, f"{name} must be int32 [{num_slots}]"


def compact_commit_triton(state: CompactBuffers, slots: torch.Tensor, *, config=None, algorithm=None) -> None:
    """Merge the pending records of every row's slot into the state, all layers in one launch (`ops.compact_commit`).

    `state` holds all layers (`ssm [NL, S, HV, K, V]`, records `[NL, S, 2, Wmax, ...]`). In place: `ssm[:, slot]`
    <- the state after the first `pending[slot]` records of buffer `parity[slot]`, native's update and per-token
    rounding; untouched when pending is 0. slots `[N]` int32. `pending` is left as it is (the caller clears it).
    """

    ssm, win_k, win_g = state.ssm, state.win_k, state.win_g
    NL, S, HV, K, V = ssm.shape
    H, WMAX, GK = win_k.shape[4], win_k.shape[3], win_g.shape[-1]
    N = slots.shape[0]
    assert ssm.stride(2) == K * V and ssm.stride(3) == V and ssm.stride(4) == 1
    check_window(state, H, HV, K, V, GK, WMAX, leading=2)
    check_slot_scalars(state.pending, state.parity, S)
    assert win_k.shape[:2] == (NL, S) and slots.shape == (N,) and slots.dtype == torch.int32
    # the merge is elementwise on the tile (no reduction over K), so any tiling writes the same bytes as the
    # verify's; the records are fp32, so the verify's activation dtype is not known here and the lookup uses fp32
    cfg = serial_config(config, algorithm, ssm.dtype, torch.float32, H, HV, K, V, GK, WMAX, ssm.device, compact=True)
    if N == 0 or NL == 0:
        return
    BV = min(cfg.block_v, triton.next_power_of_2(V))
    compact_commit_kernel[(triton.cdiv(V, BV), N, NL * HV)](
        state.pointers,
        slots,
        state.strides,
        **state_shape(H, HV, K, V, GK, BV),
        WMAX=WMAX,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
