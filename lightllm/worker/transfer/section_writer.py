"""Host-tier sections written from device tensors without making the step loop wait for the GPU.

Copying a spilled prefix (its KV and a linear-state checkpoint: ~16 MiB at the serving width) straight into the
shared-memory arena is a copy into pageable memory: the host waits for every step queued before it, then for
the copy at pageable speed, once per eviction. In the background mode a write instead takes a device copy of its
tensors on the current stream (ordered after the work that produced them and before anything queued later that
overwrites them: a reused checkpoint slot, freed KV; microseconds at device bandwidth) and copies that snapshot
into a pinned staging buffer on the writer's own stream, so the slow copy to the host runs beside the steps
instead of between them; it returns at once. One of a few worker threads waits for that copy, moves the bytes
into the arena and commits the entry; until then the entry is WRITING, which readers never see. Staging and the
device snapshots in flight are bounded: a write that finds either full waits for the oldest, so callers on the
step loop ask `has_room` first and drop the entry instead (the tier is a cache: losing an entry costs a recompute
later, waiting costs every running request now).
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref
from collections.abc import Sequence

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
# worker threads: a copy into fresh shared memory is bound by page faults (~a few GB/s per thread), and a burst of
# evictions (a wave of new prompts filling the device cache) spills faster than one thread copies
NUM_WORKERS = 4


class SectionWriter:
    """Writes `tensors` into a ticket's section and commits it: at once (`background=False`), or through pinned
    staging and a worker thread (`background=True`; `flush` waits for every pending write)."""

    def __init__(self, tier: HostTier, background: bool, staging_bytes: int = STAGING_BYTES):
        self.tier, self.background, self.staging_bytes = tier, background, staging_bytes
        self._free: list[torch.Tensor] = []
        self._held = 0
        # device bytes of the pending writes' snapshots, and the stream their copies to the host run on
        self._snapshots = 0
        self._stream: torch.cuda.Stream | None = None
        self._pending = 0
        self._done = threading.Condition()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self.num_failed = 0

    def has_room(self, num_bytes: int, snapshot_bytes: int) -> bool:
        """Whether a write of `num_bytes` with device snapshots of `snapshot_bytes` would start without waiting
        for the pending ones (always in the foreground mode, and when nothing is pending: a large write goes
        alone)."""
        if not self.background:
            return True
        size = _staging_size(num_bytes)
        with self._done:
            return self._fits(size, snapshot_bytes)

    def _fits(self, size: int, snapshot_bytes: int) -> bool:
        return self._pending == 0 or (
            self._held + size <= self.staging_bytes and self._snapshots + snapshot_bytes <= SNAPSHOT_BYTES
        )

    def write(self, ticket: Ticket, head: bytes, data: np.ndarray, tensors: Sequence[torch.Tensor], offsets) -> bool:
        """`head` at the start of the section, each tensor at its offset in `data` (the section past its head),
        then commit. Returns False when the entry could not be committed (only known now in the foreground)."""
        section = self.tier.section(ticket)
        section[: len(head)] = np.frombuffer(head, dtype=np.uint8)
        extent = max((o + _nbytes(t) for t, o in zip(tensors, offsets)), default=0)
        if not self.background:
            _copy_into(_arena_view(data[:extent]), tensors, offsets, non_blocking=False)
            return self.tier.commit(ticket)
        on_device = [t for t in tensors if t.is_cuda]
        snapshot_bytes = sum(_nbytes(t) for t in on_device)
        staging = self._take(extent, snapshot_bytes)
        ready = None
        if on_device:
            ready = self._copy_beside_steps(staging[:extent], tensors, offsets)
        else:
            _copy_into(staging[:extent], tensors, offsets, non_blocking=True)
        self._start()
        self._queue.put((ticket, ready, staging, data, extent, snapshot_bytes))
        return True

    def _copy_beside_steps(self, region: torch.Tensor, tensors: Sequence[torch.Tensor], offsets) -> torch.cuda.Event:
        """Snapshots of `tensors` on the current stream, copied into `region` on the writer's stream; the event of
        that copy. The snapshots' memory goes back to the allocator once the copy has run."""
        device = next(t.device for t in tensors if t.is_cuda)
        current = torch.cuda.current_stream(device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        snapshots = [t.clone() if t.is_cuda else t for t in tensors]
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            _copy_into(region, snapshots, offsets, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._stream)
        for t in snapshots:
            if t.is_cuda:
                t.record_stream(self._stream)
        return ready

    def flush(self) -> None:
        """Wait until every pending write is in the arena and committed."""
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

    # staging ---------------------------------------------------------------------------------------------
    def _take(self, num_bytes: int, snapshot_bytes: int) -> torch.Tensor:
        """A staging buffer of at least `num_bytes`, once the pending writes hold room for it and for a device
        snapshot of `snapshot_bytes`."""
        size = _staging_size(num_bytes)
        with self._done:
            self._done.wait_for(lambda: self._fits(size, snapshot_bytes))
            fits = [b for b in self._free if b.numel() >= num_bytes]
            if fits:
                buffer = min(fits, key=torch.Tensor.numel)
                self._free.remove(buffer)
            else:
                # drop idle buffers that would keep the new one over the bound
                while self._free and self._held + sum(b.numel() for b in self._free) + size > self.staging_bytes:
                    self._free.remove(min(self._free, key=torch.Tensor.numel))
                buffer = torch.empty(size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            self._held += buffer.numel()
            self._snapshots += snapshot_bytes
            self._pending += 1
        return buffer

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
            ticket, ready, staging, data, extent, snapshot_bytes = item
            committed = False
            try:
                if ready is not None:
                    ready.synchronize()
                _arena_view(data[:extent]).copy_(staging[:extent])
                committed = self.tier.commit(ticket)
            except Exception:
                # a lost entry is a cache miss later; the writer must keep serving the others
                logger.exception("host tier write of %d tokens failed", ticket.num_tokens)
            with self._done:
                self.num_failed += not committed
                self._free.append(staging)
                self._held -= staging.numel()
                self._snapshots -= snapshot_bytes
                self._pending -= 1
                self._done.notify_all()


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
