"""Multi-head latent attention in latent space over the paged latent cache (decode, verify, short chunks).

With `kv_b_proj` absorbed into the projections, head h scores the cached latent `[c_kv (C) | k_rot (R)]` of every
context position directly: `s = (q_lat_h · c_kv + q_rot_h · k_rot) · scale`, where `q_lat_h = W_UK_h^T q_nope_h`
and `q_rot_h` is the head's rope-part query; its output is `sum_p softmax(s)_p · c_kv_p` (`[C]`, lifted to
`v_head_dim` by `W_UV_h` afterwards). Every head reads the same latent, so the attention is multi-query over one
`[S, C + R]` pool (the KV cache's MLA layer, addressed through the request table) and a latent is read once per
program for `BH` heads of `BT` query tokens.

Row `r` has `query_len[r]` new tokens at `q[query_start[r] :]`, at positions `num_cached[r] + i`, each seeing
positions `0 .. num_cached[r] + i` (causal within a verify window). Program `(i_h, i_ms, i_r)` handles head block
`i_h` (the fastest grid axis: the blocks of one row read the same latents back to back, from L2), query tile
`i_ms // num_splits` and context split `i_ms % num_splits` of row `i_r`; splits are merged by the combine kernel
shared with the GQA kernel (`lightllm.kernels.attention_splits`). The split count depends only on the launch's
program count and a host bound on the contexts (the KV cache's row length under CUDA graphs), never on the
step's actual lengths: each row cuts its own context on the device.

Precision: scores, softmax statistics and the output accumulator are fp32 (`ieee` dots for fp32 inputs).

`mla_attention` dispatches: Triton for CUDA tensors, `mla_attention_torch` (the same contract in torch, the CPU
path and the reference) otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path

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
    split_buffers,
    store_rows,
)
from lightllm.kernels.tuned_tables import device_name, nearest_entry, read_table

BACKENDS = ("torch", "triton")


# row counts, token counts, split counts and the per-row tables (slices of a step's packed metadata) vary from
# launch to launch: specialising on them would compile variants in the middle of serving steps
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
def mla_attention_kernel(
    q,  # [T, H, C + R] absorbed queries: latent part, then rope part
    latent,  # [S, C + R] one layer's latent pool
    o,  # [T, H, C] latent-space outputs
    o_part,  # [num_splits, T, H, C] fp32 unnormalised split outputs (unused without SPLIT)
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
    stride_c_s,
    stride_o_t,
    stride_o_h,
    stride_table_r,
    C: tl.constexpr,
    R: tl.constexpr,
    BH: tl.constexpr,
    BT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BC: tl.constexpr,
    BR: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_TABLE_ROWS: tl.constexpr,
    KEYS_MAJOR: tl.constexpr,
):
    i_h, i_ms, i_r = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_m, i_s = i_ms // num_splits, i_ms % num_splits
    i_r64 = i_r.to(tl.int64)
    n_q = tl.load(query_len + i_r64).to(tl.int64)
    if i_m * BT >= n_q:
        return
    q0 = tl.load(query_start + i_r64).to(tl.int64)
    n_c = tl.load(num_cached + i_r64).to(tl.int64)

    # tile row j = (token i_m * BT + j // BH, head i_h * BH + j % BH)
    o_j = tl.arange(0, BM)
    o_tok = i_m * BT + (o_j // BH).to(tl.int64)  # [BM]
    o_head = i_h.to(tl.int64) * BH + (o_j % BH).to(tl.int64)  # [BM]
    m_row = (o_j < BT * BH) & (o_tok < n_q) & (o_head < num_heads)  # [BM]
    o_c = tl.arange(0, BC)
    o_rr = tl.arange(0, BR)
    m_c = o_c < C
    m_rr = o_rr < R

    p_q = q + (q0 + o_tok)[:, None] * stride_q_t + o_head[:, None] * stride_q_h
    b_qc = tl.load(p_q + o_c[None, :], mask=m_row[:, None] & m_c[None, :], other=0.0)  # [BM, BC]
    b_qr = tl.load(p_q + C + o_rr[None, :], mask=m_row[:, None] & m_rr[None, :], other=0.0)  # [BM, BR]

    # last visible position of each tile row; keys past the tile's last real token are never needed
    b_limit = n_c + o_tok  # [BM]
    kv_end = n_c + tl.minimum((i_m + 1) * BT, n_q)
    kv_lo, kv_hi = context_span(kv_end, num_splits, i_s, BN)

    b_m = tl.full([BM], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BM], dtype=tl.float32)
    if KEYS_MAJOR:
        b_acc = tl.zeros([BC, BM], dtype=tl.float32)  # transposed: latent dims as the dot's rows
    else:
        b_acc = tl.zeros([BM, BC], dtype=tl.float32)
    if HAS_TABLE_ROWS:
        i_row = tl.load(table_rows + i_r64).to(tl.int64)
    else:
        i_row = i_r64
    p_table = slot_table + i_row * stride_table_r
    # slots read one block ahead (`block_slots`: so the latent gathers are multi-buffered)
    b_slot_next = block_slots(p_table, kv_lo, kv_hi, BN)
    for start in range(kv_lo, kv_hi, BN):
        o_n = start + tl.arange(0, BN).to(tl.int64)  # [BN] context positions
        m_n = o_n < kv_hi
        b_slot = b_slot_next  # [BN]
        b_slot_next = block_slots(p_table, start + BN, kv_hi, BN)
        p_lat = latent + b_slot * stride_c_s  # [BN]
        # the latent block serves as the keys (transposed) and as the values: loaded once
        b_c = tl.load(p_lat[:, None] + o_c[None, :], mask=m_n[:, None] & m_c[None, :], other=0.0)  # [BN, BC]
        # row-major like the latent block (each key's rope part is contiguous: vectorised loads), transposed in
        # the dot
        b_kr = tl.load(p_lat[:, None] + C + o_rr[None, :], mask=m_n[:, None] & m_rr[None, :], other=0.0)  # [BN, BR]
        if KEYS_MAJOR:
            # both dots transposed, so their rows are the keys and then the latent dims (BN and BC rows, against
            # BM): the MMA spreads its warps over the latent block, each reading its own part once, where a
            # heads-major dot of BM rows spreads them over the keys and every warp reads the whole query block
            b_st = tl.dot(b_c, tl.trans(b_qc), input_precision=DOT_PRECISION)
            b_st = b_st + tl.dot(b_kr, tl.trans(b_qr), input_precision=DOT_PRECISION)  # [BN, BM]
            b_s = tl.trans(b_st) * qk_scale
        else:
            b_s = tl.dot(b_qc, tl.trans(b_c), input_precision=DOT_PRECISION)
            b_s = (b_s + tl.dot(b_qr, tl.trans(b_kr), input_precision=DOT_PRECISION)) * qk_scale  # [BM, BN]
        m_vis = (o_n[None, :] <= b_limit[:, None]) & m_n[None, :]
        b_s = tl.where(m_vis, b_s, float("-inf"))
        b_p, b_alpha, b_m, b_l = online_softmax_step(b_s, b_m, b_l)
        if KEYS_MAJOR:
            b_pv = tl.dot(tl.trans(b_c), tl.trans(b_p.to(b_c.dtype)), input_precision=DOT_PRECISION)  # [BC, BM]
            b_acc = b_acc * b_alpha[None, :] + b_pv
        else:
            b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_c.dtype), b_c, input_precision=DOT_PRECISION)

    if KEYS_MAJOR:
        b_acc = tl.trans(b_acc)

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
        C,
        BC,
        SPLIT,
    )


@dataclass(frozen=True)
class MLATile:
    """Launch shape: `block_heads` heads (a power of two) of `max_tile_rows // block_heads` query tokens per
    program, `block_keys` latents per block, warps and pipeline stages, and the waves of SMs a split launch aims
    to fill (`attention_splits.num_context_splits`).

    The default reads each latent once for all 32 heads of Kimi-Linear at TP1 (two 16-head programs would read it
    twice, the second time from L2) with two 32-latent blocks in flight while a third computes; for sm_90 at rank
    512 it lowers to 176 registers and 112 KB of shared memory without spills (a 64-row tile spills), so one
    program holds an SM. 16-head, 16-key tiles of 4 warps lower to 168 registers and 56-93 KB: two or three
    programs per SM, one computing while the others wait on memory, at twice the L2 reads. `min_tile_rows` pads a
    tile with rows that compute nothing: at 64 rows both dots of a 32-head decode tile lower to sm_90's
    asynchronous warpgroup MMA instead of `mma.sync` (twice the dot work, issued without stalling the loads; a
    64-row verify tile of two tokens needs no padding). `keys_major` transposes both dots, so their rows are the
    latent block's keys and then its latent dims: both lower to the warpgroup MMA without padding, and each warp
    reads its own share of the latent block where a heads-major tile's warps each reread the whole query block
    (with 32-key blocks and 8 warps it lowers for sm_90 at 190 registers, 112 KB of shared memory, no spills). A
    tuned table per device (`get_tile`) picks among them."""

    block_heads: int = 32
    max_tile_rows: int = 32
    block_keys: int = 32
    num_warps: int = 8
    num_stages: int = 3
    waves: int = 2
    min_tile_rows: int = 16
    # both dots transposed (keys, then latent dims, as the MMA's rows; see the kernel)
    keys_major: bool = False


# tuned tiles: `mla_configs/<device>.json`, `{triton_version: {tile_key: {rows_bucket: MLATile fields}}}` (written
# by the GPU benchmark `test/gpu/kernel_speed.py`)
CONFIG_DIR = Path(__file__).parent / "mla_configs"


def tile_key(num_heads: int, rank: int, rope: int, dtype: torch.dtype) -> str:
    return f"H={num_heads},C={rank},R={rope},dtype={str(dtype).removeprefix('torch.')}"


@functools.cache
def _table(device: str) -> dict:
    return read_table(CONFIG_DIR / f"{device}.json")


def tile_of(entry: dict) -> MLATile:
    """A tuned table entry as a tile; ValueError naming the entry unless it has exactly `MLATile`'s fields."""
    names = {f.name for f in dataclasses.fields(MLATile)}
    if set(entry) != names:
        raise ValueError(f"MLA tile entries need exactly {sorted(names)}, got {entry}")
    return MLATile(**entry)


