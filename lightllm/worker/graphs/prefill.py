"""Short prefill steps of one request through fixed-address buffers, replayed as CUDA graphs.

A prefix-cache hit, a later turn of a conversation or a short prompt prefills tens to hundreds of new tokens.
Eagerly such a step costs several times its GPU work on the host (hundreds of launches, the chunked recurrence's
Python side), which is most of a hit's time to first token. A step whose only row is a prefill of at most the
largest bucket (16, 32, 64, ... tokens) instead runs padded to a bucket through persistent buffers, captured once
per bucket at start-up. Padding tokens sit after the real ones, so causal attention and the causal conv never let a
real token see them; they write their KV to the HOLD slot and change no linear state (`PrefillRows.padded_valid`:
decay 1, no update). The row's real token count, cached length, request-table row and state slot are device
values, so one graph serves every request and every length up to its bucket. A step with such a row beside decode
rows replays this graph and then the decode graph; a step of a few such rows replays it once per row
(`ModelRunner._forward_fixed_buffers`).

Without CUDA (or with graphs disabled) the same buffers run the forward eagerly: the CPU tests drive this path and
compare it with cold runs and transformers, so padding and bucketing are checked where no GPU exists.
"""

from __future__ import annotations

import numpy as np
import torch

from lightllm.cache.device_copy import copy_to_device
from lightllm.linear_att.base import PrefillRows
from lightllm.models.context import AttentionGroup, StepContext
from lightllm.worker.graphs.buckets import BucketGraphs

# int64 fields of the token buffer, each [max_tokens]; "table_row" uses its first entry
_I64 = ("input_ids", "positions", "write_slots", "token_index", "real", "table_row")
# int32 scalars of the row: its first flat token (0) and real token count double as cu_seqlens [0, n]
_I32 = ("query_start", "query_len", "num_cached", "state_slot")


def prefill_buckets(max_tokens: int) -> list[int]:
    """Token counts a prefill graph is captured for: powers of two from 16, the last one `max_tokens`."""
    sizes, size = [], 16
    while size < max_tokens:
        sizes.append(size)
        size *= 2
    return sizes + [max_tokens] if max_tokens > 0 else []


class PrefillGraphs:
    """Prefill forwards of one row of up to `max_tokens` new tokens over fixed buffers; graphs on CUDA."""

    def __init__(self, model, kv, state, max_tokens: int, use_graphs: bool):
        self.model, self.kv, self.state = model, kv, state
        self._graphs = BucketGraphs(prefill_buckets(max_tokens), self._forward, self._fill_hold, "short prefill steps")
        self.buckets, self.max_tokens = self._graphs.buckets, max_tokens
        device = kv.device
        self._i64 = torch.zeros(len(_I64), max_tokens, dtype=torch.int64, device=device)
        self._i32 = torch.zeros(len(_I32), dtype=torch.int32, device=device)
        self._host64 = np.zeros((len(_I64), max_tokens), dtype=np.int64)
        self._host32 = np.zeros(len(_I32), dtype=np.int32)
        self.use_graphs = use_graphs and device.type == "cuda"

    def bucket(self, num_tokens: int) -> int | None:
        """The smallest bucket holding `num_tokens` new tokens; None when the chunk is too long for graphs."""
        return self._graphs.bucket(num_tokens) if num_tokens > 0 else None

    def _context(self, tokens: int) -> StepContext:
        """A step context whose tensors are views of the persistent buffers (the same addresses every step)."""
        field64 = {name: self._i64[i, :tokens] for i, name in enumerate(_I64)}
        field32 = {name: self._i32[i : i + 1] for i, name in enumerate(_I32)}
        real = field64["real"] != 0
        group = AttentionGroup(
            token_index=field64["token_index"][None],
            valid=real[None],
            table=self.kv.req_to_slot,
            table_rows=field64["table_row"][:1],
            context_len=self.kv.max_req_len,
            query_start=field32["query_start"],
            query_len=field32["query_len"],
            num_cached=field32["num_cached"],
        )
        rows = PrefillRows(
            slots=field32["state_slot"],
            cu_seqlens=self._i32[: _I32.index("query_len") + 1],
            has_initial_state=field32["num_cached"] > 0,
            padded_valid=real,
        )
        return StepContext(
            positions=field64["positions"],
            num_prefill_tokens=tokens,
            write_slots=field64["write_slots"],
            groups=[group],
            kv=self.kv,
            state=self.state,
            prefill_rows=rows,
        )

    def _forward(self, tokens: int) -> torch.Tensor:
        ctx = self._context(tokens)
        hidden = self.model(self._i64[0, :tokens], ctx)
        self.state.finish_prefill(ctx.prefill_rows.slots)
        return hidden

    def _fill_hold(self, tokens: int) -> None:
        """A row of padding only, on the HOLD slots: the inputs of warm-up and capture, which must change no state.
        It starts from the HOLD slot's own state (cached length 1), so the state it writes back is that state."""
        self._host64[:] = 0
        self._host64[_I64.index("write_slots")] = self.kv.hold_slot
        self._host32[:] = 0
        self._host32[_I32.index("num_cached")] = 1
        self._host32[_I32.index("state_slot")] = self.state.hold_slot
        self._upload(tokens)

    def _upload(self, tokens: int) -> None:
        copy_to_device(self._i64[:, :tokens], self._host64[:, :tokens])
        copy_to_device(self._i32, self._host32)

    def capture(self) -> None:
        """Capture one graph per bucket, largest first (call after the kernels' warm-up). A capture failure turns
        graphs off (logged) instead of failing start-up."""
        if self.use_graphs:
            self.use_graphs = self._graphs.capture()

    def run(self, input_ids: np.ndarray, num_cached: int, kv_row: int, state_slot: int) -> torch.Tensor:
        """Prefill `input_ids` (n new tokens, `n <= max_tokens`) of the request in KV row `kv_row` and state slot
        `state_slot` after its `num_cached` committed tokens (their KV slots already allocated). Writes the
        tokens' KV and the row's linear state like an eager prefill step and returns the hidden states of the
        padded step `[bucket, hidden]` (a view, valid until the next run; the first n rows are the tokens')."""
        n = len(input_ids)
        tokens = self.bucket(n)
        assert tokens is not None, f"a prefill of {n} tokens does not fit the largest bucket {self.max_tokens}"
        h64, h32 = self._host64, self._host32
        h64[:, :tokens] = 0
        h64[_I64.index("input_ids"), :n] = input_ids
        # padding takes the row's first position and writes its KV to the HOLD slot
        positions = np.full(tokens, num_cached, dtype=np.int64)
        positions[:n] += np.arange(n)
        h64[_I64.index("positions"), :tokens] = positions
        h64[_I64.index("write_slots"), :tokens] = self.kv.hold_slot
        h64[_I64.index("write_slots"), :n] = self.kv.table_cpu[kv_row, num_cached : num_cached + n]
        # padding queries repeat the last real token's index (their attention output is discarded)
        h64[_I64.index("token_index"), :tokens] = np.minimum(np.arange(tokens), n - 1)
        h64[_I64.index("real"), :n] = 1
        h64[_I64.index("table_row"), 0] = kv_row
        h32[:] = (0, n, num_cached, state_slot)
        self._upload(tokens)
        return self._graphs.run(tokens)
