"""Per-step metadata shared by every layer of one forward: positions, KV addressing, linear-state rows.

Built once per step on the host from the batch description; layers only read it. Tokens are flat in row order
(prefill rows first, then decode rows). Full attention runs per group of rows: each prefill row is its own
group, all decode rows form one padded group (`[rows, Wmax]` queries against `[rows, Lmax]` gathered keys).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightllm.engine.kv_cache import KVCache
from lightllm.linear_att.base import DecodeRows, LinearAttState, PrefillRows


@dataclass
class AttentionGroup:
    """Rows attended together: padded queries, their context slots and the causal mask."""

    # [n, Wq] flat index of each query token; padding repeats a valid index (its output is discarded)
    token_index: torch.Tensor
    # [n, Wq] bool: real query tokens
    valid: torch.Tensor
    # [n, L] int64 KV slot of each context position (cached + new tokens); padding = HOLD slot
    slot_table: torch.Tensor
    # [n, 1, Wq, L] bool: query i of a row (absolute position cached + i) sees keys 0 .. cached + i
    mask: torch.Tensor
    # [n] int32 varlen description of the same rows for kernels: first flat token, new tokens, cached prefix
    query_start: torch.Tensor
    query_len: torch.Tensor
    num_cached: torch.Tensor


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
    token_starts: list[int],
    q_lens: list[int],
    cached: list[int],
    slots: list[torch.Tensor],
    hold: int,
    device,
    pad_width: int = 0,
) -> AttentionGroup:
    n, wq = len(q_lens), max(max(q_lens), pad_width)
    ctx = max(c + q for c, q in zip(cached, q_lens)) + wq - max(q_lens)
    cols = torch.arange(wq)
    token_index = torch.tensor(token_starts)[:, None] + torch.minimum(cols[None, :], torch.tensor(q_lens)[:, None] - 1)
    valid = cols[None, :] < torch.tensor(q_lens)[:, None]
    table = torch.full((n, ctx), hold, dtype=torch.int64)
    for i, s in enumerate(slots):
        table[i, : s.numel()] = s
    key = torch.arange(ctx)
    limit = torch.tensor(cached)[:, None] + cols[None, :]
    ctx_len = torch.tensor([c + q for c, q in zip(cached, q_lens)])
    mask = (key[None, None, :] <= limit[:, :, None]) & (key[None, None, :] < ctx_len[:, None, None])
    i32 = dict(dtype=torch.int32, device=device)
    return AttentionGroup(
        token_index.to(device),
        valid.to(device),
        table.to(device),
        mask[:, None].to(device),
        query_start=torch.tensor(token_starts, **i32),
        query_len=torch.tensor(q_lens, **i32),
        num_cached=torch.tensor(cached, **i32),
    )


def build_context(
    q_lens: list[int],
    cached_lens: list[int],
    num_prefill_rows: int,
    row_slots: list[torch.Tensor],
    kv: KVCache,
    state: LinearAttState | None = None,
    state_slots: list[int] | None = None,
    position_offset: int = 0,
    decode_width: int = 0,
) -> StepContext:
    """Describe one step. `row_slots[i]`: host int64 KV slots of row i's whole context (cached + new tokens);
    `state_slots[i]`: the row's linear-state slot (None for models/heads without linear layers);
    `decode_width`: pad decode windows to at least this width (the state's max width, so every decode step
    has the same token shape whatever its widths)."""
    device = kv.device
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    positions = torch.cat([torch.arange(c, c + q) for c, q in zip(cached_lens, q_lens)]) + position_offset
    write_slots = torch.cat([s[c : c + q] for s, c, q in zip(row_slots, cached_lens, q_lens)])
    np_ = num_prefill_rows
    groups = [
        _group([starts[i]], [q_lens[i]], [cached_lens[i]], [row_slots[i]], kv.hold_slot, device) for i in range(np_)
    ]
    ctx = StepContext(
        positions=positions.to(device),
        num_prefill_tokens=starts[np_],
        write_slots=write_slots.to(device),
        groups=groups,
        kv=kv,
        state=state,
    )
    if len(q_lens) > np_:
        dec = _group(
            starts[np_:-1], q_lens[np_:], cached_lens[np_:], row_slots[np_:], kv.hold_slot, device, decode_width
        )
        groups.append(dec)
        ctx.decode_index = dec.token_index - starts[np_]
        ctx.decode_valid = dec.valid
    if state is not None:
        i32 = dict(dtype=torch.int32, device=device)
        if np_:
            ctx.prefill_rows = PrefillRows(
                slots=torch.tensor(state_slots[:np_], **i32),
                cu_seqlens=torch.tensor(starts[: np_ + 1], **i32),
                has_initial_state=torch.tensor([c > 0 for c in cached_lens[:np_]], device=device),
            )
        if len(q_lens) > np_:
            ctx.decode_rows = DecodeRows(
                slots=torch.tensor(state_slots[np_:], **i32),
                widths=torch.tensor(q_lens[np_:], **i32),
                max_width=dec.token_index.shape[1],
            )
    return ctx
