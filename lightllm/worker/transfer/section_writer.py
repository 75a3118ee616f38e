"""Host-tier sections written from device tensors without making the step loop wait for the GPU or the arena.

Copying a spilled prefix (its KV and a linear-state checkpoint: ~16 MiB at the serving width) straight into the
shared-memory arena from the step loop would make the host wait for every step queued before it, then for the copy
at pageable speed, once per eviction; claiming the entry (a hash of its tokens and a search of the arena's table
under its lock) costs the loop a fraction of a millisecond more, hundreds of times a second under eviction
pressure. In the background mode the step loop only takes a device copy of the tensors on the current stream
(ordered after the work that produced them and before anything queued later that overwrites them: a reused
checkpoint slot, freed KV; microseconds at device bandwidth), records an event after it and queues the write; it
returns at once. A worker thread then claims the entry (`begin`: nothing more is done when the arena
holds it already or has no room), copies the snapshot into pinned staging on a stream of its own (after the event:
beside the steps, not between them), moves the bytes into the arena and commits; until then the entry is WRITING,
which readers never see. Staging and the device snapshots of pending writes are bounded: a write that finds either
full waits for the oldest, so callers on the step loop ask `has_room` first and drop the entry instead (the tier is
a cache: losing an entry costs a recompute later, waiting costs every running request now).
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lightllm.cache.host_tier import HostTier, Ticket

logger = logging.getLogger(__name__)

# pinned bytes all pending writes of one rank may hold (a write larger than this still goes, alone)
STAGING_BYTES = 512 << 20
# device bytes the snapshots of pending writes may hold: they come out of the memory kept for activations
SNAPSHOT_BYTES = 128 << 20
# smallest staging buffer allocated (pinning costs more than copying, so buffers are kept and reused)
MIN_BUFFER_BYTES = 1 << 20
# worker threads. Each write holds the GIL for about a millisecond of Python (claiming the entry, issuing the copies,
# committing), and every millisecond of it is taken from the step loop, which hands the GIL over at each kernel
# launch: on a GPU every written entry cost the loop ~2 ms, so more threads write more entries in a burst of
# evictions (the rest are dropped, see `has_room`) at the price of the running requests' pace
NUM_WORKERS = 1

# claims an entry's section for this shard: its ticket, or None when it is not to be written
Begin = Callable[[], Ticket | None]


@dataclass
class _Pending:
    """A queued write: the snapshot of its tensors and what the worker needs to land it."""

    begin: Begin
    head: bytes
    data_start: int
    snapshots: list[torch.Tensor]
    offsets: list[int]
    extent: int
    # the snapshot's event on the compute stream (None: CPU tensors)
    ready: torch.cuda.Event | None
    staging_size: int
    snapshot_bytes: int


class SectionWriter:
    """Writes `tensors` into the section of an entry it claims with `begin` and commits it: at once
    (`background=False`), or through pinned staging and a worker thread (`background=True`; `flush` waits for every
    pending write)."""

    def __init__(self, tier: HostTier, background: bool, staging_bytes: int = STAGING_BYTES):
        self.tier, self.background, self.staging_bytes = tier, background, staging_bytes
        self._free: list[torch.Tensor] = []
        # staging bytes reserved by pending writes, and device bytes of their snapshots
        self._held = 0
        self._snapshots = 0
        self._stream: torch.cuda.Stream | None = None
        self._pending = 0
        self._done = threading.Condition()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        # writes whose claimed entry could not be committed (reclaimed meanwhile) or whose copy failed
        self.num_failed = 0

    def has_room(self, num_bytes: int, snapshot_bytes: int) -> bool:
        """Whether a write of `num_bytes` with device snapshots of `snapshot_bytes` would start without waiting
        for the pending ones (always in the foreground mode, and when nothing is pending: a large write goes
        alone)."""
        if not self.background:
            return True
        with self._done:
            return self._fits(_staging_size(num_bytes), snapshot_bytes)

    def _fits(self, size: int, snapshot_bytes: int) -> bool:
        return self._pending == 0 or (
            self._held + size <= self.staging_bytes and self._snapshots + snapshot_bytes <= SNAPSHOT_BYTES
        )

    def write(self, begin: Begin, head: bytes, data_start: int, tensors: Sequence[torch.Tensor], offsets) -> bool:
        """Claim the entry (`begin()`), then `head` at the start of its section, each tensor at `data_start` plus
        its offset, and commit. Foreground: returns whether the entry was committed. Background: the tensors are
        snapshot now (the caller may overwrite them at once) and True is returned; the claim and the copies run
        on a worker."""
        offsets = list(offsets)
        extent = max((o + _nbytes(t) for t, o in zip(tensors, offsets)), default=0)
        if not self.background:
            ticket = begin()
            if ticket is None:
                return False
            section = self.tier.section(ticket)
            section[: len(head)] = np.frombuffer(head, dtype=np.uint8)
            _copy_into(_arena_view(section[data_start : data_start + extent]), tensors, offsets, non_blocking=False)
            return self.tier.commit(ticket)
        snapshot_bytes = sum(_nbytes(t) for t in tensors if t.is_cuda)
        size = _staging_size(extent)
        self._reserve(size, snapshot_bytes)
        snapshots = [t.clone() for t in tensors]
        ready = None
        on_device = [t for t in snapshots if t.is_cuda]
        if on_device:
            ready = torch.cuda.Event()
            ready.record()
            if self._stream is None:
                self._stream = torch.cuda.Stream(on_device[0].device)
        self._start()
        self._queue.put(_Pending(begin, head, data_start, snapshots, offsets, extent, ready, size, snapshot_bytes))
        return True

    def flush(self) -> None:
        """Wait until every pending write is in the arena and committed (or given up)."""
        with self._done:
            self._done.wait_for(lambda: self._pending == 0)

    def close(self) -> None:
        """Finish the pending writes, stop the workers and drop the staging buffers (idempotent)."""
        self.flush()
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()
        self._threads = []
        self._free.clear()

    # room ------------------------------------------------------------------------------------------------
    def _reserve(self, size: int, snapshot_bytes: int) -> None:
        """Count a new pending write of `size` staging bytes and `snapshot_bytes` device bytes, once the pending
        ones leave room for it."""
        with self._done:
            self._done.wait_for(lambda: self._fits(size, snapshot_bytes))
            self._held += size
            self._snapshots += snapshot_bytes
            self._pending += 1

    def _buffer(self, size: int) -> torch.Tensor:
        """A staging buffer of `size` bytes (reserved already): a kept one when one fits, else a new one (the
        idle ones that would keep the total over the bound are dropped first)."""
        with self._done:
            fits = [b for b in self._free if b.numel() >= size]
            if fits:
                buffer = min(fits, key=torch.Tensor.numel)
                self._free.remove(buffer)
                return buffer
            while self._free and self._held + sum(b.numel() for b in self._free) > self.staging_bytes:
                self._free.remove(min(self._free, key=torch.Tensor.numel))
        return torch.empty(size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())

    # the workers -----------------------------------------------------------------------------------------
    def _start(self) -> None:
        if not self._threads:
            # the workers must not be inside a CUDA call when the interpreter tears CUDA down
            atexit.register(_close_at_exit, weakref.ref(self))
        while len(self._threads) < NUM_WORKERS:
            thread = threading.Thread(target=self._work, name=f"host-tier-writer-{len(self._threads)}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            staging, failed = None, False
            try:
                ticket = item.begin()
                if ticket is not None:
                    staging = self._buffer(item.staging_size)
                    self._to_staging(item, staging[: item.extent])
                    # the device memory goes back to the allocator: its copy has landed
                    item.snapshots = []
                    section = self.tier.section(ticket)
                    section[: len(item.head)] = np.frombuffer(item.head, dtype=np.uint8)
                    start = item.data_start
                    _arena_view(section[start : start + item.extent]).copy_(staging[: item.extent])
                    failed = not self.tier.commit(ticket)
            except Exception:
                # a lost entry is a cache miss later; the writer must keep serving the others
                logger.exception("host tier write failed")
                failed = True
            item.snapshots = []
            with self._done:
                self.num_failed += failed
                if staging is not None:
                    self._free.append(staging)
                self._held -= item.staging_size
                self._snapshots -= item.snapshot_bytes
                self._pending -= 1
                self._done.notify_all()

    def _to_staging(self, item: _Pending, region: torch.Tensor) -> None:
        """The snapshot into pinned `region`: on the writer's stream after the snapshot's event (the steps queued
        since run beside it), waited for here."""
        if item.ready is None:
            _copy_into(region, item.snapshots, item.offsets, non_blocking=False)
            return
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(item.ready)
            _copy_into(region, item.snapshots, item.offsets, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()


def _close_at_exit(ref: weakref.ref) -> None:
    writer = ref()
    if writer is not None:
        writer.close()


def _arena_view(region: np.ndarray) -> torch.Tensor:
    """A tensor over shared memory (its copies run without the GIL)."""
    return torch.from_numpy(region)


def _staging_size(num_bytes: int) -> int:
    """The staging buffer a write of `num_bytes` takes: a power of two (so buffers are reused), at least
    `MIN_BUFFER_BYTES`."""
    return max(MIN_BUFFER_BYTES, 1 << max(num_bytes - 1, 1).bit_length())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _copy_into(region: torch.Tensor, tensors: Sequence[torch.Tensor], offsets, non_blocking: bool) -> None:
    for t, offset in zip(tensors, offsets):
        n = _nbytes(t)
        if n:
            region[offset : offset + n].view(t.dtype).view(t.shape).copy_(t, non_blocking=non_blocking)
