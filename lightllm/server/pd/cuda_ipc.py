"""The device path of a transfer between two processes of one host: CUDA IPC of a per-node staging buffer.

A prefill node allocates one device buffer at start (`--pd_ipc_buffer_mb`) and exports its CUDA IPC handle once.
Per transfer it copies the request's tensors (KV rows, linear state, MTP head state) device to device into a free
region of that buffer, waits for the copies, and sends the usual `PdTransfer` over zmq with blobs that hold only
dtype, shape and offset, plus the region (buffer handle, offset, size). The decode node opens the buffer once per
peer (the handle is cached), copies the region into a device tensor of its own, waits for that copy and confirms;
the prefill node then frees the region. Bytes never pass through host memory or Python objects.

A request that does not fit in the free part of the buffer goes host-staged, as with `--pd_transport host`.
The decode node takes its copy when the transfer arrives, not when a slot frees: the prefill node may free the
region on its own after `--pd_transfer_timeout_s`, so the bytes must not be read from it later.
"""

from __future__ import annotations

import socket
from collections.abc import Callable

import msgspec
import torch

from lightllm.engine.transfer.payload import TensorBlob

# every tensor of a region starts at a multiple of this (any dtype's alignment, and the copy kernels')
ALIGN = 256


class CudaIpcHandle(msgspec.Struct, frozen=True):
    """What `torch.UntypedStorage._share_cuda_` returns for a storage, with the device named by UUID (device
    indices differ between processes with different CUDA_VISIBLE_DEVICES)."""

    device_uuid: str
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


class DeviceRegion(msgspec.Struct, frozen=True):
    """Where a transfer's bytes lie: `nbytes` at `offset` of the sender's staging buffer."""

    buffer: CudaIpcHandle
    offset: int
    nbytes: int


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


def share_cuda_buffer(buffer: torch.Tensor) -> CudaIpcHandle:
    """The IPC handle of a CUDA tensor's storage (call once per buffer: each call makes a new reference counter)."""
    device, handle, size, offset, rc_handle, rc_offset, event, sync = buffer.untyped_storage()._share_cuda_()
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return CudaIpcHandle(uuid, handle, size, offset, rc_handle, rc_offset, event or b"", bool(sync))


def open_cuda_buffer(handle: CudaIpcHandle) -> torch.Tensor:
    """The peer's staging buffer as a flat uint8 tensor of this process (on the device with the handle's UUID)."""
    torch.cuda._lazy_init()
    uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    if handle.device_uuid not in uuids:
        raise RuntimeError(
            f"the prefill node's staging buffer is on GPU {handle.device_uuid}, not visible to this decode node: "
            "make it visible or use --pd_transport host"
        )
    storage = torch.UntypedStorage._new_shared_cuda(
        uuids.index(handle.device_uuid),
        handle.handle,
        handle.size_bytes,
        handle.offset_bytes,
        handle.ref_counter_handle,
        handle.ref_counter_offset,
        handle.event_handle or None,
        handle.event_sync_required,
    )
    return torch.empty(0, dtype=torch.uint8, device=f"cuda:{uuids.index(handle.device_uuid)}").set_(storage)


class StagingBuffer:
    """Prefill side: the exported buffer and its regions. `share` makes the buffer's handle (CUDA IPC by
    default); `synchronize` waits until the copies into a region are done (the current CUDA stream's)."""

    def __init__(
        self,
        buffer: torch.Tensor,
        share: Callable[[torch.Tensor], CudaIpcHandle] = share_cuda_buffer,
        synchronize: Callable[[], None] | None = None,
    ):
        assert buffer.dtype == torch.uint8 and buffer.dim() == 1 and buffer.is_contiguous()
        self.buffer = buffer
        self.handle = share(buffer)
        self.allocator = RegionAllocator(buffer.numel())
        self._synchronize = synchronize or (lambda: torch.cuda.current_stream(buffer.device).synchronize())

    @classmethod
    def on_device(cls, nbytes: int, device: torch.device | str) -> StagingBuffer:
        return cls(torch.empty(nbytes, dtype=torch.uint8, device=device))

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


class RegionReader:
    """Decode side: copies a peer's region into a device tensor of this node. `open` maps a buffer handle to the
    peer's buffer (CUDA IPC by default; each handle is opened once)."""

    def __init__(
        self,
        device: torch.device | str,
        open: Callable[[CudaIpcHandle], torch.Tensor] = open_cuda_buffer,
        synchronize: Callable[[], None] | None = None,
    ):
        self.device = torch.device(device)
        self._open = open
        self._buffers: dict[bytes, torch.Tensor] = {}
        self._synchronize = synchronize or (lambda: torch.cuda.current_stream(self.device).synchronize())

    def pull(self, region: DeviceRegion) -> torch.Tensor:
        """The region's bytes as a flat uint8 tensor on this node's device, copied and complete: the peer may
        reuse its region once this returns."""
        buffer = self._buffers.get(region.buffer.handle)
        if buffer is None:
            buffer = self._buffers[region.buffer.handle] = self._open(region.buffer)
        local = torch.empty(region.nbytes, dtype=torch.uint8, device=self.device)
        local.copy_(buffer[region.offset : region.offset + region.nbytes])
        self._synchronize()
        return local


def uses_cuda_ipc(mode: str, device: str) -> bool:
    """Whether a node of `--pd_transport mode` on `device` moves state by CUDA IPC with peers of its host."""
    return mode == "cuda_ipc" or (mode == "auto" and device == "cuda")
