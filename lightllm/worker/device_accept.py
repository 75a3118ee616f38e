"""Verify steps accepted on the device and settled a step later: the runner's side of overlapped MTP steps.

`verify_on_device` runs a verify step of full windows, its acceptance, the state's accept and the MTP head's commit
and drafts for the next windows, with the counts left on the device, so the next step can be launched before the
host reads them (on CUDA the whole step is one graph replay: `graphs/spec_step.py`); the rows' committed lengths
and KV stay as if nothing were accepted until `settle` gives the counts. Until then a step of the same rows shifts
its positions, cached lengths and KV write slots by the unread counts on the device (`_cached_extra`), its KV
allocated for the worst case (`_max_extra`). At most two steps are unsettled: the one being read and the one
launched after it.

A request that reaches its length limit in a step still in flight rides along in the next one, which moves its
state past the tokens it emits; to publish its prefix-cache checkpoint at its end anyway, the step launched after
it first takes a checkpoint of the rows that may reach their limit there (`hold_checkpoints`), which `publish`
uses once that step is settled.

`ModelRunner` inherits these methods; they use its requests, state, KV caches, MTP drafter and step buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from lightllm.cache.device_copy import to_device
from lightllm.worker.records import RequestRecord

if TYPE_CHECKING:
    from lightllm.linear_att.base import Checkpoint


@dataclass(eq=False)
class UnsettledStep:
    """A verify accepted on the device (`verify_on_device`) whose counts the host has not read yet."""

    records: list[RequestRecord]
    widths: list[int]
    # [rows] int64 on the device: tokens each row kept
    counts: torch.Tensor
    # [rows * W, hidden] the step's final hidden states (the MTP head's last hidden once counts are known)
    hidden: torch.Tensor | None
    # row index of each record by identity (lookups stay O(rows) per step at large batches)
    index: dict[int, int] = field(default_factory=dict)

    def __post_init__(self):
        self.index = {id(r): i for i, r in enumerate(self.records)}


@dataclass(eq=False)
class HeldCheckpoint:
    """A row's state and MTP hidden state as `step` left them, taken before the next step changed them."""

    step: UnsettledStep
    checkpoint: Checkpoint
    hidden: torch.Tensor | None


