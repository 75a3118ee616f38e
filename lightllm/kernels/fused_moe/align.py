"""Token-expert pairs sorted by expert and padded to whole `block_m` blocks, on the device, in fixed shapes.

Pair `p = t * top_k + j` is token t's j-th choice. The pairs are laid out expert after expert (stable: in pair
order within an expert), each expert's run padded with the sentinel `num_pairs` up to a multiple of `block_m`, so
every block of `block_m` rows belongs to one expert. At most `min(E, num_pairs)` experts are non-empty, so the
padded length never exceeds `num_pairs + min(E, num_pairs) * (block_m - 1)`: every output is sized by that bound
(host shapes only, no `.item()`), blocks past the real end name expert E and are skipped by the GEMMs.

Three launches, no atomics (the same layout every run): `moe_align_count_kernel` counts each chunk of `BP` pairs
per expert; `moe_align_plan_kernel` (one program) turns the counts into each chunk's first slot per expert (a tile
of chunks per load) and stores each expert's pair count and padded start; `moe_align_scatter_kernel` runs one
program per chunk and one per tile of `BB` blocks. A chunk's program writes every pair of the chunk at its expert's
start + its chunk's offset + its rank among the chunk's pairs of that expert. A tile's program names each of its
blocks' expert (from the padded ends) and writes the sentinel into the rows no pair takes: rows of an expert's run
from its pair count on, and every row of the blocks past the real end. No row is written twice, so the programs
need no order among them.
`align_pairs_reference` is the same layout in torch ops (a stable sort), the reference of the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# one-hot blocks of [BP, BE] pairs x experts stay within this many elements per program
ONE_HOT_ELEMENTS = 16384
# rows a scatter program fills with the sentinel at most (one [BB, block_m] tile of int32)
TILE_ROWS = 4096
MAX_INT32 = tl.constexpr(2147483647)


@dataclass(frozen=True)
class ExpertBlocks:
    # [num_blocks * block_m] int32: the pair id of each padded row, `num_pairs` on padding rows
    sorted_pairs: torch.Tensor
    # [num_blocks] int32: the expert of each block, `num_experts` past the last real block
    block_expert: torch.Tensor
    block_m: int
    num_pairs: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert.shape[0]


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks of the worst-case padded layout (a host bound used to size grids and buffers)."""
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)


@triton.jit
def _chunk_one_hot(ids, i_c, num_pairs, E, BP: tl.constexpr, BE: tl.constexpr):
    """Pairs `i_c * BP ..` of the flat ids: their offsets, mask, experts and the `[BP, BE]` int32 one-hot."""
    o_p = i_c * BP + tl.arange(0, BP)
    m_p = o_p < num_pairs
    b_e = tl.load(ids + o_p, mask=m_p, other=-1).to(tl.int32)
    o_e = tl.arange(0, BE)
    b_hot = ((b_e[:, None] == o_e[None, :]) & (o_e < E)[None, :]).to(tl.int32)
    return o_p, m_p, b_e, b_hot


# pair, chunk and block counts vary from launch to launch: specialising on them would compile variants mid-serving
@triton.jit(do_not_specialize=["num_pairs"])
def moe_align_count_kernel(
    ids,  # [P] int32/int64 expert of each pair
    chunk_counts,  # [num_chunks, E] int32 out: pairs of chunk c choosing expert e
    num_pairs,
    E,
    BP: tl.constexpr,
    BE: tl.constexpr,
):
    i_c = tl.program_id(0)
    _, _, _, b_hot = _chunk_one_hot(ids, i_c, num_pairs, E, BP, BE)
    o_e = tl.arange(0, BE)
    tl.store(chunk_counts + i_c.to(tl.int64) * E + o_e, tl.sum(b_hot, axis=0), mask=o_e < E)


