"""Per-step metadata shared by every layer of one forward: positions, KV addressing, linear-state rows.

Built once per step on the host from the batch description with a few array operations (no per-row Python);
layers only read it. Tokens are flat in row order (prefill rows first, then decode rows). Full attention runs per
group of rows: each prefill row is its own group, all decode rows form one padded group (`[rows, Wmax]` queries).
A group addresses keys through the KV cache's request table (`table[table_rows[i], position]`); the dense
`[rows, L]` slot table and causal mask that the torch path needs are gathered on the device only when asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from lightllm.engine.kv_cache import KVCache, ragged_arange
from lightllm.linear_att.base import DecodeRows, LinearAttState, PrefillRows


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
    # [Nd, Wmax] flat index of each padded decode token and which ones are real (None without decode rows)
    decode_index: torch.Tensor | None = None
    decode_valid: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.positions.numel()


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
    i64_dev = torch.from_numpy(i64).to(device, non_blocking=True)
    i32_dev = torch.from_numpy(i32).to(device, non_blocking=True)
    return AttentionGroup(
        token_index=i64_dev[0],
        valid=i64_dev[1].bool(),
        table=kv.req_to_slot,
        table_rows=torch.from_numpy(rows.astype(np.int64)).to(device, non_blocking=True),
        context_len=context_len,
        query_start=i32_dev[0],
        query_len=i32_dev[1],
        num_cached=i32_dev[2],
    )


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
    starts = np.concatenate([[0], np.cumsum(q)])
    cols = ragged_arange(cached, q)
    write_slots = kv.table_cpu[np.repeat(rows, q), cols]
    packed = torch.from_numpy(np.stack([cols + position_offset, write_slots])).to(device, non_blocking=True)
    np_ = num_prefill_rows
    groups = [_group(starts[i : i + 1], q[i : i + 1], cached[i : i + 1], rows[i : i + 1], kv) for i in range(np_)]
    ctx = StepContext(
        positions=packed[0],
        num_prefill_tokens=int(starts[np_]),
        write_slots=packed[1],
        groups=groups,
        kv=kv,
        state=state,
    )
    if len(q) > np_:
        dec = _group(starts[np_:-1], q[np_:], cached[np_:], rows[np_:], kv, decode_width)
        groups.append(dec)
        ctx.decode_index = dec.token_index - int(starts[np_])
        ctx.decode_valid = dec.valid
    if state is not None:
        slots = torch.tensor(state_slots, dtype=torch.int32).to(device, non_blocking=True)
        if np_:
            ctx.prefill_rows = PrefillRows(
                slots=slots[:np_],
                cu_seqlens=torch.from_numpy(starts[: np_ + 1].astype(np.int32)).to(device, non_blocking=True),
                has_initial_state=torch.from_numpy(cached[:np_] > 0).to(device, non_blocking=True),
            )
        if len(q) > np_:
            ctx.decode_rows = DecodeRows(
                slots=slots[np_:],
                widths=torch.from_numpy(q[np_:].astype(np.int32)).to(device, non_blocking=True),
                max_width=ctx.decode_index.shape[1],
            )
    return ctx
