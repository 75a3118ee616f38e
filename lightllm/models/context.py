"""Per-step metadata shared by every layer of one forward: positions, KV addressing, linear-state rows.

Built once per step on the host from the batch description with a few array operations (no per-row Python);
layers only read it. Tokens are flat in row order: prefill rows packed first, then decode rows padded to one width
W, so the decode tokens are a dense `[rows, W]` block whatever each row's own width (`padded_token_index` maps
the real tokens into this layout; padding tokens write their KV to the HOLD slot and no state). Full attention
runs per group of rows: consecutive prefill rows share a group while its rows times its longest context stay
within `MAX_GROUP_CONTEXT_TOKENS` (`prefill_group_spans`), all decode rows form one group.
A group addresses keys through the KV cache's request table (`table[table_rows[i], position]`); the dense
`[rows, L]` slot table and causal mask that the torch path needs are gathered on the device only when asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from lightllm.cache.device_copy import to_device
from lightllm.cache.kv_cache import KVCache, ragged_arange
from lightllm.linear_att.base import DecodeRows, LinearAttState, PrefillRows
from lightllm.linear_att.fla_prefill import chunk_index

# prefill rows of one attention group times its longest context: bounds what a group gathers or pads at once (the
# torch path's dense slot table and mask, MLA's expanded keys), while a step of many short prompts attends in one
# launch instead of one per row
MAX_GROUP_CONTEXT_TOKENS = 1 << 16


@dataclass
class AttentionGroup:
    """Rows attended together: padded queries, where their context's KV lives, and its length."""

    # [n, Wq] flat index of each query token; padding repeats a valid index (its output is discarded)
    token_index: torch.Tensor
    # [n, Wq] bool: real query tokens
    valid: torch.Tensor
    # [R, max_len] int64 request table of the KV cache, and the row of it that holds each group row's slots
    table: torch.Tensor
    table_rows: torch.Tensor
    # host bound on every row's context (cached + new tokens), padding included
    context_len: int
    # [n] int32 varlen description of the same rows for kernels: first flat token, new tokens, cached prefix
    query_start: torch.Tensor
    query_len: torch.Tensor
    num_cached: torch.Tensor

    @cached_property
    def slot_table(self) -> torch.Tensor:
        """[n, L] int64 KV slot of each context position; positions past a row's end hold the HOLD slot."""
        return self.table[self.table_rows, : self.context_len]

    @cached_property
    def mask(self) -> torch.Tensor:
        """[n, 1, Wq, L] bool: query i of a row (absolute position cached + i) sees keys 0 .. cached + i."""
        wq = self.token_index.shape[1]
        key = torch.arange(self.context_len, device=self.table.device)
        cached = self.num_cached.to(torch.int64)
        limit = cached[:, None] + torch.arange(wq, device=key.device)[None, :]
        ctx_len = cached + self.query_len.to(torch.int64)
        return ((key[None, None, :] <= limit[:, :, None]) & (key[None, None, :] < ctx_len[:, None, None]))[:, None]


@dataclass
class StepContext:
    positions: torch.Tensor
    num_prefill_tokens: int
    # [T] int64 KV slot receiving each new token's keys/values
    write_slots: torch.Tensor
    groups: list[AttentionGroup]
    kv: KVCache
    state: LinearAttState | None = None
    prefill_rows: PrefillRows | None = None
    decode_rows: DecodeRows | None = None
    # what every layer of the step derives alike from it (RoPE's cos and sin), by key: see `shared`
    derived: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.positions.numel()

    def shared(self, key, make):
        """`make()`, computed by the first layer of the step that asks for `key` and reused by the others."""
        if key not in self.derived:
            self.derived[key] = make()
        return self.derived[key]


def _group(
    starts: np.ndarray, q_lens: np.ndarray, cached: np.ndarray, rows: np.ndarray, kv: KVCache, pad_width: int = 0
) -> AttentionGroup:
    wq = max(int(q_lens.max()), pad_width)
    context_len = min(int((cached + q_lens).max()) + wq - int(q_lens.max()), kv.max_req_len)
    cols = np.arange(wq)
    token_index = starts[:, None] + np.minimum(cols[None, :], q_lens[:, None] - 1)
    valid = cols[None, :] < q_lens[:, None]
    device = kv.device
    i64 = np.stack([token_index, valid]).astype(np.int64)
    i32 = np.stack([starts, q_lens, cached]).astype(np.int32)
    i64_dev = to_device(i64, device)
    i32_dev = to_device(i32, device)
    return AttentionGroup(
        token_index=i64_dev[0],
        valid=i64_dev[1].bool(),
        table=kv.req_to_slot,
        table_rows=to_device(rows.astype(np.int64), device),
        context_len=context_len,
        query_start=i32_dev[0],
        query_len=i32_dev[1],
        num_cached=i32_dev[2],
    )


