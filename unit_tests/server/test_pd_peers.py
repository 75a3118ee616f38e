"""A decode node's per-prefill-node resources (`lightllm/server/pd/peers.py`): an opened CUDA IPC buffer or a
connected NIXL agent is opened once, reused, closed once that peer has been idle, and closed at once after a read
from it failed. CUDA IPC and NIXL are faked here (a CPU tensor as the peer's buffer, an in-memory agent); the real
cross-process reads are `test/gpu/test_pd_cuda_ipc_gpu.py` and `test_pd_staging.py`'s NIXL test."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from lightllm.server.pd.cuda_ipc import CudaIpcHandle, CudaIpcReads
from lightllm.server.pd.nixl import NixlEndpoint, NixlHandle
from lightllm.server.pd.peers import IdlePeers
from lightllm.server.pd.staging import DeviceRegion


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_idle_peers_open_once_reuse_and_close_what_went_idle():
    clock, opened, closed = Clock(), [], []

    def open_(arg):
        opened.append(arg)
        return f"res-{arg}-{len(opened)}"

    peers = IdlePeers(open_, closed.append, idle_s=60.0, clock=clock)
    a = peers.get("a", "A")
    assert peers.get("a", "A") == a and opened == ["A"]
    clock.now += 50
    b = peers.get("b", "B")
    clock.now += 50  # a idle for 100 s, b for 50 s
    assert peers.get("b", "B") == b
    assert closed == [a] and "a" not in peers and len(peers) == 1
    # a peer's own use never closes it, however long it was idle
    clock.now += 500
    assert peers.get("b", "B") == b and closed == [a]
    # a closed peer opens again on its next use
    a2 = peers.get("a", "A")
    assert a2 != a and opened == ["A", "B", "A"]
    peers.drop("a")
    assert closed == [a, a2] and "a" not in peers
    peers.drop("a")  # dropping what is not open is a no-op
    assert closed == [a, a2]


def _ipc_handle(name: bytes) -> CudaIpcHandle:
    return CudaIpcHandle("GPU-test", name, 4096, 0, b"rc", 0, b"", False)


def test_cuda_ipc_reads_copy_the_region_and_release_an_idle_peer_buffer():
    clock, buffers = Clock(), {}
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    for name in (b"p1", b"p2"):
        buffers[name] = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=gen)
    opened = []

    def open_(handle: CudaIpcHandle) -> torch.Tensor:
        opened.append(handle.handle)
        return buffers[handle.handle].clone()  # the "mapping": a tensor only the reader holds

    reads = CudaIpcReads(open=open_, idle_s=60.0, clock=clock)
    into = torch.full((256,), 7, dtype=torch.uint8)
    reads(DeviceRegion(_ipc_handle(b"p1"), 512, 256), into)
    assert torch.equal(into, buffers[b"p1"][512:768])
    # twin: another offset of the same buffer gives other bytes
    other = torch.empty(256, dtype=torch.uint8)
    reads(DeviceRegion(_ipc_handle(b"p1"), 1024, 256), other)
    assert not torch.equal(other, into) and opened == [b"p1"]

    mapping = weakref.ref(reads._buffers._items[b"p1"][0])
    clock.now += 61
    reads(DeviceRegion(_ipc_handle(b"p2"), 0, 256), into)
    assert torch.equal(into, buffers[b"p2"][:256])
    gc.collect()
    assert mapping() is None, "the idle peer's opened buffer is still referenced"
    assert reads.num_open == 1 and opened == [b"p1", b"p2"]


def test_a_failed_cuda_ipc_read_drops_that_peer_and_the_next_read_reopens_it():
    opened = []

    def open_(handle):
        opened.append(handle.handle)
        return torch.zeros(1024, dtype=torch.uint8)

    reads = CudaIpcReads(open=open_)
    into = torch.empty(256, dtype=torch.uint8)
    with pytest.raises(RuntimeError):
        reads(DeviceRegion(_ipc_handle(b"p1"), 900, 256), into)  # past the buffer's end: the copy fails
    assert reads.num_open == 0
    reads(DeviceRegion(_ipc_handle(b"p1"), 0, 256), into)
    assert opened == [b"p1", b"p1"] and reads.num_open == 1


class FakeNixlAgent:
    """The `nixl_agent` calls `NixlEndpoint` makes, over in-memory peers: remote memory is a dict address ->
    tensor per peer agent name; a READ copies from it. `fail` makes the next transfer end in state ERR."""

    def __init__(self, remote: dict[str, torch.Tensor]):
        self.remote = remote
        self.connected: list[str] = []
        self.removed: list[str] = []
        self.fail = False
        self.registered = 0

    def add_remote_agent(self, metadata: bytes) -> str:
        self.connected.append(metadata.decode())
        return metadata.decode()

    def remove_remote_agent(self, name: str) -> None:
        self.removed.append(name)

    def register_memory(self, tensor):
        self.registered += 1
        return tensor

    def deregister_memory(self, reg) -> None:
        self.registered -= 1

    def get_xfer_descs(self, descs, mem_type=None):
        return descs

    def initialize_xfer(self, op, local, remote, agent):
        # a READ needs the peer connected now: added more often than removed
        assert op == "READ" and self.connected.count(agent) > self.removed.count(agent)
        return (local, remote, agent)

    def transfer(self, xfer) -> str:
        local, remote, agent = xfer
        if self.fail:
            self.fail = False
            return "ERR"
        ((address, nbytes, _),) = remote
        local.copy_(self.remote[agent][address : address + nbytes])
        return "DONE"

    def check_xfer_state(self, xfer) -> str:
        return "DONE"

    def release_xfer_handle(self, xfer) -> None:
        pass


def _nixl_region(agent: str, offset: int, nbytes: int) -> DeviceRegion:
    return DeviceRegion(NixlHandle(agent, agent.encode(), 0, 4096, 0, "DRAM"), offset, nbytes)


def test_nixl_reads_disconnect_an_idle_peer_and_a_failing_one():
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    memory = {name: torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=gen) for name in ("pa", "pb")}
    agent, clock = FakeNixlAgent(memory), Clock()
    endpoint = NixlEndpoint("decode", agent=agent, idle_s=60.0, clock=clock)
    into = torch.empty(128, dtype=torch.uint8)
    endpoint.read(_nixl_region("pa", 256, 128), into)
    assert torch.equal(into, memory["pa"][256:384])
    endpoint.read(_nixl_region("pa", 0, 128), into)
    assert torch.equal(into, memory["pa"][:128]) and not torch.equal(into, memory["pa"][256:384])
    assert agent.connected == ["pa"] and agent.registered == 0

    clock.now += 61
    endpoint.read(_nixl_region("pb", 0, 128), into)
    assert torch.equal(into, memory["pb"][:128])
    assert agent.removed == ["pa"] and endpoint.num_peers == 1

    agent.fail = True
    with pytest.raises(RuntimeError, match="state ERR"):
        endpoint.read(_nixl_region("pb", 0, 128), into)
    assert agent.removed == ["pa", "pb"] and endpoint.num_peers == 0 and agent.registered == 0
    endpoint.read(_nixl_region("pb", 128, 128), into)
    assert torch.equal(into, memory["pb"][128:256]) and agent.connected == ["pa", "pb", "pb"]
