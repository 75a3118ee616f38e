"""Flash-decoding pieces shared by the paged attention kernels (GQA over K/V pools, MLA over the latent pool).

A program attends a tile of (query token, head) rows to one span of its rows' context with an online softmax in
the log2 domain. When a launch has too few programs to fill the GPU, each context is cut into `num_splits` spans
of whole key blocks on the device (`context_span`); every split writes its unnormalised fp32 output and its
softmax statistics (max, sum) and `paged_attention_combine_kernel` merges them. The split count is a host choice
(`num_context_splits`) that holds for any context length, so CUDA graphs capture it once per batch bucket; it is a
runtime argument, so one compiled kernel serves every count.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# exp(x) == exp2(x * log2(e)); exp2 is the native instruction
LOG2E = 1.4426950408889634

# the most splits of one program's context (a power of two: the combine kernel's block); the partial outputs grow
# with it
MAX_SPLITS = 32


@triton.jit
def context_span(kv_end, num_splits, i_s, BN: tl.constexpr):
    """Keys `[kv_lo, kv_hi)` of split `i_s`: span `i_s` of `num_splits` equal spans of whole BN-key blocks of the
    context `[0, kv_end)` (later spans may be empty)."""
    span = tl.cdiv(tl.cdiv(kv_end, num_splits), BN) * BN
    kv_lo = i_s * span
    kv_hi = tl.minimum(kv_lo + span, kv_end)
    return kv_lo, kv_hi


@triton.jit
def block_slots(p_table, start, kv_hi, BN: tl.constexpr):
    """Pool slots `[BN]` (int64) of context positions `start .. start + BN` of one row's slot table (0 past `kv_hi`).

    Callers read a block's slots one iteration ahead and carry them: a K/V load whose addresses come from a load of
    the same iteration is not multi-buffered by Triton's pipeliner (every iteration waits for its gather), one whose
    addresses are carried is (the next blocks stream in while this one computes)."""
    o_n = start + tl.arange(0, BN).to(tl.int64)
    return tl.load(p_table + o_n, mask=o_n < kv_hi, other=0).to(tl.int64)


@triton.jit
def online_softmax_step(b_s, b_m, b_l):
    """Fold one block of masked scores `b_s [BM, BN]` (log2 domain, -inf where invisible) into the running max
    `b_m [BM]` and sum `b_l [BM]`; returns (probabilities [BM, BN], rescale of the old accumulator [BM], new max,
    new sum)."""
    # padded tile rows see nothing; keep their running max finite so exp2 never sees (-inf) - (-inf)
    b_m_new = tl.maximum(tl.maximum(b_m, tl.max(b_s, axis=1)), -1e30)
    b_alpha = tl.exp2(b_m - b_m_new)
    b_p = tl.exp2(b_s - b_m_new[:, None])
    b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
    return b_p, b_alpha, b_m_new, b_l


@triton.jit
def store_rows(
    o,  # [T, H, DV]
    o_part,  # [num_splits, T, H, DV] fp32
    ml_part,  # [num_splits, T, H, 2] fp32
    b_acc,  # [BM, BV] fp32 unnormalised output
    b_m,  # [BM] running max (log2 domain)
    b_l,  # [BM] running sum
    o_tok,  # [BM] int64 flat token of each tile row
    o_head,  # [BM] int64 query head of each tile row
    m_row,  # [BM] real tile rows
    i_s,
    num_tokens,
    num_heads,
    stride_o_t,
    stride_o_h,
    DV: tl.constexpr,
    BV: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Write a tile's result: normalised into `o` (one split), or the split's partial output and statistics."""
    o_dv = tl.arange(0, BV)
    m_out = m_row[:, None] & (o_dv < DV)[None, :]
    if not SPLIT:
        # every real row sees at least its own position, so l > 0 there; padded rows are masked on store
        b_o = b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None]
        p_o = o + o_tok[:, None] * stride_o_t + o_head[:, None] * stride_o_h + o_dv[None, :]
        tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_out)
    else:
        # a split that saw no key of a row leaves max -1e30 and sum 0: it weighs nothing in the combine
        part = (i_s * num_tokens + o_tok) * num_heads + o_head  # [BM]
        tl.store(o_part + part[:, None] * DV + o_dv[None, :], b_acc, mask=m_out)
        tl.store(ml_part + part * 2, tl.maximum(b_m, -1e30), mask=m_row)
        tl.store(ml_part + part * 2 + 1, b_l, mask=m_row)


