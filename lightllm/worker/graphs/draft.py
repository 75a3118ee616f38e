"""MTP drafting of decode steps through fixed-address buffers, replayed as one CUDA graph per batch bucket.

After a decode step every row commits between 1 and W (main hidden, next token) pairs into the MTP head's KV and
then chains `mtp_step` greedy drafts. All of that has a fixed shape once rows are padded to W and the batch to a
bucket, so the whole draft (the commit forward, the chained forwards, the LM head and the argmaxes) is one graph:
the host allocates every KV slot the draft writes up front, fills the per-phase inputs (positions, KV write slots,
query and cached lengths) in two buffers with one copy each, scatters the gathered hidden states into the
padded layout, and replays. Rows past the real batch are HOLD rows (query length 0, KV writes to the HOLD slot).

Rows committing more than W pairs (a prompt's pairs right after its prefill) take the drafter's eager path. An
overlapped MTP step drafts inside its own graph (`spec_step.py`) over these buffers: the host loads what it knows
(`load_full_windows`), the step's graph writes the pairs and their counts (`commit_on_device`) and runs `forward`.
Without CUDA (or with graphs disabled) the same buffers run eagerly, which is how the CPU tests check them.
"""

from __future__ import annotations

import numpy as np
import torch

from lightllm.cache.device_copy import copy_to_device, to_device
from lightllm.models.context import AttentionGroup, StepContext, layout_positions, padded_token_index
from lightllm.worker.graphs.buckets import BucketGraphs, batch_buckets

# int64 fields of one phase ([rows * width] each) and int32 fields ([rows] each); phase 0 commits the pairs,
# phase p >= 1 feeds draft p - 1
_I64 = ("positions", "write_slots", "real")
_I32 = ("query_len", "num_cached")