@triton.jit(do_not_specialize=["num_chunks"])
def moe_align_plan_kernel(
    chunk_counts,  # [num_chunks, E] int32: in counts, out each chunk's first rank per expert (exclusive prefix)
    pad_start,  # [E] int32 out: first padded row of each expert
    expert_count,  # [E] int32 out: pairs of each expert
    num_chunks,
    E,
    BM: tl.constexpr,
    BE: tl.constexpr,
    BCH: tl.constexpr,
):
    o_e = tl.arange(0, BE)
    m_e = o_e < E
    b_run = tl.zeros([BE], dtype=tl.int32)
    # BCH chunks' counts per load: one dependent round trip to memory per tile of chunks, not per chunk
    for c0 in range(0, num_chunks, BCH):
        o_c = c0 + tl.arange(0, BCH)
        m_ce = (o_c < num_chunks)[:, None] & m_e[None, :]
        p_c = chunk_counts + o_c[:, None] * E + o_e[None, :]
        b_n = tl.load(p_c, mask=m_ce, other=0)
        tl.store(p_c, b_run[None, :] + tl.cumsum(b_n, axis=0) - b_n, mask=m_ce)
        b_run += tl.sum(b_n, axis=0)
    b_pad = (b_run + BM - 1) // BM * BM
    tl.store(pad_start + o_e, tl.cumsum(b_pad, axis=0) - b_pad, mask=m_e)
    tl.store(expert_count + o_e, b_run, mask=m_e)


@triton.jit
def _scatter_chunk(ids, chunk_offsets, pad_start, sorted_pairs, i_c, num_pairs, E, BP: tl.constexpr, BE: tl.constexpr):
    """Every pair of chunk `i_c` to its row of the layout."""
    o_p, m_p, b_e, b_hot = _chunk_one_hot(ids, i_c, num_pairs, E, BP, BE)
    # rank of each pair among the chunk's earlier pairs of its expert: the inclusive count at its own column - 1
    b_rank = tl.sum(tl.where(b_hot != 0, tl.cumsum(b_hot, axis=0) - 1, 0), axis=1)
    m_e = m_p & (b_e >= 0) & (b_e < E)
    b_start = tl.load(pad_start + b_e, mask=m_e, other=0)
    b_chunk = tl.load(chunk_offsets + i_c.to(tl.int64) * E + b_e, mask=m_e, other=0)
    tl.store(sorted_pairs + b_start + b_chunk + b_rank, o_p.to(tl.int32), mask=m_e)


@triton.jit
def _own_blocks(
    pad_start,
    expert_count,
    sorted_pairs,
    block_expert,
    i_t,
    num_pairs,
    num_blocks,
    E,
    BM: tl.constexpr,
    BE: tl.constexpr,
    BB: tl.constexpr,
):
    """The expert of blocks `i_t * BB ..` and the sentinel on their rows that no pair takes."""
    o_e = tl.arange(0, BE)
    m_e = o_e < E
    b_start = tl.load(pad_start + o_e, mask=m_e, other=0)
    b_count = tl.load(expert_count + o_e, mask=m_e, other=0)
    # a block belongs to the first expert whose padded run ends after the block's first row; columns past E end
    # at MAX_INT32 and are never counted, so a block past the real end counts the E experts and names expert E
    b_end = tl.where(m_e, b_start + (b_count + BM - 1) // BM * BM, MAX_INT32)
    o_b = i_t * BB + tl.arange(0, BB)
    m_b = o_b < num_blocks
    b_owner = tl.sum((b_end[None, :] <= (o_b * BM)[:, None]).to(tl.int32), axis=1)
    tl.store(block_expert + o_b, b_owner, mask=m_b)
    # the owner's pairs fill its run from its start: the rows from its pair count on are padding (every row of
    # a block past the end is: it reads start 0 and count 0)
    m_own = m_b & (b_owner < E)
    b_first = tl.load(pad_start + b_owner, mask=m_own, other=0)
    b_used = tl.load(expert_count + b_owner, mask=m_own, other=0)
    o_r = o_b[:, None] * BM + tl.arange(0, BM)[None, :]
    m_pad = m_b[:, None] & (o_r - b_first[:, None] >= b_used[:, None])
    tl.store(sorted_pairs + o_r, tl.full([BB, BM], 0, tl.int32) + num_pairs, mask=m_pad)


@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "num_blocks"])
def moe_align_scatter_kernel(
    ids,
    chunk_offsets,  # [num_chunks, E] int32: each chunk's first rank per expert
    pad_start,  # [E] int32
    expert_count,  # [E] int32
    sorted_pairs,  # [num_blocks * BM] int32 out
    block_expert,  # [num_blocks] int32 out
    num_pairs,
    num_chunks,
    num_blocks,
    E,
    BM: tl.constexpr,
    BP: tl.constexpr,
    BE: tl.constexpr,
    BB: tl.constexpr,
):
    # programs 0 .. num_chunks - 1 take a chunk each, the rest a tile of blocks each (a branch uniform over the
    # program): no program does both parts in a row, the two kinds run side by side
    pid = tl.program_id(0)
    if pid < num_chunks:
        _scatter_chunk(ids, chunk_offsets, pad_start, sorted_pairs, pid, num_pairs, E, BP, BE)
    else:
        _own_blocks(
            pad_start, expert_count, sorted_pairs, block_expert, pid - num_chunks, num_pairs, num_blocks, E, BM, BE, BB
        )


