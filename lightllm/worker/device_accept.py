"""Verify steps accepted on the device and settled a step later: the runner's side of overlapped MTP steps.

`accept_on_device` commits a verify step's accepted counts while they are still on the device (the state's accept,
the MTP head's commit and its drafts for the next windows), so the next step can be launched before the host reads
them; the rows' committed lengths and KV stay as if nothing were accepted until `settle` gives the counts. Until
then a step of the same rows shifts its positions, cached lengths and KV write slots by the unread counts on the
device (`_cached_extra`), its KV allocated for the worst case (`_max_extra`). At most two steps are unsettled: the
one being read and the one launched after it.

A request that reaches its length limit in a step still in flight rides along in the next one, which moves its
state past the tokens it emits; to publish its prefix-cache checkpoint at its end anyway, the step launched after
it first takes a checkpoint of the rows that may reach their limit there (`hold_checkpoints`), which `publish`
uses once that step is settled.

`ModelRunner` inherits these methods; they use its requests, state, KV caches, MTP drafter and decode buffers.
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
    """A verify accepted on the device (`accept_on_device`) whose counts the host has not read yet."""

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

    def held_checkpoint(self, handle: int) -> HeldCheckpoint | None:
        """The checkpoint held for `handle` if the step it was taken after is settled and no later step of the row
        is: the row's state at its committed length."""
        held = self._held.get(handle)
        record = self._requests[handle]
        if held is None or any(step is held.step for step in self._unsettled) or record.settled_step is not held.step:
            return None
        return held

    def can_accept_on_device(self, handles: list[int]) -> bool:
        """Whether a decode-only step of these rows may be accepted on the device (`accept_on_device`): the decode
        and MTP draft buffers hold the batch, the rows' MTP pairs are all drafted, the head's KV has room for the
        worst case, and at most one accepted step is unsettled."""
        decode, drafter = self.decode_graphs, self.drafter
        if drafter is None or decode is None or drafter.graphs is None or len(self._unsettled) > 1:
            return False
        n = len(handles)
        if decode.bucket(n) is None or drafter.graphs.bucket(n) is None or drafter.graphs.mtp_step != self.mtp_step:
            return False
        if any(self._requests[h].mtp_hidden for h in handles):
            return False
        return drafter.kv.num_free_tokens() >= n * (2 * self.max_width + self.mtp_step)

    @torch.inference_mode()
    def accept_on_device(
        self, handles: list[int], num_accepted: torch.Tensor, pair_tokens: torch.Tensor
    ) -> torch.Tensor:
        """`accept` with the counts on the device `[rows]` (each in 1 .. W), for a decode-only step whose rows all
        verified a full window of W tokens (`can_accept_on_device` said so before its forward), then the MTP
        head's drafts for the next windows `[rows, mtp_step]` on the device: row i commits its first
        `num_accepted[i]` (hidden, token) pairs, `pair_tokens [rows, W]` holding the token after each window
        position (the accepted drafts, then the next token). Nothing is read back: the rows' committed lengths and
        KV stay as if nothing were accepted until `settle` gives the counts, and the next step may take these rows
        (its positions and KV slots are shifted on the device)."""
        pending = self._pending
        if pending is None or list(handles) != pending.handles:
            raise ValueError("accept_on_device() must list the last step's decode rows in their order")
        records = [self._requests[h] for h in handles]
        width = pending.widths[0]
        hidden = records[0].mtp_hidden[-1][0] if records and records[0].mtp_hidden else None
        spans_ok = hidden is not None and all(
            len(r.mtp_hidden) == 1 and r.mtp_hidden[0][0] is hidden and r.mtp_hidden[0][1:] == (i * width, width)
            for i, r in enumerate(records)
        )
        if self.drafter is None or set(pending.widths) != {width} or not spans_ok:
            raise ValueError("accept_on_device() takes a decode-only step of full windows with an MTP head")
        extra, max_extra = self._cached_extra(records), self._max_extra(records)
        self.state.accept(pending.rows, num_accepted.to(torch.int32))
        self._pending = None
        for r in records:
            r.mtp_hidden, r.mtp_next_ids = [], []
        drafts = self.drafter.draft_on_device(
            handles, records, hidden, pair_tokens.reshape(-1), num_accepted, extra, max_extra, self.mtp_step
        )
        self._unsettled.append(UnsettledStep(records, list(pending.widths), num_accepted, hidden))
        return drafts

    def settle(self, handles: list[int], num_accepted: list[int]) -> None:
        """The host's counts of the oldest step accepted on the device (`handles` as given to `accept_on_device`):
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
