"""Causal depthwise conv + SiLU over the `[q | k | v]` channels, with a per-slot widened window (README "Conv window").

A program owns a block of channels of one row, for all of its columns: it reads the row's accepted history
`conv[slot, c, off : off + Kc - 1]` and the new inputs into registers, then rewrites the window. The reads and
the rewrite of one slot overlap in memory, so a CTA barrier separates them (another warp of the same program may
still be reading a column this warp is about to overwrite); channel blocks of different programs are disjoint.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightllm.linear_att.kernels.common import BATCH_VARYING_ARGS, sigmoid

# values of one decode program's [channels, columns] tile (`decode_channel_block`)
DECODE_TILE = 4096


@triton.jit
def _silu(x):
    return x * sigmoid(x)


@triton.heuristics({"HAS_BIAS": lambda args: args["bias"] is not None})
@triton.jit(do_not_specialize=BATCH_VARYING_ARGS)
def causal_conv_decode_kernel(
    x,
    conv,
    conv_offset,
    slots,
    widths,
    weight,
    bias,
    y,
    stride_x_n,
    stride_x_w,
    stride_conv_s,
    stride_conv_c,
    stride_y_n,
    stride_y_w,
    C: tl.constexpr,
    KC: tl.constexpr,
    WMAX: tl.constexpr,
    WC: tl.constexpr,
    BC: tl.constexpr,
    BT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    i_c, i_n = tl.program_id(0), tl.program_id(1).to(tl.int64)
    width = tl.load(widths + i_n)
    live = width > 0
    slot = tl.load(slots + i_n).to(tl.int64)
    off = tl.load(conv_offset + slot, mask=live, other=0)
    HL: tl.constexpr = KC - 1

    o_c = i_c * BC + tl.arange(0, BC)
    o_t = tl.arange(0, BT)
    m_c = o_c < C
    p_conv = conv + slot * stride_conv_s + o_c[:, None] * stride_conv_c
    p_x = x + i_n * stride_x_n + o_c[:, None]

    # [history | x_0 .. x_{W-1}] as columns t of one block, and the same shifted by one (the rewritten window)
    m_h = o_t < HL
    m_x = (o_t >= HL) & (o_t < HL + width)
    b_h = tl.load(p_conv + (off + o_t)[None, :], mask=m_c[:, None] & m_h[None, :] & live, other=0)
    b_x = tl.load(p_x + (o_t - HL)[None, :] * stride_x_w, mask=m_c[:, None] & m_x[None, :], other=0)
    b_all = tl.where(m_h[None, :], b_h.to(tl.float32), b_x.to(tl.float32))  # [BC, BT]
    o_n = o_t + 1
    m_hn = o_n < HL
    m_xn = (o_n >= HL) & (o_n < HL + width)
    b_hn = tl.load(p_conv + (off + o_n)[None, :], mask=m_c[:, None] & m_hn[None, :] & live, other=0)
    b_xn = tl.load(p_x + (o_n - HL)[None, :] * stride_x_w, mask=m_c[:, None] & m_xn[None, :], other=0)
    b_next = tl.where(m_hn[None, :], b_hn.to(tl.float32), b_xn.to(tl.float32))  # [BC, BT]
    tl.debug_barrier()
    m_keep = (o_t < HL - 1 + width) & (o_t < WC) & live
    tl.store(p_conv + o_t[None, :], b_next.to(conv.dtype.element_ty), mask=m_c[:, None] & m_keep[None, :])

    if HAS_BIAS:
        b_bias = tl.load(bias + o_c, mask=m_c, other=0).to(tl.float32)
    else:
        b_bias = tl.zeros([BC], dtype=tl.float32)
    p_y = y + i_n * stride_y_n + o_c
    for s in range(0, WMAX):
        # tap j multiplies column s + j of the block
        m_w = (o_t >= s) & (o_t < s + KC)
        b_w = tl.load(weight + o_c[:, None] * KC + (o_t - s)[None, :], mask=m_c[:, None] & m_w[None, :], other=0)
        b_y = _silu(tl.sum(b_all * b_w.to(tl.float32), 1) + b_bias)  # [BC]
        b_y = tl.where(s < width, b_y, 0.0)
        tl.store(p_y + s * stride_y_w, b_y.to(y.dtype.element_ty), mask=m_c)


def _launch_setup(x, conv, weight) -> tuple[torch.Tensor, int, int, int]:
    """What both wrappers check (channels innermost and agreeing between x and the window, weight contiguous) and
    need: (y, channels C, kernel size Kc, the channel block of a program)."""
    C, KC = x.shape[-1], weight.shape[1]
    assert x.stride(-1) == 1 and conv.stride(2) == 1 and weight.is_contiguous() and conv.shape[1] == C
    return torch.empty_like(x), C, KC, min(128, triton.next_power_of_2(C))


def causal_conv_decode_triton(x, conv, conv_offset, slots, widths, weight, bias) -> torch.Tensor:
    """Conv + SiLU over verify windows (see `ops.causal_conv_decode`).

    x `[N, Wmax, C]`; conv `[S, C, Kc - 1 + Wmax - 1]` (in place: columns `0 .. Kc - 3 + W` <- `[history[1:] |
    x_0 .. x_{W-1}]`); conv_offset `[S]`, slots / widths `[N]` int32; weight `[C, Kc]`; bias `[C]` or None.
    Returns y `[N, Wmax, C]` (dtype of x; zeros for s >= W; rows with width 0 write nothing).
    """
    N, WMAX = x.shape[:2]
    WC = conv.shape[2]
    y, C, KC, _ = _launch_setup(x, conv, weight)
    if N == 0:
        return y
    BT = triton.next_power_of_2(KC - 1 + WMAX)
    BC = decode_channel_block(C, BT)
    causal_conv_decode_kernel[(triton.cdiv(C, BC), N)](
        x,
        conv,
        conv_offset,
        slots,
        widths,
        weight,
        bias,
        y,
        x.stride(0),
        x.stride(1),
        conv.stride(0),
        conv.stride(1),
        y.stride(0),
        y.stride(1),
        C=C,
        KC=KC,
        WMAX=WMAX,
        WC=WC,
        BC=BC,
        BT=BT,
        num_warps=8 if BC * BT >= DECODE_TILE else 4,
    )
    return y


def decode_channel_block(C: int, BT: int) -> int:
    """Channels of one decode program: a `[channels, columns]` tile of `DECODE_TILE` values. A program's work is a
    few KB of one row's window, so the kernel's time is its number of waves of programs times their latency; with
    128 channels a step of 256 rows at 8192 channels launched 16k programs (~8 waves)."""
    return min(triton.next_power_of_2(C), max(128, DECODE_TILE // BT))


@triton.jit
def _tap_source_strided(p_x, p_hist, pos, length, stride_x_t, m_c, has_init):
    """Input at row positions `pos` (`[BT]`; negative = history column `Kc - 1 + pos`) as `[BT, BC]` fp32;
    positions at or past the row's `length` read nothing (they would be the next row, or past the end of x)."""
    m_x = ((pos >= 0) & (pos < length))[:, None] & m_c[None, :]
    b_x = tl.load(p_x + tl.maximum(pos, 0)[:, None] * stride_x_t, mask=m_x, other=0).to(tl.float32)
    m_h = (pos < 0)[:, None] & m_c[None, :] & has_init
    b_h = tl.load(p_hist + tl.minimum(pos, -1)[:, None], mask=m_h, other=0).to(tl.float32)
    return tl.where((pos >= 0)[:, None], b_x, b_h)