def prefill_group_spans(context_lens: np.ndarray, max_tokens: int = MAX_GROUP_CONTEXT_TOKENS) -> list[tuple[int, int]]:
    """Prefill rows `[start, end)` attending as one group: consecutive rows, a new group where one more row would
    take the group's rows x longest context (`context_lens[i]`: cached + new tokens) past `max_tokens`."""
    spans, start, longest = [], 0, 0
    for i, n in enumerate(context_lens.tolist()):
        if i > start and (i - start + 1) * max(longest, n) > max_tokens:
            spans.append((start, i))
            start, longest = i, 0
        longest = max(longest, n)
    if len(context_lens):
        spans.append((start, len(context_lens)))
    return spans


def padded_decode_width(q_lens: list[int], num_prefill_rows: int, min_width: int) -> int:
    """The width W decode rows are padded to (0 without decode rows)."""
    decode = q_lens[num_prefill_rows:]
    return max(min_width, max(decode)) if decode else 0


def padded_token_index(q_lens: list[int], num_prefill_rows: int, width: int) -> np.ndarray:
    """Position of each real token (flat row order) in the step's layout: prefill rows packed, then decode row i
    at `num_prefill_tokens + i * width`."""
    q = np.asarray(q_lens, dtype=np.int64)
    num_prefill_tokens = int(q[:num_prefill_rows].sum())
    decode_starts = num_prefill_tokens + width * np.arange(len(q) - num_prefill_rows, dtype=np.int64)
    starts = np.concatenate([np.cumsum(q[:num_prefill_rows]) - q[:num_prefill_rows], decode_starts])
    return ragged_arange(starts, q)


def layout_positions(
    row_q: np.ndarray, q: np.ndarray, cached: np.ndarray, rows: np.ndarray, kv: KVCache
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every token of a layout whose row i spans `row_q[i]` places holding `q[i]` real tokens after
    `cached[i]` committed ones: its position, the KV slot it writes (HOLD for padding) and whether it is real.
    Padding tokens take their row's first position."""
    row_of = np.repeat(np.arange(len(q)), row_q)
    col = ragged_arange(np.zeros(len(q), dtype=np.int64), row_q)
    real = col < q[row_of]
    pos = cached[row_of] + np.where(real, col, 0)
    write_slots = np.where(real, kv.table_cpu[rows[row_of], np.minimum(pos, kv.max_req_len - 1)], kv.hold_slot)
    return pos, write_slots, real


def build_context(
    q_lens: list[int],
    cached_lens: list[int],
    num_prefill_rows: int,
    kv_rows: list[int],
    kv: KVCache,
    state: LinearAttState | None = None,
    state_slots: list[int] | None = None,
    position_offset: int = 0,
    decode_width: int = 0,
) -> StepContext:
    """Describe one step. `kv_rows[i]`: row i's request row in `kv` (its whole context, new tokens included, is
    already allocated there); `state_slots[i]`: the row's linear-state slot (None for models/heads without linear
    layers); `decode_width`: pad decode windows to at least this width (the state's max width, so every decode
    step has the same token shape whatever its widths)."""
    device = kv.device
    q = np.asarray(q_lens, dtype=np.int64)
    cached = np.asarray(cached_lens, dtype=np.int64)
    rows = np.asarray(kv_rows, dtype=np.int64)
    np_ = num_prefill_rows
    width = padded_decode_width(q_lens, np_, decode_width)
    num_decode = len(q) - np_
    num_prefill_tokens = int(q[:np_].sum())
    row_q = np.concatenate([q[:np_], np.full(num_decode, width, dtype=np.int64)])
    pos, write_slots, _ = layout_positions(row_q, q, cached, rows, kv)
    packed = to_device(np.stack([pos + position_offset, write_slots]), device)
    starts = np.concatenate([[0], np.cumsum(row_q)])
    spans = prefill_group_spans(cached[:np_] + q[:np_])
    groups = [_group(starts[a:b], q[a:b], cached[a:b], rows[a:b], kv) for a, b in spans]
    ctx = StepContext(
        positions=packed[0],
        num_prefill_tokens=num_prefill_tokens,
        write_slots=packed[1],
        groups=groups,
        kv=kv,
        state=state,
    )
    if num_decode:
        groups.append(_group(starts[np_:-1], q[np_:], cached[np_:], rows[np_:], kv, width))
    if state is not None:
        slots = to_device(np.asarray(state_slots, dtype=np.int32), device)
        if np_:
            # fla's kernels run on CUDA only
            fla = torch.device(device).type == "cuda"
            ctx.prefill_rows = PrefillRows(
                slots=slots[:np_],
                cu_seqlens=to_device(starts[: np_ + 1].astype(np.int32), device),
                has_initial_state=to_device(cached[:np_] > 0, device),
                chunk_indices=to_device(chunk_index(starts[: np_ + 1]), device) if fla else None,
                cu_seqlens_cpu=torch.from_numpy(starts[: np_ + 1].astype(np.int64)) if fla else None,
            )
        if num_decode:
            ctx.decode_rows = DecodeRows(
                slots=slots[np_:],
                widths=to_device(q[np_:].astype(np.int32), device),
                max_width=width,
            )
    return ctx
