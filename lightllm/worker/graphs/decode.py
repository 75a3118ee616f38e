"""Decode-only steps through fixed-address buffers, replayed as CUDA graphs.

A decode step's shape depends only on its row count and the verify width W, so the forward of a decode-only step
is captured once per batch bucket (1, 2, 4, 8, 16, 24, 32, ... up to `--graph_max_batch_size`) and replayed.
Every per-step input lives in two persistent buffers (one int64, one int32) that the host fills with one copy
each: token ids, positions, KV write slots, request-table rows, query lengths, cached lengths, state slots and
widths. Rows past the real batch are HOLD rows: width 0 and query length 0 (no state or attention work), KV
writes to the HOLD slot, state slot = the state's HOLD slot.

Without CUDA (or with graphs disabled) the same buffers run the forward eagerly: the CPU tests drive this path
and compare it with the ordinary step, so bucketing and HOLD rows are checked where no GPU exists.
"""

from __future__ import annotations

import numpy as np
import torch

from lightllm.cache.device_copy import copy_to_device
from lightllm.engine.speculative.device_drafts import write_window_drafts
from lightllm.linear_att.base import DecodeRows
from lightllm.models.context import AttentionGroup, StepContext, layout_positions
from lightllm.worker.graphs.buckets import BucketGraphs, batch_buckets

# int64 fields (each [rows * W] or [rows]) and int32 fields ([rows]) of the persistent input buffers
_I64 = ("input_ids", "positions", "write_slots", "table_rows", "real")
_I32 = ("query_len", "num_cached", "state_slots", "widths")


