"""Token-granular KV storage for the full-attention layers, with per-request slot tables.

One token slot holds what every full-attention layer caches for one token (K and V for GQA, the compressed
latent for MLA). A request owns a row of `req_to_slot` listing its tokens' slots in sequence order, so slots are
not contiguous and a future prefix cache can point several rows at the same slots. Slot `capacity` is the HOLD
slot: padding rows write there and nothing reads it.

Allocation is a LIFO free stack on the host: a fresh cache hands out 0, 1, 2, ... in order, and released slots
are handed out again in the order they were released (the tests rely on exact ids).
"""

from __future__ import annotations

import torch


class TokenAllocator:
    """Free list of token slot ids `0 .. capacity - 1`."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        # stack top is the end; reversed so the first pops are 0, 1, 2, ...
        self._stack = torch.arange(capacity - 1, -1, -1, dtype=torch.int64)
        self._num_free = capacity

    def num_free(self) -> int:
        return self._num_free

    def alloc(self, n: int) -> torch.Tensor:
        """`n` slot ids (int64, host); raises RuntimeError when fewer are free."""
        if n > self._num_free:
            raise RuntimeError(f"KV cache full: need {n} token slots, {self._num_free} free")
        out = self._stack[self._num_free - n : self._num_free].flip(0).clone()
        self._num_free -= n
        return out

    def free(self, slots: torch.Tensor) -> None:
        n = slots.numel()
        assert self._num_free + n <= self.capacity, "double free of KV slots"
        self._stack[self._num_free : self._num_free + n] = slots.reshape(-1).cpu().flip(0)
        self._num_free += n


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
        # host mirror of the table: the slots of each live row, in sequence order
        self._rows: dict[int, torch.Tensor] = {}
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
        self._rows[row] = torch.empty(0, dtype=torch.int64)
        return row

    def free_row(self, row: int) -> None:
        self.truncate(row, 0)
        del self._rows[row]
        self._free_rows.append(row)

    def length(self, row: int) -> int:
        return self._rows[row].numel()

    def slots(self, row: int) -> torch.Tensor:
        """Host int64 slot ids of the row's tokens in sequence order."""
        return self._rows[row]

    def extend(self, row: int, n: int) -> torch.Tensor:
        """Allocate `n` slots for the row's next tokens; returns them (host int64)."""
        old = self._rows[row]
        if old.numel() + n > self.max_req_len:
            raise RuntimeError(f"request longer than max_req_len={self.max_req_len}")
        new = self.allocator.alloc(n)
        self._rows[row] = torch.cat([old, new])
        self.req_to_slot[row, old.numel() : old.numel() + n] = new.to(self.device)
        return new

    def truncate(self, row: int, length: int) -> None:
        """Release the row's slots past `length` (rejected drafts, finished requests)."""
        old = self._rows[row]
        if length >= old.numel():
            return
        self.allocator.free(old[length:])
        self.req_to_slot[row, length : old.numel()] = self.hold_slot
        self._rows[row] = old[:length]

    def write(self, layer: int, slots: torch.Tensor, *values: torch.Tensor) -> None:
        """Store one layer's per-token components (same order as `token_shapes`) at `slots`."""
        for buf, val in zip(self.buffers, values):
            buf[layer].index_copy_(0, slots, val.to(buf.dtype))

    def gather(self, layer: int, slot_table: torch.Tensor) -> list[torch.Tensor]:
        """Each component at `slot_table [...]` -> `[..., *shape]`."""
        return [buf[layer][slot_table] for buf in self.buffers]
