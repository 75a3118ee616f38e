"""Token-granular KV storage for the full-attention layers, with per-request slot tables.

One token slot holds what every full-attention layer caches for one token (K and V for GQA, the compressed
latent for MLA). A request owns a row of `req_to_slot` listing its tokens' slots in sequence order, so slots are
not contiguous and several rows can point at the same slots. Slot `capacity` is the HOLD slot: padding rows write
there and nothing reads it.

The first `shared_cpu[row]` columns of a row are shared: their slots belong to the prefix cache, which frees
them; truncating or freeing the row only clears those columns. The rest of a row is private to its request.
When the allocator runs short, `reclaim(num_slots)` (set by the prefix cache) may free slots it holds.

Allocation is a LIFO free stack on the host: a fresh cache hands out 0, 1, 2, ... in order, and released slots
are handed out again in the order they were released (the tests rely on exact ids). The host keeps a numpy mirror
of the table and of each row's length, so a step extends or truncates every row of the batch with a few array
operations and one device update, whatever the batch size.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from lightllm.cache.device_copy import to_device


class TokenAllocator:
    """Free list of token slot ids `0 .. capacity - 1`."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        # stack top is the end; reversed so the first pops are 0, 1, 2, ...
        self._stack = np.arange(capacity - 1, -1, -1, dtype=np.int64)
        self._num_free = capacity

    def num_free(self) -> int:
        return self._num_free

    def alloc(self, n: int) -> np.ndarray:
        """`n` slot ids (int64, host); raises RuntimeError when fewer are free."""
        if n > self._num_free:
            raise RuntimeError(f"KV cache full: need {n} token slots, {self._num_free} free")
        out = self._stack[self._num_free - n : self._num_free][::-1].copy()
        self._num_free -= n
        return out

    def free(self, slots: np.ndarray | torch.Tensor) -> None:
        slots = np.asarray(slots.cpu() if isinstance(slots, torch.Tensor) else slots, dtype=np.int64).reshape(-1)
        n = slots.size
        assert self._num_free + n <= self.capacity, "double free of KV slots"
        self._stack[self._num_free : self._num_free + n] = slots[::-1]
        self._num_free += n