class DeviceAcceptance:
    """The accept-on-device half of `ModelRunner` (see the module docstring)."""

    def hold_checkpoints(self, handles: list[int]) -> None:
        """Before a step is launched after an unsettled one: a checkpoint of each of `handles` as the unsettled step
        leaves it (rows that may reach their length limit in it), replacing the ones held before."""
        self._held = {}
        if not handles or not self._unsettled or self.prefix_cache is None:
            return
        step = self._unsettled[-1]
        rows = [(h, step.index[id(self._requests[h])]) for h in handles if id(self._requests[h]) in step.index]
        if not rows:
            return
        slots = to_device(np.asarray([self._requests[h].state_slot for h, _ in rows], dtype=np.int32), self.device)
        checkpoint = self.state.export_checkpoint(slots)
        hidden = None
        if step.hidden is not None:
            # the last committed token's row of the step's output: window start + kept count - 1
            width = step.widths[0]
            index = to_device(np.asarray([i for _, i in rows], dtype=np.int64), self.device)
            hidden = step.hidden.index_select(0, index * width + step.counts.index_select(0, index).long() - 1)
        for j, (h, _) in enumerate(rows):
            row = slice(j, j + 1)
            held = type(checkpoint)(conv=checkpoint.conv[:, row], ssm=checkpoint.ssm[:, row])
            self._held[h] = HeldCheckpoint(step, held, None if hidden is None else hidden[row])

    def _held_checkpoint(self, handle: int) -> HeldCheckpoint | None:
        """The checkpoint held for `handle` if the step it was taken after is settled and no later step of the row
        is: the row's state at its committed length."""
        held = self._held.get(handle)
        record = self._requests[handle]
        if held is None or any(step is held.step for step in self._unsettled) or record.settled_step is not held.step:
            return None
        return held

    def can_verify_on_device(self, handles: list[int], width: int) -> bool:
        """Whether a step of these rows' verify windows of `width` tokens may run on the device alone
        (`verify_on_device`): the overlapped step's buffers hold the batch at that width, the rows' MTP pairs are
        all drafted, the head's KV has room for the worst case, and at most one such step is unsettled."""
        graphs, drafter = self.spec_step_graphs, self.drafter
        if graphs is None or drafter is None or width != graphs.width or len(self._unsettled) > 1:
            return False
        if graphs.bucket(len(handles)) is None:
            return False
        if any(self._requests[h].mtp_hidden for h in handles):
            return False
        return drafter.kv.num_free_tokens() >= len(handles) * (2 * self.max_width + self.mtp_step)

    @torch.inference_mode()
    def verify_on_device(
        self,
        handles: list[int],
        windows: torch.Tensor,
        room: np.ndarray,
        kept: np.ndarray | None = None,
        keep_logits: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A greedy verify step of full windows left on the device (`can_verify_on_device` said so): `windows
        [rows, W]` (on the device: each row's last token, then its drafts) are verified (at most `room[i]` drafts
        kept, counted from the row's length as the host knows it; `kept[i]` of them when given: simulated
        acceptance), accepted into the state, and the MTP head drafts the next windows, all without the host (one
        graph replay on CUDA; `graphs/spec_step.py`). Returns the step's figures `[rows, 2 W + 2]` on the device
        (`VerifyFigures`: next window, count, non-finite flag, pair tokens) and, with `keep_logits`, the logits of
        every window position `[rows * W, V]`. The rows' committed lengths and KV stay as if nothing were
        accepted until `settle` gives the counts; a later step of the same rows may run before that (its
        positions and KV slots shifted by the unread counts on the device)."""
        graphs = self.spec_step_graphs
        n, width = len(handles), self.max_width
        if self._pending is not None:
            raise RuntimeError("accept() must be called after a step with decode rows before the next step")
        if graphs is None or graphs.bucket(n) is None or tuple(windows.shape) != (n, width):
            raise ValueError(f"verify_on_device() takes [rows, {width}] windows of a batch its buffers hold")
        records = [self._requests[h] for h in handles]
        if any(r.mtp_hidden for r in records):
            raise ValueError("verify_on_device() needs rows whose MTP pairs are all drafted")
        if n * width > self.num_free_kv_tokens():
            raise RuntimeError(f"step needs {n * width} KV slots, {self.num_free_kv_tokens()} free")
        self._flush_checkpoints()
        rows = np.asarray(handles, dtype=np.int64)
        extra, max_extra = self._cached_extra(records), self._max_extra(records)
        self.kv.extend_many(rows, np.full(n, width, dtype=np.int64))
        cached = np.asarray([r.num_tokens for r in records], dtype=np.int64)
        slots = np.asarray([r.state_slot for r in records], dtype=np.int64)
        bucket = graphs.decode.load(None, np.full(n, width, dtype=np.int64), cached, rows, slots)
        mtp_len = np.asarray([r.mtp_len for r in records], dtype=np.int64)
        assert graphs.draft.load_full_windows(rows, mtp_len, max_extra) == bucket
        graphs.load(n, windows, extra, room, kept)
        figures, hidden, logits = graphs.run(bucket, n, keep_logits)
        self._unsettled.append(UnsettledStep(records, [width] * n, graphs.figures.counts(figures), hidden))
        return figures, logits

    def settle(self, handles: list[int], num_accepted: list[int]) -> None:
        """The host's counts of the oldest step accepted on the device (`handles` as given to `verify_on_device`):
        the rows' committed lengths grow by them and the KV of their rejected tokens is released. Rows freed
        meanwhile are skipped."""
        if not self._unsettled:
            raise RuntimeError("settle() without a step accepted on the device")
        entry = self._unsettled[0]
        if [r.handle for r in entry.records] != list(handles):
            raise ValueError("settle() must list the rows of the oldest step accepted on the device in their order")
        # checked before anything changes: a refused settle leaves the step unsettled for the caller to settle again
        if len(num_accepted) != len(entry.records) or not all(
            1 <= count <= width for count, width in zip(num_accepted, entry.widths)
        ):
            raise ValueError(f"settle(): num_accepted {list(num_accepted)} outside [1, width] of {entry.widths}")
        self._unsettled.pop(0)
        # a later step still in flight keeps its worst-case window
        later = self._max_extra(entry.records)
        rows, lengths = [], []
        for i, (record, width, count) in enumerate(zip(entry.records, entry.widths, num_accepted)):
            if self._requests.get(record.handle) is not record:
                continue
            record.num_tokens += count
            record.mtp_len += count
            record.settled_step = entry
            record.mtp_last_hidden = (entry.hidden, i * width + count - 1)
            rows.append(record.handle)
            lengths.append(record.num_tokens + later[i])
        if rows:
            self.kv.truncate_many(np.asarray(rows), np.asarray(lengths))

    def _is_unsettled(self, record: RequestRecord) -> bool:
        return any(id(record) in e.index for e in self._unsettled)

    def _cached_extra(self, records: list[RequestRecord]) -> torch.Tensor | None:
        """[rows] int64 on the device: tokens each row committed in unsettled steps (None when no row has any)."""
        entries = [e for e in self._unsettled if any(id(r) in e.index for r in records)]
        if not entries:
            return None
        if len(entries) == 1 and len(entries[0].records) == len(records):
            if all(a is b for a, b in zip(entries[0].records, records)):
                # a chained step of the same rows in the same order: the counts as they are, no gather
                return entries[0].counts.long()
        total = torch.zeros(len(records), dtype=torch.long, device=self.device)
        for entry in entries:
            index = [entry.index.get(id(r), len(entry.records)) for r in records]
            padded = torch.cat([entry.counts.long(), entry.counts.new_zeros(1, dtype=torch.long)])
            total += padded[to_device(np.asarray(index, dtype=np.int64), self.device)]
        return total

    def _max_extra(self, records: list[RequestRecord]) -> np.ndarray:
        """Per row, the most tokens its unsettled steps may have committed (their widths)."""
        out = np.zeros(len(records), dtype=np.int64)
        for entry in self._unsettled:
            widths = entry.widths + [0]
            out += np.asarray([widths[entry.index.get(id(r), -1)] for r in records], dtype=np.int64)
        return out
