"""Causal depthwise conv + SiLU with a per-slot window (README "Conv window"): decode/verify and varlen prefill.

Every token reads a stream `[history | x]` of its row, where the history is the `HL = Kc - 1` columns
`conv[slot, :, off : off + HL]` (`off = conv_offset[slot]`). Stream element `i` is history column `HL + i` for
`i < 0` and input token `i` for `i >= 0`; output token `t` is `silu(bias + sum_j w_j * stream[t + j - HL])`,
summed in tap order like the torch twin. Blocks are `[tokens, channels]` with channels innermost (x, y contiguous).

Decode rewrites the buffer it reads, and prefill's write-back overwrites history that other token tiles of the
row still read. Decode therefore loads everything before a CTA barrier and stores after it (one program owns a
(row, channel block)); prefill writes back in a second launch, after every output tile has read its history.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def load_stream(p_hist, p_x, b_i, m_t, m_hist, x_len, o_c, m_c, stride_hist_c, stride_x_t):
    """Stream elements `b_i [BT]` of each token's row as fp32 `[BT, BC]` (zero where masked off).

    p_hist `[BT]` points one column past the row's history (`conv[slot, 0, off + HL]`), p_x `[BT]` at the row's
    token 0 (`x[row, 0, 0]`); m_t `[BT]` live tokens, m_hist `[BT]` whether the history may be read (has initial
    state), x_len `[BT]` the row's input count (elements at or past it are never read).
    """
    o_c64 = o_c.to(tl.int64)
    m_h = (m_t & m_hist & (b_i < 0))[:, None] & m_c[None, :]
    m_x = (m_t & (b_i >= 0) & (b_i < x_len))[:, None] & m_c[None, :]
    p_h = p_hist[:, None] + o_c64[None, :] * stride_hist_c + b_i[:, None]
    p_xx = p_x[:, None] + b_i.to(tl.int64)[:, None] * stride_x_t + o_c64[None, :]
    b_h = tl.load(p_h, mask=m_h, other=0).to(tl.float32)
    b_x = tl.load(p_xx, mask=m_x, other=0).to(tl.float32)
    return tl.where(m_h, b_h, b_x)


@triton.jit
def conv_silu(
    p_hist,
    p_x,
    b_pos,
    m_t,
    m_hist,
    x_len,
    o_c,
    m_c,
    weight,
    bias,
    stride_hist_c,
    stride_x_t,
    stride_w_c,
    HL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """silu(conv) of the tokens at stream positions `b_pos [BT]` as fp32 `[BT, BC]` (taps added in order)."""
    b_y = tl.zeros([b_pos.shape[0], o_c.shape[0]], dtype=tl.float32)
    for j in tl.static_range(HL + 1):
        b_w = tl.load(weight + o_c.to(tl.int64) * stride_w_c + j, mask=m_c, other=0).to(tl.float32)  # [BC]
        b_in = load_stream(p_hist, p_x, b_pos + (j - HL), m_t, m_hist, x_len, o_c, m_c, stride_hist_c, stride_x_t)
        b_y += b_in * b_w[None, :]
    if HAS_BIAS:
        b_y += tl.load(bias + o_c, mask=m_c, other=0).to(tl.float32)[None, :]
    return b_y / (1.0 + tl.exp(-b_y))


@triton.heuristics({"HAS_BIAS": lambda args: args["bias"] is not None})
@triton.jit
def causal_conv_decode_kernel(
    x,
    conv,
    conv_offset,
    slots,
    widths,
    weight,
    bias,
    y,
    C,
    stride_x_n,
    stride_x_w,
    stride_y_n,
    stride_y_w,
    stride_conv_s,
    stride_conv_c,
    stride_w_c,
    HL: tl.constexpr,
    WMAX: tl.constexpr,
    BW: tl.constexpr,
    BWC: tl.constexpr,
    BC: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    i_c, i_n = tl.program_id(0), tl.program_id(1).to(tl.int64)
    width = tl.load(widths + i_n)
    live = width > 0
    # padding rows (width 0, the HOLD slot) read no state and write none: every state access is masked by `live`
    slot = tl.load(slots + i_n, mask=live, other=0).to(tl.int64)
    off = tl.load(conv_offset + slot, mask=live, other=0).to(tl.int64)

    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    o_w = tl.arange(0, BW)
    m_w = o_w < width
    p_row = conv + slot * stride_conv_s
    p_xrow = x + i_n * stride_x_n

    # token s sits at stream position s
    b_y = conv_silu(
        p_row + off + HL + tl.zeros([BW], dtype=tl.int64),
        p_xrow + tl.zeros([BW], dtype=tl.int64),
        o_w,
        m_w,
        m_w,
        tl.zeros([BW], dtype=tl.int32) + width,
        o_c,
        m_c,
        weight,
        bias,
        stride_conv_c,
        stride_x_w,
        stride_w_c,
        HL,
        HAS_BIAS,
    )  # [BW, BC]

    # the new buffer: column c holds stream element c + 1 - HL, for c < HL - 1 + W ([history[1:] | x_0 .. x_{W-1}])
    o_col = tl.arange(0, BWC)
    m_col = (o_col < HL - 1 + width) & live
    b_new = load_stream(
        p_row + off + HL + tl.zeros([BWC], dtype=tl.int64),
        p_xrow + tl.zeros([BWC], dtype=tl.int64),
        o_col + 1 - HL,
        m_col,
        m_col,
        tl.zeros([BWC], dtype=tl.int32) + width,
        o_c,
        m_c,
        stride_conv_c,
        stride_x_w,
    )  # [BWC, BC]
    # the columns written below overlap the history other threads of this program loaded above
    tl.debug_barrier()

    p_y = y + i_n * stride_y_n + o_w.to(tl.int64)[:, None] * stride_y_w + o_c[None, :]
    b_out = tl.where(m_w[:, None], b_y, 0.0)
    tl.store(p_y, b_out.to(p_y.dtype.element_ty), mask=(o_w < WMAX)[:, None] & m_c[None, :])
    p_new = p_row + o_c.to(tl.int64)[None, :] * stride_conv_c + o_col[:, None]
    tl.store(p_new, b_new.to(p_new.dtype.element_ty), mask=m_col[:, None] & m_c[None, :])


def _check_conv(conv: torch.Tensor, conv_offset: torch.Tensor, weight: torch.Tensor, bias, num_ch: int) -> None:
    assert conv.dim() == 3 and conv.shape[1] == num_ch and conv.stride(2) == 1, (
        f"conv must be [S, {num_ch}, cols] with contiguous columns, got {tuple(conv.shape)} {conv.stride()}"
    )
    assert weight.dim() == 2 and weight.shape[0] == num_ch and weight.stride(1) == 1
    assert conv.shape[2] >= weight.shape[1] - 1, "the window buffer is narrower than the conv history"
    assert bias is None or (bias.shape == (num_ch,) and bias.is_contiguous())
    assert conv_offset.dtype == torch.int32 and conv_offset.shape == (conv.shape[0],)


def _channel_block(num_ch: int) -> int:
    return min(128, triton.next_power_of_2(num_ch))


def causal_conv_decode_triton(
    x: torch.Tensor,
    conv: torch.Tensor,
    conv_offset: torch.Tensor,
    slots: torch.Tensor,
    widths: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Conv + SiLU over verify windows (see `ops.causal_conv_decode`).

    x `[N, Wmax, C]` (channels contiguous), conv `[S, C, Kc - 1 + Wmax - 1]` one layer's window buffer (columns
    contiguous; activation dtype), conv_offset `[S]` int32 (read only), slots / widths `[N]` int32, weight `[C, Kc]`,
    bias `[C]` or None. In place: `conv[slot, :, 0 : Kc - 2 + W] <- [history[1:] | x_0 .. x_{W-1}]` for rows with
    W > 0. Returns y `[N, Wmax, C]` in the dtype of x, zeros for tokens s >= W. No host sync (CUDA-graph safe).
    """
    N, WMAX, C = x.shape
    HL = weight.shape[1] - 1
    _check_conv(conv, conv_offset, weight, bias, C)
    assert x.stride(2) == 1, "x channels must be contiguous"
    assert conv.shape[2] >= HL + WMAX - 1, f"conv has {conv.shape[2]} columns; a width-{WMAX} window needs more"
    assert slots.shape == widths.shape == (N,) and slots.dtype == widths.dtype == torch.int32
    y = torch.empty_like(x)
    if N == 0 or C == 0:
        return y
    BC = _channel_block(C)
    causal_conv_decode_kernel[(triton.cdiv(C, BC), N)](
        x,
        conv,
        conv_offset,
        slots,
        widths,
        weight,
        bias,
        y,
        C,
        x.stride(0),
        x.stride(1),
        y.stride(0),
        y.stride(1),
        conv.stride(0),
        conv.stride(1),
        weight.stride(0),
        HL=HL,
        WMAX=WMAX,
        BW=triton.next_power_of_2(WMAX),
        BWC=triton.next_power_of_2(HL + WMAX - 1),
        BC=BC,
        num_warps=4,
    )
    return y


