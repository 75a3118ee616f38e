"""Where a rank's start-up time goes: each phase (weights, memory, each warm-up, graph capture) timed and logged in one
line when the rank is ready, so a slow start names its phase in the server log."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class StartupPhases:
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.start = self.last = clock()
        self.phases: list[tuple[str, float]] = []

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = self.clock()
        try:
            yield
        finally:
            self.last = self.clock()
            self.phases.append((name, self.last - t0))

    def mark(self, name: str) -> None:
        """Record the time since the last phase ended (or since construction) as `name`."""
        now = self.clock()
        self.phases.append((name, now - self.last))
        self.last = now

    def summary(self) -> str:
        """`name s, name s, ... (total s)`, the total counting from construction (time between phases included)."""
        parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phases)
        return f"{parts} (total {self.clock() - self.start:.1f} s)"