class DraftGraphs:
    """Draft forwards of up to `max_batch` rows committing at most `width` pairs each, then `mtp_step` drafts."""

    def __init__(self, model, kv, max_batch: int, width: int, mtp_step: int, use_graphs: bool):
        self.model, self.head, self.kv = model, model.mtp, kv
        self.width, self.mtp_step = width, mtp_step
        self._graphs = BucketGraphs(batch_buckets(max_batch), self.forward, self.fill_hold, "MTP drafting")
        self.max_batch = self._graphs.buckets[-1]
        device = kv.device
        self._n_tok = self.max_batch * width
        # rows 0..: token ids of phase 0, each row's last real token, its KV row; then every phase's fields
        self._i64 = torch.zeros(3 + mtp_step * len(_I64), self._n_tok, dtype=torch.int64, device=device)
        self._i32 = torch.zeros(mtp_step * len(_I32), self.max_batch, dtype=torch.int32, device=device)
        self._host64 = np.zeros(tuple(self._i64.shape), dtype=np.int64)
        self._host32 = np.zeros(tuple(self._i32.shape), dtype=np.int32)
        self._hidden = torch.zeros(self._n_tok, model.cfg.hidden_size, dtype=model.embed.dtype, device=device)
        # constants of `commit_on_device`: window columns, each row's first token index less one, draft phases
        # 1 .. mtp_step - 1
        self._columns = torch.arange(width, device=device)
        self._row_ends = torch.arange(self.max_batch, device=device) * width - 1
        self._phases = torch.arange(1, mtp_step, device=device)[:, None]
        self.use_graphs = use_graphs and device.type == "cuda"

    def bucket(self, num_rows: int) -> int | None:
        return self._graphs.bucket(num_rows)

    def _field64(self, phase: int, name: str) -> int:
        return 3 + phase * len(_I64) + _I64.index(name)

    def _field32(self, phase: int, name: str) -> int:
        return phase * len(_I32) + _I32.index(name)

    def _context(self, phase: int, rows: int) -> StepContext:
        w = self.width if phase == 0 else 1
        n_tok = rows * w
        i64, i32 = self._i64, self._i32
        device = i64.device
        group = AttentionGroup(
            token_index=torch.arange(n_tok, device=device).view(rows, w),
            valid=i64[self._field64(phase, "real"), :n_tok].view(rows, w) != 0,
            table=self.kv.req_to_slot,
            table_rows=i64[2, :rows],
            context_len=self.kv.max_req_len,
            query_start=torch.arange(0, n_tok, w, dtype=torch.int32, device=device),
            query_len=i32[self._field32(phase, "query_len"), :rows],
            num_cached=i32[self._field32(phase, "num_cached"), :rows],
        )
        return StepContext(
            positions=i64[self._field64(phase, "positions"), :n_tok],
            num_prefill_tokens=0,
            write_slots=i64[self._field64(phase, "write_slots"), :n_tok],
            groups=[group],
            kv=self.kv,
        )

    def forward(self, rows: int, keep_logits: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Commit forward, then the chained drafts: (drafts `[rows, mtp_step]`, fp32 logits `[rows, mtp_step, V]`,
        or None without `keep_logits`: then each phase's logits stay in the LM head's dtype, which gives the same
        argmax, and are dropped after it)."""
        n_tok = rows * self.width
        embeds = self.model.embed_tokens(self._i64[0, :n_tok])
        out = self.head(embeds, self._hidden[:n_tok], self._context(0, rows))
        last = out[self._i64[1, :rows]]
        drafts, logits = [], []
        for phase in range(self.mtp_step):
            if phase:
                last = self.head(self.model.embed_tokens(drafts[-1]), last, self._context(phase, rows))
            phase_logits = self.model.logits(last, fp32=keep_logits)
            drafts.append(phase_logits.argmax(-1))
            if keep_logits:
                logits.append(phase_logits)
        return torch.stack(drafts, dim=1), torch.stack(logits, dim=1) if keep_logits else None

    def _upload(self, rows: int) -> None:
        copy_to_device(self._i64[:, : rows * self.width], self._host64[:, : rows * self.width])
        copy_to_device(self._i32[:, :rows], self._host32[:, :rows])

    def fill_hold(self, rows: int) -> None:
        h64, h32 = self._host64, self._host32
        h64[:] = 0
        for phase in range(self.mtp_step):
            h64[self._field64(phase, "write_slots")] = self.kv.hold_slot
        h32[:] = 0
        self._upload(rows)

    def capture(self) -> None:
        """One graph per bucket; call after the decode graphs. A failure leaves drafting eager (logged)."""
        if self.use_graphs:
            self.use_graphs = self._graphs.capture()

    def run(
        self, kv_rows: np.ndarray, q_lens: np.ndarray, cached: np.ndarray, tokens: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft for `n = len(q_lens)` rows (`n <= max_batch`, every `q_lens[i] <= width`): row i commits the
        pairs (`hidden`, `tokens`: on the device) of its `q_lens[i]` positions after `cached[i]` committed ones
        (both flat in row order). Allocates the KV slots the draft writes; returns (drafts `[n, mtp_step]`, logits)."""
        n = len(q_lens)
        rows = self.bucket(n)
        assert rows is not None and int(q_lens.max()) <= self.width, "batch outside the captured shapes"
        # the commit's pairs plus one entry per chained draft (the next draft truncates them again)
        self.kv.truncate_many(kv_rows, cached)
        self.kv.extend_many(kv_rows, q_lens + self.mtp_step - 1)
        self._fill(n, rows, kv_rows, q_lens, cached, tokens, hidden)
        drafts, logits = self._graphs.run(rows)
        # the outputs are the graph's buffers: the caller keeps copies
        return drafts[:n].clone(), logits[:n].clone()

    def _fill(
        self,
        n: int,
        rows: int,
        kv_rows: np.ndarray,
        q_lens: np.ndarray,
        cached: np.ndarray,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
    ) -> None:
        """The buffers of `run` for rows whose KV slots are allocated."""
        self._fill_host(n, rows, kv_rows, q_lens, cached)
        layout_dev = to_device(padded_token_index(q_lens.tolist(), 0, self.width), self._hidden.device)
        self._i64[0, layout_dev] = tokens
        self._hidden[layout_dev] = hidden.to(self._hidden.dtype)

    def _fill_host(self, n: int, rows: int, kv_rows: np.ndarray, q_lens: np.ndarray, cached: np.ndarray) -> None:
        """Every buffer but the pairs' tokens and hidden states, from the host, for rows whose KV slots are
        allocated."""
        w, steps = self.width, self.mtp_step
        h64, h32 = self._host64, self._host32
        h64[:, : rows * w] = 0
        h32[:, :rows] = 0
        h64[1, :rows] = np.arange(rows) * w
        h64[1, :n] += q_lens - 1
        h64[2, :n] = kv_rows
        for phase in range(steps):
            width, q = (w, q_lens) if phase == 0 else (1, np.ones(n, dtype=np.int64))
            start = cached if phase == 0 else cached + q_lens + phase - 1
            pos, write_slots, real = layout_positions(np.full(n, width), q, start, kv_rows, self.kv)
            h64[self._field64(phase, "write_slots"), : rows * width] = self.kv.hold_slot
            # the head's positions are one past the main model's: the pair (h_t, x_{t+1}) sits at t + 1
            for name, values in (("positions", pos + 1), ("write_slots", write_slots), ("real", real)):
                h64[self._field64(phase, name), : len(values)] = values
            h32[self._field32(phase, "query_len"), :n] = q
            h32[self._field32(phase, "num_cached"), :n] = start
        self._upload(rows)

    def load_full_windows(self, kv_rows: np.ndarray, cached: np.ndarray, max_extra: np.ndarray) -> int:
        """Allocate the KV slots and fill the host's part of the buffers for a draft whose counts are still on the
        device (`commit_on_device` writes the rest): row i will commit 1 .. W pairs after `cached[i]` committed
        ones plus at most `max_extra[i]` (pairs of a draft still in flight). KV slots are allocated for the worst
        case. Returns the bucket."""
        n = len(kv_rows)
        rows = self.bucket(n)
        assert rows is not None, "batch outside the captured shapes"
        keep = cached + max_extra
        self.kv.truncate_many(kv_rows, keep)
        short = keep - self.kv.lengths_cpu[kv_rows]
        self.kv.extend_many(kv_rows, short + self.width + self.mtp_step - 1)
        self._fill_host(n, rows, kv_rows, np.full(n, self.width, dtype=np.int64), cached)
        return rows

    def commit_on_device(
        self, rows: int, pairs: torch.Tensor, hidden: torch.Tensor, num_pairs: torch.Tensor, extra: torch.Tensor
    ) -> None:
        """The device's part of a loaded bucket (`load_full_windows`): row i commits the first `num_pairs[i]` of
        its W pairs (`pairs [rows, W]` tokens, `hidden [rows * W, hidden]`) after `cached[i] + extra[i]` committed
        ones. A HOLD row has `num_pairs` 0: it commits nothing and its drafts write the HOLD slot."""
        w, i64, i32 = self.width, self._i64, self._i32
        i64[0, : rows * w] = pairs.reshape(-1)
        self._hidden[: rows * w] = hidden.to(self._hidden.dtype)
        live = num_pairs > 0
        q = num_pairs.to(dtype=torch.int64)
        start = i32[self._field32(0, "num_cached"), :rows].long() + extra.to(dtype=torch.int64)
        table_rows = i64[2, :rows]
        max_col = self.kv.max_req_len - 1
        real = self._columns[None, :] < q[:, None]
        pos = start[:, None] + self._columns[None, :]
        slots = self.kv.req_to_slot[table_rows[:, None], pos.clamp(max=max_col)]
        # padding places take their row's first position, as `layout_positions` gives them
        i64[self._field64(0, "positions"), : rows * w] = (torch.where(real, pos, start[:, None]) + 1).flatten()
        i64[self._field64(0, "write_slots"), : rows * w] = torch.where(real, slots, self.kv.hold_slot).flatten()
        # the buffers' copies cast: no separate cast kernels
        i64[self._field64(0, "real"), : rows * w] = real.flatten()
        i32[self._field32(0, "query_len"), :rows] = q
        i32[self._field32(0, "num_cached"), :rows] = start
        torch.add(self._row_ends[:rows], q.clamp(min=1), out=i64[1, :rows])
        if self.mtp_step > 1:
            # every draft phase at once: phase p's fields sit a fixed number of buffer rows after phase p - 1's
            last = self.mtp_step - 1
            at = (start + q - 1)[None, :] + self._phases
            step64, step32 = len(_I64), len(_I32)
            first = self._field64(1, "positions")
            i64[first : first + last * step64 : step64, :rows] = at + 1
            first = self._field64(1, "write_slots")
            slots = self.kv.req_to_slot[table_rows, at.clamp(min=0, max=max_col)]
            i64[first : first + last * step64 : step64, :rows] = torch.where(live, slots, self.kv.hold_slot)
            first = self._field32(1, "num_cached")
            i32[first : first + last * step32 : step32, :rows] = at
