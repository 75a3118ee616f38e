"""Drafts left on the device: the MTP head's chained drafts are fed to the next verify window without the host
reading them first, so a speculative step waits for the device once (the verify's read-back, which brings the
accepted drafts with it) instead of twice (drafts, then verify).

A request's `draft_ids` may be a `DeviceDrafts`: a sequence whose length is known on the host (the scheduler sizes
windows by it) and whose values are read only when something on the host needs them. Those that know how (the
batch builder, the runner, the verifiers) take the values from the device instead (`draft_matrix`); anything else
that reads them (a grammar's walk over the drafts, a sampled row's verification, a PD hand-off) gets them through
one read-back of the whole draft batch, so a consumer that does not know about device drafts is only slower.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from lightllm.cache.device_copy import list_to_device


class DraftBatch:
    """The drafts `[rows, num_drafts]` int64 of one drafting call, on the device, and their host copy once read."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self._host: list[list[int]] | None = None

    def host(self) -> list[list[int]]:
        if self._host is None:
            # the one read-back of this drafting call: every request drafted by it is known afterwards
            self._host = self.tensor.tolist()
        return self._host

    def row(self, index: int, length: int) -> DeviceDrafts:
        return DeviceDrafts(self, index, length)


class DeviceDrafts(Sequence[int]):
    """The first `length` drafts of row `index` of a `DraftBatch`. Slices from the start stay on the device."""

    def __init__(self, batch: DraftBatch, index: int, length: int):
        if not 0 <= length <= batch.tensor.shape[1]:
            raise ValueError(f"{length} drafts of a row holding {batch.tensor.shape[1]}")
        self.batch, self.index, self.length = batch, index, length

    @property
    def is_read(self) -> bool:
        return self.batch._host is not None

    def values(self) -> list[int]:
        return self.batch.host()[self.index][: self.length]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key):
        if isinstance(key, slice) and key.step in (None, 1) and key.start in (None, 0):
            stop = self.length if key.stop is None else key.stop
            stop = max(0, min(self.length, stop if stop >= 0 else self.length + stop))
            return DeviceDrafts(self.batch, self.index, stop)
        return self.values()[key]

    def __iter__(self) -> Iterator[int]:
        return iter(self.values())

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        shown = self.values() if self.is_read else f"<{self.length} on {self.batch.tensor.device}>"
        return f"DeviceDrafts({shown})"


def has_device_drafts(drafts: list[Sequence[int]]) -> bool:
    """Whether any of `drafts` is still unread on the device."""
    return any(isinstance(d, DeviceDrafts) and d.length and not d.is_read for d in drafts)


def draft_matrix(drafts: list[Sequence[int]], device: torch.device, width: int | None = None) -> torch.Tensor:
    """`[len(drafts), width]` int64 on `device` (width: the longest row by default): row i holds `drafts[i]`, then
    -1. Device drafts are gathered on the device (no read-back); host lists are copied up."""
    width = max((len(d) for d in drafts), default=0) if width is None else width
    whole = _whole_rows(drafts, width)
    if whole is not None:
        # the steady state: every row a full unread row of one drafting call, so no padding to apply
        batch, rows = whole
        if rows == list(range(batch.tensor.shape[0])):
            return batch.tensor.to(device)
        return batch.tensor[list_to_device(rows, torch.long, batch.tensor.device)].to(device)
    matrix = torch.full((len(drafts), width), -1, dtype=torch.long, device=device)
    if width == 0:
        return matrix
    host_rows = [i for i, d in enumerate(drafts) if not (isinstance(d, DeviceDrafts) and not d.is_read)]
    if host_rows:
        padded = [list(drafts[i]) + [-1] * (width - len(drafts[i])) for i in host_rows]
        matrix[list_to_device(host_rows, torch.long, device)] = list_to_device(padded, torch.long, device)
    by_batch: dict[int, tuple[DraftBatch, list[int], list[int]]] = {}
    for i, d in enumerate(drafts):
        if isinstance(d, DeviceDrafts) and not d.is_read:
            by_batch.setdefault(id(d.batch), (d.batch, [], []))
            by_batch[id(d.batch)][1].append(i)
            by_batch[id(d.batch)][2].append(d.index)
    columns = torch.arange(width, device=device)
    for batch, rows, sources in by_batch.values():
        lengths = list_to_device([len(drafts[i]) for i in rows], torch.long, device)
        source = batch.tensor[list_to_device(sources, torch.long, batch.tensor.device)]
        source = source[:, :width].to(device)
        if source.shape[1] < width:
            source = torch.cat([source, source.new_full((source.shape[0], width - source.shape[1]), -1)], dim=1)
        kept = torch.where(columns[None, :] < lengths[:, None], source, torch.full_like(source, -1))
        matrix[list_to_device(rows, torch.long, device)] = kept
    return matrix


def _whole_rows(drafts: list[Sequence[int]], width: int) -> tuple[DraftBatch, list[int]] | None:
    """(batch, row indices) when every one of `drafts` is a whole unread row of the same drafting call, `width`
    wide; else None."""
    first = drafts[0] if drafts else None
    if not isinstance(first, DeviceDrafts) or first.batch.tensor.shape[1] != width:
        return None
    rows = []
    for d in drafts:
        if not isinstance(d, DeviceDrafts) or d.batch is not first.batch or d.length != width or d.is_read:
            return None
        rows.append(d.index)
    return first.batch, rows


def decode_draft_ids(drafts: list[Sequence[int]]) -> torch.Tensor | None:
    """The `ForwardBatch.decode_draft_ids` of decode rows with these drafts: their `draft_matrix` on the drafts'
    device when some are still unread there, else None (the host's `input_ids` hold them all)."""
    unread = [d for d in drafts if d and isinstance(d, DeviceDrafts) and not d.is_read]
    if not unread:
        return None
    return draft_matrix(drafts, unread[0].batch.tensor.device)


def host_drafts(drafts: Sequence[int]) -> list[int]:
    """`drafts` for the host's copy of a window's tokens: their values, or zeros standing for drafts still unread
    on the device (`decode_draft_ids` carries those)."""
    if isinstance(drafts, DeviceDrafts) and not drafts.is_read:
        return [0] * len(drafts)
    return list(drafts)


def write_window_drafts(windows: torch.Tensor, draft_ids: torch.Tensor) -> None:
    """In place on `windows` [n, W] (decode rows' token ids): row i's positions 1 .. D take `draft_ids[i]` [D]
    where it is not -1 (a row with fewer drafts keeps what the host wrote)."""
    num = draft_ids.shape[1]
    assert num < windows.shape[1], f"{num} drafts in windows of {windows.shape[1]} tokens"
    target = windows[:, 1 : 1 + num]
    target.copy_(torch.where(draft_ids >= 0, draft_ids, target))
