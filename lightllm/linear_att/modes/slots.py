"""Slot allocation for per-request state: slots 0..max_requests-1 plus one HOLD slot for graph padding."""

from __future__ import annotations

import heapq


class SlotAllocator:
    """Hands out the lowest free slot id; the HOLD slot (`max_requests`) is never handed out."""

    def __init__(self, max_requests: int):
        self.num_slots = max_requests + 1
        self.hold_slot = max_requests
        self._free = list(range(max_requests))
        self._used: set[int] = set()

    def alloc(self) -> int:
        if not self._free:
            raise RuntimeError(f"no free linear-attention state slot (all {self.hold_slot} in use)")
        slot = heapq.heappop(self._free)
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"slot {slot} is not allocated")
        self._used.remove(slot)
        heapq.heappush(self._free, slot)

    def num_free(self) -> int:
        return len(self._free)
