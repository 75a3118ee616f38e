"""What a decode node holds open per prefill node (an opened CUDA IPC buffer, a connected NIXL agent), closed again
once that peer has sent nothing for a while.

A decode node learns of prefill nodes only through their transfers and never hears that one went away. An opened
CUDA IPC buffer keeps the prefill node's staging buffer allocated on the GPU even after that process exits, so a
prefill node that restarts would leave its old buffer (`--pd_ipc_buffer_mb`, 1 GiB by default) pinned on the GPU
for the decode node's lifetime. Closing what has been idle for `PEER_IDLE_S` bounds that; a peer that is merely
quiet is opened again by its next transfer, which costs a handle open (milliseconds).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

# seconds without a transfer after which a peer's opened resource is closed (checked at every use)
PEER_IDLE_S = 60.0

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class IdlePeers(Generic[K, V]):
    """Resources opened per peer key: `get` opens on first use (`open(arg)`) and reuses afterwards; every `get`
    first closes (`close(value)`) the entries of other peers unused for `idle_s` seconds; `drop` closes one now
    (a read from it failed: the next transfer reopens it)."""

    def __init__(
        self,
        open: Callable[[object], V],
        close: Callable[[V], None],
        idle_s: float = PEER_IDLE_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._open, self._close, self.idle_s, self._clock = open, close, idle_s, clock
        # key -> (value, last use)
        self._items: dict[K, tuple[V, float]] = {}

    def get(self, key: K, arg: object) -> V:
        now = self._clock()
        for other in [k for k, (_, last) in self._items.items() if k != key and now - last > self.idle_s]:
            self.drop(other)
        entry = self._items.get(key)
        value = self._open(arg) if entry is None else entry[0]
        self._items[key] = (value, now)
        return value

    def drop(self, key: K) -> None:
        entry = self._items.pop(key, None)
        if entry is not None:
            self._close(entry[0])

    def __contains__(self, key: K) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)
