"""NIXL for the staging buffer (`staging.py`): the prefill node registers its buffer with a NIXL agent and sends the
agent's metadata with each region; the decode node's agent reads the region (a one-sided READ, over UCX: RDMA,
NVLink or shared memory, whatever UCX finds between the two) into memory of its own.

NIXL is optional: `--pd_transport nixl` needs the `nixl-cu13` (or `nixl-cu12`, `nixl`) package; without it the
flag is refused at start-up and nothing here is imported.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import os
import time

import torch

from lightllm.server.pd.peers import PEER_IDLE_S, IdlePeers
from lightllm.server.pd.region import DeviceRegion, NixlHandle

# the packages that ship the `nixl_agent` API, newest CUDA first
NIXL_MODULES = ("nixl_cu13._api", "nixl_cu12._api", "nixl._api")
# a read blocks the decode node's step loop: a peer that stops answering must not stall it for long
READ_TIMEOUT_S = 10.0
_agent_ids = itertools.count()


NIXL_KIND = "nixl"


def nixl_module_name() -> str | None:
    """The importable NIXL API module, or None (the spec lookup imports nothing heavy)."""
    for name in NIXL_MODULES:
        try:
            if importlib.util.find_spec(name.split(".")[0]) is not None:
                return name
        except (ImportError, ValueError):
            continue
    return None


def _mem_type(tensor: torch.Tensor) -> str:
    return "VRAM" if tensor.is_cuda else "DRAM"


class NixlEndpoint:
    """One NIXL agent (UCX backend) of this process: shares staging buffers and reads peers' regions."""

    def __init__(self, role: str, agent=None, idle_s: float = PEER_IDLE_S, clock=time.monotonic):
        """`agent`: a `nixl_agent` to use (None: a new one with the UCX backend)."""
        self.name = f"lightllm-{role}-{os.getpid()}-{next(_agent_ids)}"
        if agent is None:
            name = nixl_module_name()
            if name is None:
                raise RuntimeError("--pd_transport nixl: no NIXL package is installed (pip install nixl-cu13)")
            api = importlib.import_module(name)
            agent = api.nixl_agent(self.name, api.nixl_agent_config(backends=["UCX"]))
        self.agent = agent
        # connected peer agents by name, disconnected when idle (`peers.py`)
        self._peers: IdlePeers[str, str] = IdlePeers(self._connect, agent.remove_remote_agent, idle_s, clock)
        self._registered: list = []

    def _connect(self, handle: NixlHandle) -> str:
        self.agent.add_remote_agent(handle.metadata)
        return handle.agent

    @property
    def num_peers(self) -> int:
        return len(self._peers)

    def share(self, buffer: torch.Tensor) -> NixlHandle:
        self._registered.append(self.agent.register_memory(buffer))
        device_id = buffer.get_device() if buffer.is_cuda else 0
        return NixlHandle(
            self.name, self.agent.get_agent_metadata(), buffer.data_ptr(), buffer.numel(), device_id, _mem_type(buffer)
        )

    def read(self, region: DeviceRegion, into: torch.Tensor) -> None:
        """READ the region from its agent into `into` (contiguous, `region.nbytes` bytes); returns when done."""
        handle = region.buffer
        self._peers.get(handle.agent, handle)
        try:
            self._read(handle, region, into)
        except Exception:
            self._peers.drop(handle.agent)  # the next transfer from it reconnects
            raise

    def _read(self, handle: NixlHandle, region: DeviceRegion, into: torch.Tensor) -> None:
        reg = self.agent.register_memory(into)
        try:
            local = self.agent.get_xfer_descs(into)
            remote = self.agent.get_xfer_descs(
                [(handle.address + region.offset, region.nbytes, handle.device_id)], handle.mem_type
            )
            xfer = self.agent.initialize_xfer("READ", local, remote, handle.agent)
            try:
                state = self.agent.transfer(xfer)
                deadline = time.monotonic() + READ_TIMEOUT_S
                while state == "PROC" and time.monotonic() < deadline:
                    state = self.agent.check_xfer_state(xfer)
                if state != "DONE":
                    raise RuntimeError(f"NIXL read from {handle.agent} ended in state {state}")
            finally:
                self.agent.release_xfer_handle(xfer)
        finally:
            self.agent.deregister_memory(reg)