def ragged_arange(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenation of `arange(starts[i], starts[i] + counts[i])` over i."""
    total = int(counts.sum())
    first = np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(starts, counts) + np.arange(total, dtype=np.int64) - first


class KVCache:
    """Buffers `[num_layers, capacity + 1, *shape]` per cached component, and the request slot tables."""

    def __init__(
        self,
        num_layers: int,
        token_shapes: tuple[tuple[int, ...], ...],
        capacity: int,
        max_requests: int,
        max_req_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.num_layers = num_layers
        self.capacity = capacity
        self.hold_slot = capacity
        self.max_req_len = max_req_len
        self.device = torch.device(device)
        self.buffers = [
            torch.zeros(num_layers, capacity + 1, *shape, dtype=dtype, device=self.device) for shape in token_shapes
        ]
        self.allocator = TokenAllocator(capacity)
        self.req_to_slot = torch.full((max_requests, max_req_len), capacity, dtype=torch.int64, device=self.device)
        # host mirror of the table and the length of each row
        self.table_cpu = np.full((max_requests, max_req_len), capacity, dtype=np.int64)
        self.lengths_cpu = np.zeros(max_requests, dtype=np.int64)
        # leading columns of each row whose slots are owned by the prefix cache
        self.shared_cpu = np.zeros(max_requests, dtype=np.int64)
        # called with the number of free slots an allocation needs when fewer are free
        self.reclaim: Callable[[int], None] | None = None
        self._live = np.zeros(max_requests, dtype=bool)
        self._free_rows = list(range(max_requests - 1, -1, -1))

    def bytes_per_token(self) -> int:
        return sum(b[:, 0].numel() * b.element_size() for b in self.buffers)

    def num_free_tokens(self) -> int:
        return self.allocator.num_free()

    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> int:
        if not self._free_rows:
            raise RuntimeError("no free KV request row")
        row = self._free_rows.pop()
        self._live[row] = True
        return row

    def free_row(self, row: int) -> None:
        self.truncate(row, 0)
        self._live[row] = False
        self._free_rows.append(row)

    def length(self, row: int) -> int:
        return int(self.lengths_cpu[row])

    def slots(self, row: int) -> torch.Tensor:
        """Host int64 slot ids of the row's tokens in sequence order (a copy: the table changes under later steps)."""
        return torch.from_numpy(self.table_cpu[row, : self.lengths_cpu[row]].copy())

    def extend(self, row: int, n: int) -> torch.Tensor:
        """Allocate `n` slots for the row's next tokens; returns them (host int64)."""
        return torch.from_numpy(self.extend_many(np.array([row]), np.array([n])))

    def extend_many(self, rows: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Allocate `counts[i]` slots after the current end of each row `rows[i]` (distinct rows); returns the new
        slots in row order (host int64). Nothing changes when the cache or a row would overflow."""
        rows, counts = np.asarray(rows, dtype=np.int64), np.asarray(counts, dtype=np.int64)
        assert self._live[rows].all(), "extend of a row that is not allocated"
        too_long = self.lengths_cpu[rows] + counts > self.max_req_len
        if too_long.any():
            raise RuntimeError(f"request longer than max_req_len={self.max_req_len}")
        need = int(counts.sum())
        if need > self.allocator.num_free() and self.reclaim is not None:
            self.reclaim(need)
        new = self.allocator.alloc(need)
        row_of = np.repeat(rows, counts)
        cols = ragged_arange(self.lengths_cpu[rows], counts)
        self.table_cpu[row_of, cols] = new
        self.lengths_cpu[rows] += counts
        self._sync_device(row_of, cols, new)
        return new

    def truncate(self, row: int, length: int) -> None:
        """Release the row's slots past `length` (rejected drafts, finished requests)."""
        self.truncate_many(np.array([row]), np.array([length]))

    def truncate_many(self, rows: np.ndarray, lengths: np.ndarray) -> None:
        """Release each row's slots past `lengths[i]` (a row already that short is left as it is); shared columns
        are cleared without being freed."""
        rows, lengths = np.asarray(rows, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
        old = self.lengths_cpu[rows]
        keep = np.minimum(lengths, old)
        counts = old - keep
        if not counts.any():
            return
        row_of = np.repeat(rows, counts)
        cols = ragged_arange(keep, counts)
        owned = cols >= self.shared_cpu[row_of]
        self.allocator.free(self.table_cpu[row_of[owned], cols[owned]])
        self.table_cpu[row_of, cols] = self.hold_slot
        self.lengths_cpu[rows] = keep
        self.shared_cpu[rows] = np.minimum(self.shared_cpu[rows], keep)
        self._sync_device(row_of, cols, np.full(row_of.size, self.hold_slot, dtype=np.int64))

    def share(self, row: int, slots: np.ndarray) -> None:
        """Start an empty row with `slots` owned by the prefix cache (a prefix hit)."""
        slots = np.asarray(slots, dtype=np.int64)
        assert self._live[row] and self.lengths_cpu[row] == 0, "share into a row that is not empty"
        n = slots.size
        if n > self.max_req_len:
            raise RuntimeError(f"request longer than max_req_len={self.max_req_len}")
        self.table_cpu[row, :n] = slots
        self.lengths_cpu[row] = self.shared_cpu[row] = n
        self._sync_device(np.full(n, row, dtype=np.int64), np.arange(n, dtype=np.int64), slots)

    def replace(self, row: int, start: int, slots: np.ndarray) -> None:
        """Point the row's private columns `start ..` at `slots` (the prefix cache's copies of the same tokens)
        and free the slots they held."""
        slots = np.asarray(slots, dtype=np.int64)
        n = slots.size
        assert start >= self.shared_cpu[row] and start + n <= self.lengths_cpu[row], "replace outside private columns"
        if n == 0:
            return
        cols = np.arange(start, start + n, dtype=np.int64)
        self.allocator.free(self.table_cpu[row, cols])
        self.table_cpu[row, cols] = slots
        self._sync_device(np.full(n, row, dtype=np.int64), cols, slots)

    def set_shared(self, row: int, n: int) -> None:
        """Hand the row's first `n` columns to the prefix cache (it now owns and frees their slots)."""
        assert self.shared_cpu[row] <= n <= self.lengths_cpu[row], "shared prefix must grow within the row"
        self.shared_cpu[row] = n

    def _sync_device(self, row_of: np.ndarray, cols: np.ndarray, values: np.ndarray) -> None:
        if row_of.size == 0:
            return
        # one host-to-device copy of (row, column, value) triples, one scatter
        packed = to_device(np.stack([row_of, cols, values]), self.device)
        self.req_to_slot[packed[0], packed[1]] = packed[2]

    def write(self, layer: int, slots: torch.Tensor, *values: torch.Tensor) -> None:
        """Store one layer's per-token components (same order as `token_shapes`) at `slots`."""
        for buf, val in zip(self.buffers, values):
            buf[layer].index_copy_(0, slots, val.to(buf.dtype))

    def gather(self, layer: int, slot_table: torch.Tensor) -> list[torch.Tensor]:
        """Each component at `slot_table [...]` -> `[..., *shape]`."""
        return [buf[layer][slot_table] for buf in self.buffers]