def tile_sizes(num_experts: int, block_m: int) -> dict[str, int]:
    """The compile-time tiles of the three kernels for `num_experts` and `block_m` (fixed per model and BLOCK_M, not
    per batch: no compiled variant beyond those of BLOCK_M): BE experts (a power of two), BP pairs per chunk, BCH
    chunks per step of the plan, each one-hot or count tile within `ONE_HOT_ELEMENTS`; BB blocks per tile of the
    scatter, its `[BB, BE]` owner compare within `ONE_HOT_ELEMENTS` and its `BB * block_m` rows within
    `TILE_ROWS`."""
    be = triton.next_power_of_2(num_experts)
    per_tile = max(16, ONE_HOT_ELEMENTS // be)
    return dict(BE=be, BP=per_tile, BCH=per_tile, BB=max(1, min(per_tile, TILE_ROWS // block_m)))


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """`ids [T, top_k]` (int32/int64 expert ids in 0..E-1) -> the padded per-expert layout of its pairs."""
    flat = ids.reshape(-1)
    num_pairs = flat.numel()
    num_blocks = max_blocks(num_pairs, num_experts, block_m)
    sorted_pairs = torch.empty(num_blocks * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=ids.device)
    if num_pairs == 0:
        return ExpertBlocks(sorted_pairs, block_expert, block_m, 0)
    tiles = tile_sizes(num_experts, block_m)
    be, bp, bb = tiles["BE"], tiles["BP"], tiles["BB"]
    num_chunks = triton.cdiv(num_pairs, bp)
    chunk_counts = torch.empty(num_chunks, num_experts, dtype=torch.int32, device=ids.device)
    pad_start = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    expert_count = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    warps = 8 if bp * be >= 8192 else 4
    moe_align_count_kernel[(num_chunks,)](flat, chunk_counts, num_pairs, num_experts, BP=bp, BE=be, num_warps=warps)
    moe_align_plan_kernel[(1,)](
        chunk_counts,
        pad_start,
        expert_count,
        num_chunks,
        num_experts,
        BM=block_m,
        BE=be,
        BCH=tiles["BCH"],
        num_warps=8,
    )
    moe_align_scatter_kernel[(num_chunks + triton.cdiv(num_blocks, bb),)](
        flat,
        chunk_counts,
        pad_start,
        expert_count,
        sorted_pairs,
        block_expert,
        num_pairs,
        num_chunks,
        num_blocks,
        num_experts,
        BM=block_m,
        BP=bp,
        BE=be,
        BB=bb,
        num_warps=warps,
    )
    return ExpertBlocks(sorted_pairs, block_expert, block_m, num_pairs)


def align_pairs_reference(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """`align_pairs` in torch ops (integer scatter-add, stable sort, searchsorted): the reference layout."""
    flat = ids.reshape(-1).long()
    num_pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    pad_start = pad_end - padded
    count_start = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)
    sorted_expert = flat[order]
    rank = torch.arange(num_pairs, device=device) - count_start[sorted_expert]
    num_blocks = max_blocks(num_pairs, num_experts, block_m)
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[pad_start[sorted_expert] + rank] = order.to(torch.int32)
    block_start = torch.arange(num_blocks, device=device) * block_m
    # the first expert whose padded run ends after the block's start owns it; empty experts own nothing
    block_expert = torch.searchsorted(pad_end, block_start, right=True).to(torch.int32)
    return ExpertBlocks(sorted_pairs, block_expert, block_m, num_pairs)