@functools.lru_cache(maxsize=1024)
def get_tile(num_heads: int, rank: int, rope: int, dtype: torch.dtype, device: torch.device, rows: int) -> MLATile:
    """The tuned tile of this shape on this device for `rows` rows (nearest tuned row bucket), else the default."""
    entry = nearest_entry(_table(device_name(device)).get(tile_key(num_heads, rank, rope, dtype)) or {}, rows)
    return tile_of(entry) if entry is not None else MLATile()


def shape_tiles(num_heads: int, rank: int, rope: int, dtype: torch.dtype, device: torch.device) -> list[MLATile]:
    """Every tile `get_tile` can give for this shape (what a warm-up compiles)."""
    entries = _table(device_name(device)).get(tile_key(num_heads, rank, rope, dtype))
    if not entries:
        return [MLATile()]
    return list(dict.fromkeys(tile_of(e) for e in entries.values()))


def _tile(num_heads: int, max_query_len: int, tile: MLATile) -> tuple[int, int, int]:
    """(BH heads, BT tokens, BM tile rows) of a launch: BT is a power of two (or the largest), so a handful of
    compiled variants serve every query length; a tile has at least 16 rows (tensor-core dots), and at least the
    tile's `min_tile_rows`."""
    bh = min(triton.next_power_of_2(num_heads), tile.block_heads)
    max_bt = max(1, tile.max_tile_rows // bh)
    bt = min(triton.next_power_of_2(max(1, max_query_len)), max_bt)
    return bh, bt, max(16, tile.min_tile_rows, bh * bt)


def tile_query_lengths(num_heads: int, tile: MLATile = MLATile()) -> list[int]:
    """One query length per tile variant `_tile` can give."""
    bh = min(triton.next_power_of_2(num_heads), tile.block_heads)
    largest = max(1, tile.max_tile_rows // bh)
    return [1 << i for i in range(largest.bit_length())]


def launch_splits(
    num_heads: int, rows: int, max_query_len: int, max_context_len: int, device: torch.device, tile: MLATile = MLATile()
) -> int:
    """The split count a launch takes: from its program count and the host bound on its contexts only."""
    bh, bt, _ = _tile(num_heads, max_query_len, tile)
    programs = triton.cdiv(num_heads, bh) * triton.cdiv(max_query_len, bt) * rows
    return num_context_splits(programs, max_context_len, tile.block_keys, device, tile.waves)


def _check(q: torch.Tensor, latent: torch.Tensor, out: torch.Tensor, slot_table: torch.Tensor) -> None:
    t, h, d = q.shape
    c = out.shape[-1]
    assert latent.dim() == 2 and latent.shape[1] == d and c < d, f"q {tuple(q.shape)} latent {tuple(latent.shape)}"
    assert out.shape == (t, h, c), f"out {tuple(out.shape)} for q {tuple(q.shape)}"
    assert q.dtype == latent.dtype, f"dtypes q {q.dtype} latent {latent.dtype}"
    assert q.stride(-1) == 1 and latent.stride(-1) == 1 and out.stride(-1) == 1 and slot_table.stride(-1) == 1


def mla_attention_triton(
    q: torch.Tensor,
    latent: torch.Tensor,
    slot_table: torch.Tensor,
    query_start: torch.Tensor,
    query_len: torch.Tensor,
    num_cached: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor,
    table_rows: torch.Tensor | None = None,
    max_context_len: int | None = None,
    num_splits: int | None = None,
    tile: MLATile | None = None,
) -> torch.Tensor:
    """The Triton form of `mla_attention` (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1); `tile`
    overrides the tuned / default launch shape (benchmarks)."""
    _check(q, latent, out, slot_table)
    t, h, d = q.shape
    c = out.shape[-1]
    rows = query_len.shape[0]
    if rows == 0 or max_query_len == 0:
        return out
    tile = tile or get_tile(h, c, d - c, q.dtype, q.device, rows)
    bh, bt, bm = _tile(h, max_query_len, tile)
    m_tiles = triton.cdiv(max_query_len, bt)
    if num_splits is None:
        num_splits = (
            1 if max_context_len is None else launch_splits(h, rows, max_query_len, max_context_len, q.device, tile)
        )
    assert 1 <= num_splits <= MAX_SPLITS, f"num_splits {num_splits} not in 1..{MAX_SPLITS}"
    o_part, ml_part = split_buffers(out, num_splits)
    grid = (triton.cdiv(h, bh), m_tiles * num_splits, rows)
    mla_attention_kernel[grid](
        q,
        latent,
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
        latent.stride(0),
        out.stride(0),
        out.stride(1),
        slot_table.stride(0),
        C=c,
        R=d - c,
        BH=bh,
        BT=bt,
        BM=bm,
        BN=tile.block_keys,
        BC=max(16, triton.next_power_of_2(c)),
        BR=max(16, triton.next_power_of_2(d - c)),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SPLIT=num_splits > 1,
        KEYS_MAJOR=tile.keys_major,
        num_warps=tile.num_warps,
        # fp32 (parity tests only) latent blocks are twice the bytes: one stage keeps them within shared memory
        num_stages=1 if q.element_size() == 4 else tile.num_stages,
    )
    if num_splits > 1:
        combine_splits(o_part, ml_part, out, query_start, query_len, max_query_len, num_splits)
    return out


def mla_attention_torch(
    q: torch.Tensor,
    latent: torch.Tensor,
    slot_table: torch.Tensor,
    query_start: torch.Tensor,
    query_len: torch.Tensor,
    num_cached: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor,
    table_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch form of `mla_attention`: rows padded to `max_query_len` queries over their latents gathered to
    the longest context (read from the lengths: a host sync, fine on the CPU it serves), fp32 softmax."""
    _check(q, latent, out, slot_table)
    rows, c = query_len.shape[0], out.shape[-1]
    if rows == 0 or max_query_len == 0:
        return out
    q_len, cached = query_len.long(), num_cached.long()
    cols = torch.arange(max_query_len, device=q.device)
    valid = cols[None, :] < q_len[:, None]  # [n, Wq]
    token = query_start.long()[:, None] + torch.minimum(cols[None, :], (q_len - 1).clamp(min=0)[:, None])
    # rows without a query may start at T
    token = token.clamp(max=max(q.shape[0] - 1, 0))
    context = cached + q_len
    length = int(context.max())
    if length == 0:
        return out
    table = slot_table if table_rows is None else slot_table[table_rows.long()]
    lat = latent[table[:, :length].long()].float()  # [n, L, C + R]
    scores = torch.einsum("nwhd,nld->nwhl", q[token].float(), lat) * scale
    key = torch.arange(length, device=q.device)
    visible = (key[None, None, :] <= (cached[:, None] + cols[None, :])[:, :, None]) & (
        key[None, None, :] < context[:, None, None]
    )  # [n, Wq, L]
    scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
    # rows without a query see nothing (NaN probabilities): they are not written
    o = torch.einsum("nwhl,nlc->nwhc", torch.softmax(scores, dim=-1), lat[..., :c])
    out[token[valid]] = o[valid].to(out.dtype)
    return out


def mla_attention(
    q: torch.Tensor,
    latent: torch.Tensor,
    slot_table: torch.Tensor,
    query_start: torch.Tensor,
    query_len: torch.Tensor,
    num_cached: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor,
    table_rows: torch.Tensor | None = None,
    max_context_len: int | None = None,
    num_splits: int | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Causal latent-space attention of each row's new tokens over its cached prefix and itself.

    q: `[T, H, C + R]` absorbed queries (flat tokens of all rows); latent: `[S, C + R]` pool (same dtype, last dim
    contiguous); out: `[T, H, C]`, written in place for the rows' tokens only (others keep their values).
    slot_table `[R', L]` int32/int64 pool slot of each context position; `table_rows` optional `[R]` row of it
    holding row r's slots. query_start, query_len, num_cached: `[R]` int32/int64. `max_query_len`: host bound on
    `query_len` (sizes the grid without a sync); `max_context_len`: host bound on the contexts (picks the split
    count; None = no split). `backend`: "torch" | "triton", None = triton for CUDA tensors. Returns `out`.
    """
    backend = backend or ("triton" if q.is_cuda else "torch")
    args = (q, latent, slot_table, query_start, query_len, num_cached, scale, max_query_len, out)
    if backend == "torch":
        return mla_attention_torch(*args, table_rows=table_rows)
    if backend == "triton":
        return mla_attention_triton(
            *args, table_rows=table_rows, max_context_len=max_context_len, num_splits=num_splits
        )
    raise ValueError(f"attention backend {backend!r} not in {BACKENDS}")


def warmup_mla_attention(num_heads: int, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype, device) -> int:
    """Compile every variant of the kernels a latent attention layer launches (each tile size, split and
    unsplit) on scratch tensors, so no serving step compiles one; returns the launch count."""
    launches = 0
    for tile in shape_tiles(num_heads, kv_lora_rank, rope_dim, dtype, torch.device(device)):
        cached = 2 * tile.block_keys  # two key blocks: a split launch has something to split
        for query_len in tile_query_lengths(num_heads, tile):
            total = cached + query_len
            q = torch.randn(query_len, num_heads, kv_lora_rank + rope_dim, device=device).to(dtype)
            latent = torch.randn(total, kv_lora_rank + rope_dim, device=device).to(dtype)
            out = torch.empty(query_len, num_heads, kv_lora_rank, dtype=dtype, device=device)
            table = torch.arange(total, device=device)[None]
            ints = dict(dtype=torch.int32, device=device)
            rows = torch.zeros(1, dtype=torch.int64, device=device)
            for splits in (1, 2):
                mla_attention_triton(
                    q,
                    latent,
                    table,
                    torch.zeros(1, **ints),
                    torch.full((1,), query_len, **ints),
                    torch.full((1,), cached, **ints),
                    1.0,
                    query_len,
                    out,
                    table_rows=rows,
                    num_splits=splits,
                    tile=tile,
                )
                launches += 1
    return launches