@triton.jit
def _prefill_row(cu_seqlens, slots, has_initial_state, conv_offset, i_n):
    """Prefill row `i_n`'s first token in x, token count, state slot, whether it has a history, and its window
    offset."""
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    length = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    slot = tl.load(slots + i_n).to(tl.int64)
    has_init = tl.load(has_initial_state + i_n).to(tl.int1)
    off = tl.load(conv_offset + slot).to(tl.int64)
    return bos, length, slot, has_init, off


# the programs a row's tiles spread over follows the batch's token count too
PREFILL_VARYING_ARGS = (*BATCH_VARYING_ARGS, "NSEG")


@triton.heuristics({"HAS_BIAS": lambda args: args["bias"] is not None})
@triton.jit(do_not_specialize=PREFILL_VARYING_ARGS)
def causal_conv_prefill_kernel(
    x,
    conv,
    conv_offset,
    slots,
    cu_seqlens,
    weight,
    bias,
    has_initial_state,
    y,
    stride_x_t,
    stride_conv_s,
    stride_conv_c,
    stride_y_t,
    NSEG,
    C: tl.constexpr,
    KC: tl.constexpr,
    BC: tl.constexpr,
    BT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """y of the token tiles `i_s, i_s + NSEG, ...` of row `i_n`: a long row spreads over NSEG programs per channel
    block. Reads the history, writes none of it (`causal_conv_prefill_tail_kernel` does, once every tile read it)."""
    i_c, i_n, i_s = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    bos, length, slot, has_init, off = _prefill_row(cu_seqlens, slots, has_initial_state, conv_offset, i_n)
    HL: tl.constexpr = KC - 1

    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    # position p < 0 of the row is history column off + HL + p
    p_x = x + bos * stride_x_t + o_c[None, :]
    p_hist = conv + slot * stride_conv_s + o_c[None, :] * stride_conv_c + off + HL
    if HAS_BIAS:
        b_bias = tl.load(bias + o_c, mask=m_c, other=0).to(tl.float32)
    else:
        b_bias = tl.zeros([BC], dtype=tl.float32)
    for t0 in range(i_s * BT, length, NSEG * BT):
        o_tok = t0 + tl.arange(0, BT)
        b_acc = tl.zeros([BT, BC], dtype=tl.float32) + b_bias[None, :]
        for j in tl.static_range(KC):
            pos = o_tok - HL + j
            b_src = _tap_source_strided(p_x, p_hist, pos, length, stride_x_t, m_c, has_init)
            b_w = tl.load(weight + o_c * KC + j, mask=m_c, other=0).to(tl.float32)
            b_acc += b_src * b_w[None, :]
        p_y = y + (bos + o_tok)[:, None] * stride_y_t + o_c[None, :]
        tl.store(p_y, _silu(b_acc).to(y.dtype.element_ty), mask=(o_tok < length)[:, None] & m_c[None, :])


@triton.jit(do_not_specialize=BATCH_VARYING_ARGS)
def causal_conv_prefill_tail_kernel(
    x,
    conv,
    conv_offset,
    slots,
    cu_seqlens,
    has_initial_state,
    stride_x_t,
    stride_conv_s,
    stride_conv_c,
    C: tl.constexpr,
    KC: tl.constexpr,
    BC: tl.constexpr,
    BH: tl.constexpr,
):
    """The last Kc - 1 inputs of row `i_n`'s `[history | x]` back to its history columns (rows with no tokens keep
    theirs)."""
    i_c, i_n = tl.program_id(0), tl.program_id(1).to(tl.int64)
    bos, length, slot, has_init, off = _prefill_row(cu_seqlens, slots, has_initial_state, conv_offset, i_n)
    HL: tl.constexpr = KC - 1
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    p_x = x + bos * stride_x_t + o_c[None, :]
    p_hist = conv + slot * stride_conv_s + o_c[None, :] * stride_conv_c + off + HL
    o_j = tl.arange(0, BH)
    b_tail = _tap_source_strided(p_x, p_hist, length - HL + o_j, length, stride_x_t, m_c, has_init)  # [BH, BC]
    # a row shorter than Kc - 1 reads part of its tail from the columns written here: all reads come first
    tl.debug_barrier()
    p_out = conv + slot * stride_conv_s + o_c[None, :] * stride_conv_c + off + o_j[:, None]
    tl.store(p_out, b_tail.to(conv.dtype.element_ty), mask=(o_j < HL)[:, None] & m_c[None, :] & (length > 0))


# token tiles of the conv's prefill kernel, and how many tiles one of its programs takes at least
CONV_PREFILL_TILE = 16
CONV_PREFILL_TILES_PER_PROGRAM = 16


def causal_conv_prefill_triton(
    x, conv, conv_offset, slots, cu_seqlens, weight, bias, has_initial_state
) -> torch.Tensor:
    """Conv + SiLU over packed prefill rows (see `ops.causal_conv_prefill`).

    x `[T, C]`; conv `[S, C, Kc - 1 + Wmax - 1]` (in place: the last `Kc - 1` inputs of each non-empty row's
    `[history | x]` at columns `off .. off + Kc - 2`); cu_seqlens `[N + 1]`; has_initial_state `[N]` bool
    (False: zero history). Returns y `[T, C]` in the dtype of x. Each row's tiles spread over as many programs as
    an average row of the batch fills (the row lengths stay on the device), then one launch writes the histories.
    """
    N = slots.shape[0]
    y, C, KC, BC = _launch_setup(x, conv, weight)
    if N == 0:
        return y
    per_program = CONV_PREFILL_TILE * CONV_PREFILL_TILES_PER_PROGRAM
    nseg = max(1, triton.cdiv(x.shape[0], N * per_program))
    causal_conv_prefill_kernel[(triton.cdiv(C, BC), N, nseg)](
        x,
        conv,
        conv_offset,
        slots,
        cu_seqlens,
        weight,
        bias,
        has_initial_state,
        y,
        x.stride(0),
        conv.stride(0),
        conv.stride(1),
        y.stride(0),
        nseg,
        C=C,
        KC=KC,
        BC=BC,
        BT=CONV_PREFILL_TILE,
        num_warps=4,
    )
    causal_conv_prefill_tail_kernel[(triton.cdiv(C, BC), N)](
        x,
        conv,
        conv_offset,
        slots,
        cu_seqlens,
        has_initial_state,
        x.stride(0),
        conv.stride(0),
        conv.stride(1),
        C=C,
        KC=KC,
        BC=BC,
        BH=triton.next_power_of_2(max(KC - 1, 1)),
        num_warps=4,
    )
    return y
