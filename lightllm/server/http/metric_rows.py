"""The HTTP front-end's counters as one row per front-end process (`--http_workers`): each process adds to its own
row only, and a scrape in any process sums the rows, so /metrics reports the whole server whichever process answers.

One process keeps its row in private memory; several map one float64 file (in /dev/shm where there is one) that
the first process creates and removes at shutdown. A row has one writer, and readers sum values that only grow
(or, for a gauge, are replaced whole), so no lock is needed: a scrape may see a row a few updates old, never a torn
value (aligned 8-byte stores).
"""

from __future__ import annotations

import os
import tempfile

import numpy as np


class MetricRows:
    def __init__(self, width: int, rows: int = 1, row: int = 0, path: str | None = None):
        """Private rows when `path` is None, else the rows mapped from the file at `path` (`create_file`)."""
        self.width, self.rows, self.row, self.path = width, rows, row, path
        if path is None:
            self._all = np.zeros((rows, width), dtype=np.float64)
        else:
            self._all = np.memmap(path, dtype=np.float64, mode="r+", shape=(rows, width))
        self.own = self._all[row]

    @staticmethod
    def create_file(width: int, rows: int) -> str:
        """A zeroed file for `rows` processes' rows; the caller removes it when the server stops."""
        fd, path = tempfile.mkstemp(prefix="lightllm-metrics-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        with os.fdopen(fd, "wb") as f:
            f.write(bytes(rows * width * 8))
        return path

    def total(self, start: int, stop: int | None = None) -> np.ndarray:
        """Columns `start:stop` (one column without `stop`) summed over the processes."""
        return self._all[:, start : (start + 1 if stop is None else stop)].sum(axis=0)

    def value(self, row: int, column: int) -> float:
        return float(self._all[row, column])

    def others(self, column: int) -> float:
        """Column `column` summed over the other processes' rows."""
        return float(self._all[:, column].sum() - self.own[column])
