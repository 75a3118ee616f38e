"""A device counter read for the metrics endpoint without stalling the step in flight."""

from __future__ import annotations

import torch


class CounterCopy:
    """The last value of a device counter, copied to pinned host memory without a sync.

    `read(counter)` returns the value copied at the previous call on CUDA (the copy it starts is awaited by nobody:
    a metric may lag one scrape, a step is never stalled for it) and the current value on the CPU.
    """

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None
        self._ready: torch.cuda.Event | None = None
        self._value = 0

    def read(self, counter: torch.Tensor) -> int:
        if counter.device.type != "cuda":
            return int(counter)
        if self._host is None:
            self._host = torch.empty((), dtype=counter.dtype, pin_memory=True)
        if self._ready is not None and self._ready.query():
            self._value = int(self._host)
            self._ready = None
        if self._ready is None:
            self._host.copy_(counter, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        return self._value
