"""CUDA IPC of a prefill node's staging buffer (`staging.py`): its handle as plain msgpack-able fields, and the
decode node's side, which opens each peer's buffer once and copies regions out of it device to device."""

from __future__ import annotations

import time

import torch

from lightllm.server.pd.peers import PEER_IDLE_S, IdlePeers
from lightllm.server.pd.region import CudaIpcHandle, DeviceRegion


def cuda_ipc_kind(host: str) -> str:
    """The region kind a decode node on `host` (`staging.host_identity`) reads by CUDA IPC."""
    return f"cuda_ipc@{host}"


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
    index = uuids.index(handle.device_uuid)
    storage = torch.UntypedStorage._new_shared_cuda(
        index,
        handle.handle,
        handle.size_bytes,
        handle.offset_bytes,
        handle.ref_counter_handle,
        handle.ref_counter_offset,
        handle.event_handle or None,
        handle.event_sync_required,
    )
    return torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}").set_(storage)


class CudaIpcReads:
    """Reads regions of peers' CUDA IPC buffers; `open` maps a handle to the peer's buffer, opened once and released
    (the last reference to the opened storage closes the IPC mapping) when that peer has been idle (`peers.py`)."""

    def __init__(self, open=open_cuda_buffer, idle_s: float = PEER_IDLE_S, clock=time.monotonic):
        self._buffers: IdlePeers[bytes, torch.Tensor] = IdlePeers(open, lambda buffer: None, idle_s, clock)

    @property
    def num_open(self) -> int:
        return len(self._buffers)

    def __call__(self, region: DeviceRegion, into: torch.Tensor) -> None:
        key = region.buffer.handle
        buffer = self._buffers.get(key, region.buffer)
        try:
            into.copy_(buffer[region.offset : region.offset + region.nbytes])
        except Exception:
            self._buffers.drop(key)
            raise
