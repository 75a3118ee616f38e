"""What a transfer message says about its device region: the sender's staging buffer, named by a CUDA IPC handle
or a NIXL registration, and the region's offset and size in it. Plain msgpack-able structs, shared by the staging
buffer (`staging.py`) and the two ways of reading it (`cuda_ipc.py`, `nixl.py`)."""

from __future__ import annotations

import msgspec


class CudaIpcHandle(msgspec.Struct, frozen=True, tag="cuda_ipc"):
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


class NixlHandle(msgspec.Struct, frozen=True, tag="nixl"):
    """A staging buffer registered with the prefill node's NIXL agent."""

    agent: str
    # the agent's metadata (`get_agent_metadata`): what a peer needs to connect and read
    metadata: bytes
    address: int
    size: int
    device_id: int
    # NIXL's memory type: VRAM or DRAM
    mem_type: str


class DeviceRegion(msgspec.Struct, frozen=True):
    """Where a transfer's bytes lie: `nbytes` at `offset` of the sender's staging buffer."""

    buffer: CudaIpcHandle | NixlHandle
    offset: int
    nbytes: int
