"""Causal attention of new query tokens over a token-granular KV pool (Triton; flash-style online softmax).

Each row `r` has `query_len[r]` new tokens at `q[query_start[r] :]` and a context of `num_cached[r] + query_len[r]`
positions whose KV lives in the pool at `slot_table[r, position]` (the new tokens' KV is written to the pool before
the call). Query `i` of the row sits at position `num_cached[r] + i` and sees positions `0 .. num_cached[r] + i`.
The same kernel serves prefill chunks after a cached prefix and decode/verify windows of width W.

Program `(i_m, i_r, i_kh)` handles a tile of `BT` consecutive query tokens of row `i_r` for *all* `GROUP` query
heads sharing key head `i_kh`: the tile's `BT * GROUP` (token, head) pairs are the rows of one `[BM, BK]` query
block, so every K/V block is loaded once per key head (not once per query head) and decode windows still fill
the 16-row minimum of a tensor-core dot.

Split context: when those programs are too few to fill the GPU (a short chunk after a long cached prefix, a small
decode batch over long contexts) each one is split `num_splits` ways along its context, every split writes its
unnormalised output and softmax statistics (max, sum) in fp32, and `paged_attention_combine_kernel` merges them.
Each row's context is cut into equal spans of whole key blocks on the device, so the split count is a host
choice that holds for any context length (CUDA graphs capture it once per batch bucket). The count is a runtime
argument: a serving process meets many counts and must not compile a kernel for each in the middle of a step.

Precision: scores, softmax statistics and the output accumulator are fp32. fp32 inputs use `ieee` dots (the fp32
pools exist for parity tests; tf32 would cost ~1e-3 relative error); fp16/bf16 inputs run native tensor-core dots
with fp32 accumulation, and the probabilities are cast to V's dtype for the P·V dot.

The torch fallback (and the only CPU implementation) is the SDPA path in `lightllm.models.layers.paged_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lightllm.kernels.attention_splits import (
    LOG2E,
    MAX_SPLITS,
    block_slots,
    combine_splits,
    context_span,
    num_context_splits,
    online_softmax_step,
    paged_attention_combine_kernel,
    split_buffers,
    store_rows,
)

# the split helpers are part of this module's interface (tests and benchmarks reach them through it)
__all__ = ["MAX_SPLITS", "num_context_splits", "paged_attention", "paged_attention_combine_kernel"]


# the flat token count, the split count and the width of a gathered slot table vary from launch to launch, and
# the per-row tables are slices of a step's packed metadata, at offsets that vary with the batch: specialising on
# them (== 1, % 16, 16-byte aligned) would compile variants in the middle of serving steps
@triton.heuristics({"HAS_TABLE_ROWS": lambda args: args["table_rows"] is not None})
@triton.jit(
    do_not_specialize=[
        "table_rows",
        "query_start",
        "query_len",
        "num_cached",
        "num_tokens",
        "num_splits",
        "stride_table_r",
    ]
)
def paged_attention_kernel(
    q,  # [T, H, DK]
    k_pool,  # [S, HK, DK]
    v_pool,  # [S, HK, DV]
    o,  # [T, H, DV]
    o_part,  # [num_splits, T, H, DV] fp32 unnormalised split outputs (unused without SPLIT)
    ml_part,  # [num_splits, T, H, 2] fp32 split max (log2 domain) and sum of exponentials
    slot_table,  # [R', L] pool slot of each context position
    table_rows,  # [R] row of slot_table holding row r's slots (None: row r itself)
    query_start,  # [R] first flat token of the row
    query_len,  # [R] new tokens of the row
    num_cached,  # [R] cached prefix length of the row
    qk_scale,  # softmax scale * log2(e)
    num_tokens,  # T
    num_heads,  # H
    num_splits,  # splits of each program's context (1 without SPLIT)
    stride_q_t,
    stride_q_h,
    stride_k_s,
    stride_k_h,
    stride_v_s,
    stride_v_h,
    stride_o_t,
    stride_o_h,
    stride_table_r,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_TABLE_ROWS: tl.constexpr,
):
    i_ms, i_r, i_kh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_m, i_s = i_ms // num_splits, i_ms % num_splits
    i_r64 = i_r.to(tl.int64)
    n_q = tl.load(query_len + i_r64).to(tl.int64)
    if i_m * BT >= n_q:
        return
    q0 = tl.load(query_start + i_r64).to(tl.int64)
    n_c = tl.load(num_cached + i_r64).to(tl.int64)

    # tile row j = (token i_m * BT + j // GROUP, query head i_kh * GROUP + j % GROUP)
    o_j = tl.arange(0, BM)
    o_tok = i_m * BT + (o_j // GROUP).to(tl.int64)  # [BM]
    o_head = i_kh.to(tl.int64) * GROUP + (o_j % GROUP).to(tl.int64)  # [BM]
    m_row = (o_j < BT * GROUP) & (o_tok < n_q)  # [BM]
    o_dk = tl.arange(0, BK)
    o_dv = tl.arange(0, BV)
    m_dk = o_dk < DK
    m_dv = o_dv < DV

    p_q = q + (q0 + o_tok)[:, None] * stride_q_t + o_head[:, None] * stride_q_h + o_dk[None, :]
    b_q = tl.load(p_q, mask=m_row[:, None] & m_dk[None, :], other=0.0)  # [BM, BK]

    # last visible position of each tile row; keys past the tile's last real token are never needed
    b_limit = n_c + o_tok  # [BM]
    kv_end = n_c + tl.minimum((i_m + 1) * BT, n_q)
    kv_lo, kv_hi = context_span(kv_end, num_splits, i_s, BN)

    b_m = tl.full([BM], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BM], dtype=tl.float32)
    b_acc = tl.zeros([BM, BV], dtype=tl.float32)
    if HAS_TABLE_ROWS:
        i_row = tl.load(table_rows + i_r64).to(tl.int64)
    else:
        i_row = i_r64
    p_table = slot_table + i_row * stride_table_r
    kh64 = i_kh.to(tl.int64)
    # slots read one block ahead (`block_slots`: so the K/V gathers are multi-buffered)
    b_slot_next = block_slots(p_table, kv_lo, kv_hi, BN)
    for start in range(kv_lo, kv_hi, BN):
        o_n = start + tl.arange(0, BN).to(tl.int64)  # [BN] context positions
        m_n = o_n < kv_hi
        b_slot = b_slot_next  # [BN]
        b_slot_next = block_slots(p_table, start + BN, kv_hi, BN)
        p_k = k_pool + b_slot[None, :] * stride_k_s + kh64 * stride_k_h + o_dk[:, None]
        b_kt = tl.load(p_k, mask=m_dk[:, None] & m_n[None, :], other=0.0)  # [BK, BN]
        b_s = tl.dot(b_q, b_kt, input_precision=DOT_PRECISION) * qk_scale  # [BM, BN]
        m_vis = (o_n[None, :] <= b_limit[:, None]) & m_n[None, :]
        b_s = tl.where(m_vis, b_s, float("-inf"))
        b_p, b_alpha, b_m_new, b_l = online_softmax_step(b_s, b_m, b_l)  # b_p [BM, BN]
        p_v = v_pool + b_slot[:, None] * stride_v_s + kh64 * stride_v_h + o_dv[None, :]
        b_v = tl.load(p_v, mask=m_n[:, None] & m_dv[None, :], other=0.0)  # [BN, BV]
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PRECISION)
        b_m = b_m_new

    store_rows(
        o,
        o_part,
        ml_part,
        b_acc,
        b_m,
        b_l,
        q0 + o_tok,
        o_head,
        m_row,
        i_s,
        num_tokens,
        num_heads,
        stride_o_t,
        stride_o_h,
        DV,
        BV,
        SPLIT,
    )


def _max_tile_tokens(group: int, bk: int, itemsize: int) -> int:
    """Query tokens of the largest (prefill) tile: ~128 (token, head) rows for 16-bit heads of more than 128 dims
    (on the H200 a 128-row tile with 64-key blocks ran a long causal chunk at Qwen3.5's GQA heads at 2.6x the
    64-row tile's rate; MLA's expanded heads, one query head per key head at 192 / 128 dims, lower for sm_90 to the
    same tile in 230 registers and 160 KB of shared memory without spills, not timed yet; fp32 operands of that
    tile do not fit in shared memory), ~64 otherwise."""
    return max(1, (128 if bk > 128 and itemsize <= 2 else 64) // group)


@dataclass(frozen=True)
class Tile:
    """One launch shape: BT query tokens per tile (BM = BT * GROUP padded tile rows), BN keys per block, warps and
    pipeline stages."""

    bt: int
    bm: int
    bn: int
    num_warps: int
    num_stages: int


def _tile(max_query_len: int, group: int, bk: int, itemsize: int) -> Tile:
    """The launch shape for query length `max_query_len` (`bk`: the padded head dim; `itemsize`: bytes per q / K /
    V element). BT is a power of two (or the largest tile): a handful of compiled variants serve every query
    length; a decode window fits in one tile."""
    largest = _max_tile_tokens(group, bk, itemsize)
    bt = min(triton.next_power_of_2(max(1, max_query_len)), largest)
    bm = max(16, triton.next_power_of_2(bt * group))
    if bk <= 128:
        return Tile(bt, bm, 64, num_warps=4, num_stages=2)
    if bt == largest and bm >= 128 and itemsize <= 2:
        # prefill chunks of large heads: 64-key blocks fit beside the 128-row tile in two stages
        return Tile(bt, bm, 64, num_warps=8, num_stages=2)
    # decode windows of large heads keep the [BK, BN] key block and [BM, BV] accumulator within registers
    return Tile(bt, bm, 32, num_warps=8, num_stages=2)


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot_table: torch.Tensor,
    query_start: torch.Tensor,
    query_len: torch.Tensor,
    num_cached: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    table_rows: torch.Tensor | None = None,
    max_context_len: int | None = None,
    num_splits: int | None = None,
    tile: Tile | None = None,
) -> torch.Tensor:
    """Causal attention of each row's new tokens over its cached prefix and itself, through the slot table.

    q: `[T, H, Dk]` (flat tokens of all rows); k_pool `[S, Hk, Dk]`, v_pool `[S, Hk, Dv]` (pool slots; last dim
    contiguous; same dtype as q: fp32, fp16 or bf16); `H % Hk == 0` (query head h reads key head `h // (H // Hk)`).
    slot_table: `[R, L]` int32/int64, pool slot of each context position (`L >= num_cached + query_len`).
    query_start, query_len, num_cached: `[R]` int32/int64 per row. `table_rows`: optional `[R]` int64 row of
    `slot_table` that holds row r's slots (a KV cache's whole request table can then be passed as it is). `max_query_len`: host bound on `query_len`
    (sizes the grid without a device sync). Returns `out` (`[T, H, Dv]`, q's dtype, allocated when None); only
    the rows' tokens are written, in place.
    """
    t, h, dk = q.shape
    _, hk, dv = v_pool.shape
    assert k_pool.shape[1:] == (hk, dk) and h % hk == 0, f"q {tuple(q.shape)} k {tuple(k_pool.shape)}"
    assert q.dtype == k_pool.dtype == v_pool.dtype, f"dtypes q {q.dtype} k {k_pool.dtype} v {v_pool.dtype}"
    assert q.stride(-1) == 1 and k_pool.stride(-1) == 1 and v_pool.stride(-1) == 1 and slot_table.stride(-1) == 1
    if out is None:
        out = q.new_empty(t, h, dv)
    rows = query_len.shape[0]
    if rows == 0 or max_query_len == 0:
        return out
    group = h // hk
    # tensor-core dots need every dimension >= 16; padded head dims are masked on load and store
    bk, bv = max(16, triton.next_power_of_2(dk)), max(16, triton.next_power_of_2(dv))
    tile = tile or _tile(max_query_len, group, max(bk, bv), q.element_size())
    bt, bm, bn = tile.bt, tile.bm, tile.bn
    m_tiles = triton.cdiv(max_query_len, bt)
    if num_splits is None:
        num_splits = (
            1 if max_context_len is None else num_context_splits(m_tiles * rows * hk, max_context_len, bn, q.device)
        )
    assert 1 <= num_splits <= MAX_SPLITS, f"num_splits {num_splits} not in 1..{MAX_SPLITS}"
    o_part, ml_part = split_buffers(out, num_splits)
    grid = (m_tiles * num_splits, rows, hk)
    paged_attention_kernel[grid](
        q,
        k_pool,
        v_pool,
        out,
        o_part,
        ml_part,
        slot_table,
        table_rows,
        query_start,
        query_len,
        num_cached,
        scale * LOG2E,
        t,
        h,
        num_splits,
        q.stride(0),
        q.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        v_pool.stride(0),
        v_pool.stride(1),
        out.stride(0),
        out.stride(1),
        slot_table.stride(0),
        GROUP=group,
        DK=dk,
        DV=dv,
        BT=bt,
        BM=bm,
        BN=bn,
        BK=bk,
        BV=bv,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SPLIT=num_splits > 1,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    if num_splits > 1:
        combine_splits(o_part, ml_part, out, query_start, query_len, max_query_len, num_splits)
    return out


def tile_query_lengths(group: int, bk: int, itemsize: int) -> list[int]:
    """One query length per tile variant a launch can take (`_tile`): the powers of two below the largest tile,
    and the largest tile."""
    largest = _max_tile_tokens(group, bk, itemsize)
    return [1 << i for i in range(largest.bit_length()) if 1 << i < largest] + [largest]


def warmup_paged_attention(
    heads: int, kv_heads: int, dk: int, dv: int, dtype: torch.dtype, device, table_rows: bool
) -> int:
    """Compile every variant of the kernels a model's attention launches (each tile size, split and unsplit) on
    scratch tensors, so no serving step compiles one; returns the launch count. `table_rows`: whether the caller
    addresses the KV cache's request table by row (the pool path) or passes its own table (gathered KV)."""
    group = heads // kv_heads
    bk, itemsize = max(16, triton.next_power_of_2(max(dk, dv))), dtype.itemsize
    # two key blocks of the widest: a split launch has something to split
    cached = 2 * max(_tile(n, group, bk, itemsize).bn for n in tile_query_lengths(group, bk, itemsize))
    launches = 0
    for query_len in tile_query_lengths(group, bk, itemsize):
        total = cached + query_len
        q = torch.randn(query_len, heads, dk, device=device).to(dtype)
        k_pool = torch.randn(total, kv_heads, dk, device=device).to(dtype)
        v_pool = torch.randn(total, kv_heads, dv, device=device).to(dtype)
        table = torch.arange(total, device=device)[None]
        ints = dict(dtype=torch.int32, device=device)
        rows = torch.zeros(1, dtype=torch.int64, device=device) if table_rows else None
        for splits in (1, 2):
            paged_attention(
                q,
                k_pool,
                v_pool,
                table,
                torch.zeros(1, **ints),
                torch.full((1,), query_len, **ints),
                torch.full((1,), cached, **ints),
                dk**-0.5,
                query_len,
                table_rows=rows,
                num_splits=splits,
            )
            launches += 1
    return launches