@triton.jit
def find_rows(cu_seqlens, o_t, N, NUM_SEARCH):
    """Row of each packed token `o_t [BT]`: the last r with `cu_seqlens[r] <= t` (empty rows are skipped)."""
    # invariant: cu[lo] <= t < cu[hi]; extra iterations past convergence leave lo unchanged
    lo = tl.zeros(o_t.shape, dtype=tl.int32)
    hi = tl.zeros(o_t.shape, dtype=tl.int32) + N
    for _ in range(NUM_SEARCH):
        mid = (lo + hi) // 2
        go = tl.load(cu_seqlens + mid).to(tl.int64) <= o_t
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    return lo


@triton.heuristics({"HAS_BIAS": lambda args: args["bias"] is not None})
@triton.jit
def causal_conv_prefill_kernel(
    x,
    conv,
    conv_offset,
    slots,
    cu_seqlens,
    has_initial_state,
    weight,
    bias,
    y,
    T,
    N,
    C,
    NUM_SEARCH,
    stride_x_t,
    stride_y_t,
    stride_conv_s,
    stride_conv_c,
    stride_w_c,
    HL: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    i_c, i_t = tl.program_id(0), tl.program_id(1)
    o_t = i_t.to(tl.int64) * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C

    # a tile may span rows: every per-row quantity is a [BT] gather
    row = find_rows(cu_seqlens, o_t, N, NUM_SEARCH)
    bos = tl.load(cu_seqlens + row, mask=m_t, other=0).to(tl.int64)
    eos = tl.load(cu_seqlens + row + 1, mask=m_t, other=0).to(tl.int64)
    slot = tl.load(slots + row, mask=m_t, other=0).to(tl.int64)
    off = tl.load(conv_offset + slot, mask=m_t, other=0).to(tl.int64)
    m_hist = tl.load(has_initial_state + row, mask=m_t, other=0) != 0

    b_y = conv_silu(
        conv + slot * stride_conv_s + off + HL,
        x + bos * stride_x_t,
        o_t - bos,
        m_t,
        m_hist,
        eos - bos,
        o_c,
        m_c,
        weight,
        bias,
        stride_conv_c,
        stride_x_t,
        stride_w_c,
        HL,
        HAS_BIAS,
    )  # [BT, BC]
    p_y = y + o_t[:, None] * stride_y_t + o_c[None, :]
    tl.store(p_y, b_y.to(p_y.dtype.element_ty), mask=m_t[:, None] & m_c[None, :])


@triton.jit
def causal_conv_writeback_kernel(
    x,
    conv,
    conv_offset,
    slots,
    cu_seqlens,
    has_initial_state,
    C,
    stride_x_t,
    stride_conv_s,
    stride_conv_c,
    HL: tl.constexpr,
    BH: tl.constexpr,
    BC: tl.constexpr,
):
    i_c, i_n = tl.program_id(0), tl.program_id(1).to(tl.int64)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    seq_len = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    live = seq_len > 0
    slot = tl.load(slots + i_n, mask=live, other=0).to(tl.int64)
    off = tl.load(conv_offset + slot, mask=live, other=0).to(tl.int64)
    use_hist = tl.load(has_initial_state + i_n) != 0

    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    # history column k <- stream element seq_len - HL + k (a short row keeps part of its old history)
    o_k = tl.arange(0, BH)
    m_k = (o_k < HL) & live
    p_hist = conv + slot * stride_conv_s + off + HL
    b_tail = load_stream(
        p_hist + tl.zeros([BH], dtype=tl.int64),
        x + bos * stride_x_t + tl.zeros([BH], dtype=tl.int64),
        seq_len - HL + o_k,
        m_k,
        m_k & use_hist,
        tl.zeros([BH], dtype=tl.int64) + seq_len,
        o_c,
        m_c,
        stride_conv_c,
        stride_x_t,
    )  # [BH, BC]
    # the columns written below are the ones other threads of this program loaded above
    tl.debug_barrier()
    p_new = conv + slot * stride_conv_s + off + o_c.to(tl.int64)[None, :] * stride_conv_c + o_k[:, None]
    tl.store(p_new, b_tail.to(p_new.dtype.element_ty), mask=m_k[:, None] & m_c[None, :])


def causal_conv_prefill_triton(
    x: torch.Tensor,
    conv: torch.Tensor,
    conv_offset: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    """Conv + SiLU over packed varlen prefill rows (see `ops.causal_conv_prefill`).

    x `[T, C]` (channels contiguous), conv `[S, C, cols]` one layer's window buffer (columns contiguous),
    conv_offset `[S]` int32 (read only), slots `[N]` int32, cu_seqlens `[N + 1]` int32/int64, weight `[C, Kc]`,
    bias `[C]` or None, has_initial_state `[N]` bool (False: zero history). Returns y `[T, C]` in the dtype of x.
    In place (second launch, after all outputs): `conv[slot, :, off : off + Kc - 1]` <- the last `Kc - 1` elements
    of `[history | x_row]` for rows with at least one token. No host sync.
    """
    T, C = x.shape
    N = slots.shape[0]
    HL = weight.shape[1] - 1
    _check_conv(conv, conv_offset, weight, bias, C)
    assert x.stride(1) == 1, "x channels must be contiguous"
    assert conv.shape[2] >= HL, "the window buffer is narrower than the conv history"
    assert cu_seqlens.shape == (N + 1,) and has_initial_state.shape == (N,) and slots.dtype == torch.int32
    y = torch.empty_like(x)
    if N == 0 or C == 0:
        return y
    BC = _channel_block(C)
    if T > 0:
        BT = 16
        causal_conv_prefill_kernel[(triton.cdiv(C, BC), triton.cdiv(T, BT))](
            x,
            conv,
            conv_offset,
            slots,
            cu_seqlens,
            has_initial_state,
            weight,
            bias,
            y,
            T,
            N,
            C,
            max(1, (N - 1).bit_length()),
            x.stride(0),
            y.stride(0),
            conv.stride(0),
            conv.stride(1),
            weight.stride(0),
            HL=HL,
            BT=BT,
            BC=BC,
            num_warps=4,
        )
    causal_conv_writeback_kernel[(triton.cdiv(C, BC), N)](
        x,
        conv,
        conv_offset,
        slots,
        cu_seqlens,
        has_initial_state,
        C,
        x.stride(0),
        conv.stride(0),
        conv.stride(1),
        HL=HL,
        BH=triton.next_power_of_2(HL),
        BC=BC,
        num_warps=4,
    )
    return y
