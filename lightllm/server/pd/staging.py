"""The device path of a transfer: the prefill node's staging buffer, its regions, and the decode node's reader.

A prefill node allocates one buffer at start (`--pd_ipc_buffer_mb`, on its device) and shares it once, by CUDA IPC
handle (`cuda_ipc.py`, processes of one host) or by NIXL registration (`nixl.py`, any hosts NIXL reaches). Per
transfer it copies the request's tensors (KV rows, linear state, MTP head state) device to device into a free
region of that buffer, waits for the copies, and sends the usual `PdTransfer` over zmq with blobs that hold only
dtype, shape and offset, plus the region (buffer handle, offset, size). The decode node reads the region into
memory of its own (a device-to-device copy through the opened IPC buffer, or a NIXL read), waits for it and
confirms; the prefill node then frees the region. The bytes never pass through Python objects.

A request that does not fit in the free part of the buffer goes host-staged, as with `--pd_transport host`. The
decode node takes its copy when the transfer arrives, not when a slot frees: the prefill node may free the region
on its own after `--pd_transfer_timeout_s`, so the bytes must not be read from it later.

Which pairs of nodes use it: a decode node registers the kinds of region it reads (`cuda_ipc@<host identity>`,
`nixl`); the master passes them to the prefill node with each request, which stages only when its buffer's kind
is among them.
"""

from __future__ import annotations

import socket
from collections.abc import Callable

import torch

from lightllm.cache.payload import TensorBlob
from lightllm.server.pd.region import CudaIpcHandle, DeviceRegion, NixlHandle

# every tensor of a region starts at a multiple of this (any dtype's alignment, and the copy kernels')
ALIGN = 256


def host_identity() -> str:
    """Two processes can share CUDA IPC handles only on one host: the kernel's boot id and the host name say which.
    Containers of one host share the boot id; they also need a shared IPC namespace, as for any CUDA IPC."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class RegionAllocator:
    """First-fit allocation of aligned byte ranges of a buffer of `capacity` bytes; freed ranges merge."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        # sorted, non-adjacent free ranges (offset, size)
        self._free: list[tuple[int, int]] = [(0, capacity)] if capacity > 0 else []
        self._used: dict[int, int] = {}

    def allocate(self, nbytes: int) -> int | None:
        size = _aligned(max(nbytes, 1))
        for k, (offset, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[k]
                else:
                    self._free[k] = (offset + size, free - size)
                self._used[offset] = size
                return offset
        return None

    def free(self, offset: int) -> None:
        size = self._used.pop(offset)
        ranges = sorted([*self._free, (offset, size)])
        merged: list[tuple[int, int]] = []
        for start, length in ranges:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((start, length))
        self._free = merged

    def num_free_bytes(self) -> int:
        return sum(size for _, size in self._free)


def _stream_sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.current_stream(device).synchronize()
    return lambda: None


class StagingBuffer:
    """Prefill side: the shared buffer (`handle` names it to readers; `kind` is what a decode node must read) and
    its regions. `synchronize` waits until the copies into a region are done (default: the current CUDA stream);
    `sharer` is kept as long as the buffer (a NIXL agent deregisters and stops serving reads when collected)."""

    def __init__(
        self,
        buffer: torch.Tensor,
        handle: CudaIpcHandle | NixlHandle,
        kind: str,
        synchronize: Callable[[], None] | None = None,
        sharer: object = None,
    ):
        assert buffer.dtype == torch.uint8 and buffer.dim() == 1 and buffer.is_contiguous()
        self.buffer = buffer
        self._sharer = sharer
        self.handle = handle
        self.kind = kind
        self.allocator = RegionAllocator(buffer.numel())
        self._synchronize = synchronize or _stream_sync(buffer.device)

    def stage(self, tensors: list[torch.Tensor]) -> tuple[DeviceRegion, list[TensorBlob]] | None:
        """Copy `tensors` into a free region; None when they do not fit (the caller sends them host-staged)."""
        offsets, total = [], 0
        for t in tensors:
            offsets.append(total)
            total = _aligned(total + t.numel() * t.element_size())
        start = self.allocator.allocate(total)
        if start is None:
            return None
        region = self.buffer[start : start + total]
        blobs = []
        for t, offset in zip(tensors, offsets):
            nbytes = t.numel() * t.element_size()
            if nbytes:
                region[offset : offset + nbytes].view(t.dtype).view(t.shape).copy_(t)
            blobs.append(TensorBlob(str(t.dtype).removeprefix("torch."), list(t.shape), b"", offset))
        self._synchronize()
        return DeviceRegion(self.handle, start, total), blobs

    def release(self, region: DeviceRegion) -> None:
        self.allocator.free(region.offset)


# reads a peer's region into a local uint8 tensor of the region's size
RegionRead = Callable[[DeviceRegion, torch.Tensor], None]


class RegionReader:
    """Decode side: copies a peer's region into a tensor of this node's device. `reads` maps each handle type this
    node reads to how (`cuda_ipc.CudaIpcReads`, `nixl.NixlEndpoint.read`); `kinds` are what it registers."""

    def __init__(
        self,
        device: torch.device | str,
        reads: dict[type, RegionRead],
        kinds: list[str],
        synchronize: Callable[[], None] | None = None,
    ):
        self.device = torch.device(device)
        self._reads = reads
        self.kinds = kinds
        self._synchronize = synchronize or _stream_sync(self.device)

    def pull(self, region: DeviceRegion, host: bool = False) -> torch.Tensor:
        """The region's bytes as a flat uint8 tensor on this node's device (`host`: in host memory, pinned when the
        device is a GPU), copied and complete: the peer may reuse its region once this returns."""
        read = self._reads.get(type(region.buffer))
        if read is None:
            raise RuntimeError(f"this decode node does not read {type(region.buffer).__name__} regions")
        if host:
            pin = self.device.type == "cuda"
            local = torch.empty(region.nbytes, dtype=torch.uint8, pin_memory=pin)
        else:
            local = torch.empty(region.nbytes, dtype=torch.uint8, device=self.device)
        read(region, local)
        self._synchronize()
        return local


def uses_cuda_ipc(mode: str, device: str) -> bool:
    """Whether a node of `--pd_transport mode` on `device` moves state by CUDA IPC with peers of its host."""
    return mode == "cuda_ipc" or (mode == "auto" and device == "cuda")