@triton.jit(do_not_specialize=["query_start", "query_len", "num_tokens", "num_splits"])
def paged_attention_combine_kernel(
    o_part,  # [num_splits, T, H, DV] fp32
    ml_part,  # [num_splits, T, H, 2] fp32
    o,  # [T, H, DV]
    query_start,  # [R]
    query_len,  # [R]
    num_tokens,  # T
    num_heads,  # H
    num_splits,
    stride_o_t,
    stride_o_h,
    SP: tl.constexpr,  # the most splits (MAX_SPLITS, a power of two): one compiled kernel for every count
    DV: tl.constexpr,
    BV: tl.constexpr,
):
    """Program `(i_t, i_r, i_h)`: token `i_t` of row `i_r`, query head `i_h`: softmax-weighted sum of the splits."""
    i_t, i_r, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_r64 = i_r.to(tl.int64)
    if i_t >= tl.load(query_len + i_r64):
        return
    tok = tl.load(query_start + i_r64).to(tl.int64) + i_t
    o_s = tl.arange(0, SP)
    m_s = o_s < num_splits
    o_dv = tl.arange(0, BV)
    m_dv = o_dv < DV
    part = (o_s.to(tl.int64) * num_tokens + tok) * num_heads + i_h  # [SP]
    b_m = tl.load(ml_part + part * 2, mask=m_s, other=-1e30)
    b_l = tl.load(ml_part + part * 2 + 1, mask=m_s, other=0.0)
    b_w = tl.exp2(b_m - tl.max(b_m, axis=0))  # [SP]
    b_sum = tl.sum(b_l * b_w, axis=0)
    b_acc = tl.load(o_part + part[:, None] * DV + o_dv[None, :], mask=m_s[:, None] & m_dv[None, :], other=0.0)
    b_o = tl.sum(b_acc * b_w[:, None], axis=0) / tl.where(b_sum > 0, b_sum, 1.0)
    tl.store(o + tok * stride_o_t + i_h * stride_o_h + o_dv, b_o.to(o.dtype.element_ty), mask=m_dv)


def split_buffers(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 partial outputs `[num_splits, T, H, DV]` and statistics `[num_splits, T, H, 2]` of a split launch
    writing `out [T, H, DV]`; `out` itself (never read) without a split."""
    if num_splits == 1:
        return out, out
    t, h, dv = out.shape
    o_part = torch.empty(num_splits, t, h, dv, dtype=torch.float32, device=out.device)
    ml_part = torch.empty(num_splits, t, h, 2, dtype=torch.float32, device=out.device)
    return o_part, ml_part


def combine_splits(
    o_part: torch.Tensor,
    ml_part: torch.Tensor,
    out: torch.Tensor,
    query_start: torch.Tensor,
    query_len: torch.Tensor,
    max_query_len: int,
    num_splits: int,
) -> None:
    """Merge a split launch's partial outputs into the rows' tokens of `out [T, H, DV]` (in place)."""
    t, h, dv = out.shape
    paged_attention_combine_kernel[(max_query_len, query_len.shape[0], h)](
        o_part,
        ml_part,
        out,
        query_start,
        query_len,
        t,
        h,
        num_splits,
        out.stride(0),
        out.stride(1),
        SP=MAX_SPLITS,
        DV=dv,
        BV=max(16, triton.next_power_of_2(dv)),
    )


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_context_splits(programs: int, max_context_len: int, bn: int, device: torch.device, waves: int = 2) -> int:
    """Splits per program so that a launch of `programs` programs fills about `waves` waves of the GPU's SMs (more
    waves: smaller splits, a shorter tail when several programs share an SM), each split keeping at least two key
    blocks of the longest context; 1 off CUDA (nothing to fill) and for launches that already fill the GPU."""
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= sms:
        return 1
    return max(1, min(MAX_SPLITS, waves * sms // programs, triton.cdiv(max_context_len, 2 * bn)))