class DecodeGraphs:
    """Decode forwards of up to `max_batch` rows of width `width` over fixed buffers; graphs on CUDA."""

    def __init__(self, model, kv, state, max_batch: int, width: int, use_graphs: bool):
        self.model, self.kv, self.state = model, kv, state
        self.width = width
        self._graphs = BucketGraphs(batch_buckets(max_batch), self.forward, self.fill_hold, "decode steps")
        self.buckets = self._graphs.buckets
        self.max_batch = self.buckets[-1]
        device = kv.device
        n_tok = self.max_batch * width
        self._i64 = torch.zeros(len(_I64), n_tok, dtype=torch.int64, device=device)
        self._i32 = torch.zeros(len(_I32), self.max_batch, dtype=torch.int32, device=device)
        self._host64 = np.zeros((len(_I64), n_tok), dtype=np.int64)
        self._host32 = np.zeros((len(_I32), self.max_batch), dtype=np.int32)
        self._query_start = torch.arange(0, n_tok, width, dtype=torch.int32, device=device)
        cols = torch.arange(width, device=device)
        self._token_index = torch.arange(0, n_tok, width, device=device)[:, None] + cols[None, :]
        self.use_graphs = use_graphs and device.type == "cuda"

    def bucket(self, num_rows: int) -> int | None:
        """The smallest bucket holding `num_rows` rows; None when the batch is too large for graphs."""
        return self._graphs.bucket(num_rows)

    def _context(self, rows: int) -> StepContext:
        """A step context whose tensors are views of the persistent buffers (the same addresses every step)."""
        n_tok = rows * self.width
        i64, i32 = self._i64, self._i32
        field64 = {name: i64[i] for i, name in enumerate(_I64)}
        field32 = {name: i32[i, :rows] for i, name in enumerate(_I32)}
        group = AttentionGroup(
            token_index=self._token_index[:rows],
            valid=field64["real"][:n_tok].view(rows, self.width) != 0,
            table=self.kv.req_to_slot,
            table_rows=field64["table_rows"][:rows],
            context_len=self.kv.max_req_len,
            query_start=self._query_start[:rows],
            query_len=field32["query_len"],
            num_cached=field32["num_cached"],
        )
        return StepContext(
            positions=field64["positions"][:n_tok],
            num_prefill_tokens=0,
            write_slots=field64["write_slots"][:n_tok],
            groups=[group],
            kv=self.kv,
            state=self.state,
            decode_rows=DecodeRows(slots=field32["state_slots"], widths=field32["widths"], max_width=self.width),
        )

    def forward(self, rows: int) -> torch.Tensor:
        """The forward of a loaded bucket (eager; what each bucket's graph captures)."""
        return self.model(self._i64[0, : rows * self.width], self._context(rows))

    def fill_hold(self, rows: int) -> None:
        """Every row a HOLD row: the inputs of warm-up and capture, which must change no state."""
        self._host64[:] = 0
        self._host64[_I64.index("write_slots")] = self.kv.hold_slot
        self._host32[:] = 0
        self._host32[_I32.index("state_slots")] = self.state.hold_slot
        self._upload(rows)

    def _upload(self, rows: int) -> None:
        n_tok = rows * self.width
        copy_to_device(self._i64[:, :n_tok], self._host64[:, :n_tok])
        copy_to_device(self._i32[:, :rows], self._host32[:, :rows])

    def graph_pool(self):
        """The memory pool of the captured graphs (None without them)."""
        return self._graphs.pool

    def capture(self) -> None:
        """Capture one graph per bucket, largest first (the smaller ones reuse its memory pool). Call after the
        kernels' warm-up/autotune. A capture failure turns graphs off (logged) instead of failing start-up."""
        if self.use_graphs:
            self.use_graphs = self._graphs.capture()

    def load(
        self,
        input_ids: np.ndarray | None,
        q_lens: np.ndarray,
        cached: np.ndarray,
        kv_rows: np.ndarray,
        state_slots: np.ndarray,
    ) -> int:
        """Fill the buffers for a decode-only step of `n = len(q_lens)` rows (`n <= max_batch`), `input_ids
        [n * W]` in the padded layout (None: zeros, for a caller that writes the windows on the device), and
        return its bucket: rows past `n` are HOLD rows."""
        n = len(q_lens)
        rows = self.bucket(n)
        assert rows is not None, f"{n} rows exceed the largest decode bucket {self.max_batch}"
        w = self.width
        n_tok = rows * w
        h64, h32 = self._host64, self._host32
        pos, write_slots, real = layout_positions(np.full(n, w), q_lens, cached, kv_rows, self.kv)
        h64[:, :n_tok] = 0
        h64[_I64.index("write_slots"), :n_tok] = self.kv.hold_slot
        for name, values in (
            ("input_ids", input_ids),
            ("positions", pos),
            ("write_slots", write_slots),
            ("table_rows", kv_rows),
            ("real", real),
        ):
            if values is not None:
                h64[_I64.index(name), : len(values)] = values
        h32[:, :rows] = 0
        h32[_I32.index("state_slots"), :rows] = self.state.hold_slot
        for name, values in (
            ("query_len", q_lens),
            ("num_cached", cached),
            ("state_slots", state_slots),
            ("widths", q_lens),
        ):
            h32[_I32.index(name), :n] = values
        self._upload(rows)
        return rows

    def run(
        self,
        input_ids: np.ndarray,
        q_lens: np.ndarray,
        cached: np.ndarray,
        kv_rows: np.ndarray,
        state_slots: np.ndarray,
        first_tokens: torch.Tensor | None = None,
        draft_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, DecodeRows]:
        """One decode-only step (see `load`), whose rows' first tokens are replaced by `first_tokens [n]` and
        drafts by `draft_ids [n, D]` (device tensors; see `write_window_drafts`) when given. Returns the hidden
        states `[n * W, hidden]` (a view, valid until the next run) and the rows' DecodeRows for `accept`."""
        n, w = len(q_lens), self.width
        rows = self.load(input_ids, q_lens, cached, kv_rows, state_slots)
        if first_tokens is not None:
            self._i64[0, : n * w : w].copy_(first_tokens)
        if draft_ids is not None:
            write_window_drafts(self._i64[0, : n * w].view(n, w), draft_ids)
        hidden = self._graphs.run(rows)
        return hidden[: n * w], self.rows_to_accept(n)

    def rows_to_accept(self, n: int) -> DecodeRows:
        """The first `n` rows of the loaded step as the state's `accept` takes them (HOLD rows have width 0)."""
        i32 = self._i32
        slots, widths = i32[_I32.index("state_slots"), :n], i32[_I32.index("widths"), :n]
        return DecodeRows(slots=slots, widths=widths, max_width=self.width)

    def windows(self, rows: int) -> torch.Tensor:
        """The token ids of a bucket's rows `[rows, W]` (a view of the buffer the forward reads)."""
        return self._i64[0, : rows * self.width].view(rows, self.width)

    def shift_rows(self, rows: int, extra: torch.Tensor) -> None:
        """Move the first `rows` rows' windows `extra[i]` tokens further on the device: positions, cached lengths
        and the KV write slots of real tokens (a HOLD row has none; give it 0). The row's KV row must already hold
        slots that far (a verify still in flight whose counts the host has not read)."""
        w, i64, i32 = self.width, self._i64, self._i32
        extra = extra.to(device=i64.device, dtype=torch.int64)
        positions = i64[_I64.index("positions"), : rows * w].view(rows, w)
        positions += extra[:, None]
        i32[_I32.index("num_cached"), :rows] += extra
        real = i64[_I64.index("real"), : rows * w].view(rows, w) != 0
        table_rows = i64[_I64.index("table_rows"), :rows]
        slots = self.kv.req_to_slot[table_rows[:, None], positions.clamp(max=self.kv.max_req_len - 1)]
        write_slots = i64[_I64.index("write_slots"), : rows * w].view(rows, w)
        write_slots.copy_(torch.where(real, slots, write_slots))
