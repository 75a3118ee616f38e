"""The staging path of prefill/decode transfers, host-side: region allocation in the staging buffer (aligned,
first fit, freed ranges merge, a full buffer says so); staging then reading a region on CPU tensors (CUDA IPC's
open replaced by the buffer itself) returns every tensor's dtype, shape and bytes; with NIXL installed, a child
process reads a region of this process's buffer over NIXL (UCX, host memory) bit for bit, and a region overwritten
before the read gives other bytes. The cross-process CUDA IPC read is in test/gpu/test_pd_cuda_ipc_gpu.py."""

from __future__ import annotations

import multiprocessing as mp
import random

import msgspec
import pytest
import torch

from lightllm.cache.payload import TensorBlob
from lightllm.server.pd.cuda_ipc import CudaIpcHandle, CudaIpcReads
from lightllm.server.pd.nixl import NIXL_KIND, NixlEndpoint, NixlHandle, nixl_module_name
from lightllm.server.pd.staging import ALIGN, DeviceRegion, RegionAllocator, RegionReader, StagingBuffer, uses_cuda_ipc


def test_allocations_are_aligned_disjoint_and_merge_when_freed():
    rng = random.Random()
    alloc = RegionAllocator(64 * ALIGN)
    live: dict[int, int] = {}
    for _ in range(400):
        if live and (rng.random() < 0.45 or len(live) > 12):
            offset = rng.choice(list(live))
            alloc.free(offset)
            del live[offset]
            continue
        size = rng.randint(1, 9 * ALIGN)
        offset = alloc.allocate(size)
        if offset is None:
            continue
        assert offset % ALIGN == 0 and offset + size <= 64 * ALIGN
        assert all(offset + size <= o or o + s <= offset for o, s in live.items())
        live[offset] = size
    for offset in list(live):
        alloc.free(offset)
    assert alloc.num_free_bytes() == 64 * ALIGN
    # merged back into one range: the whole buffer fits again, and then nothing more
    assert alloc.allocate(64 * ALIGN) == 0 and alloc.allocate(1) is None


def _tensors() -> list[torch.Tensor]:
    return [torch.randn(2, 5, 3).bfloat16(), torch.randn(7), torch.empty(0, 4), torch.randint(0, 9, (3, 3))]


def test_staged_then_read_tensors_equal_the_originals():
    handle = CudaIpcHandle("cpu", b"h", 1 << 16, 0, b"", 0, b"", False)
    buffer = torch.full((1 << 16,), 0xAB, dtype=torch.uint8)
    staging = StagingBuffer(buffer, handle, "cuda_ipc@here")
    reader = RegionReader("cpu", {CudaIpcHandle: CudaIpcReads(open=lambda _: buffer)}, ["cuda_ipc@here"])
    tensors = _tensors()
    first = staging.stage([torch.ones(3)])
    region, blobs = staging.stage(tensors)
    assert region.offset == first[0].nbytes and region.buffer == handle
    # the region as the wire carries it
    region = msgspec.msgpack.decode(msgspec.msgpack.encode(region), type=DeviceRegion)
    local = reader.pull(region)
    staging.release(region)
    # the reader's copy is its own: the staging region may be reused at once
    buffer.zero_()
    for want, blob in zip(tensors, blobs):
        got = blob.view_in(local)
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    assert staging.stage([torch.zeros(1 << 16)]) is None
    # a handle type this reader was not given is refused with its name
    nixl_region = DeviceRegion(NixlHandle("a", b"", 0, 1, 0, "DRAM"), 0, 1)
    with pytest.raises(RuntimeError, match="does not read NixlHandle regions"):
        reader.pull(nixl_region)


@pytest.mark.parametrize(
    "mode, device, expected",
    [
        ("auto", "cuda", True),
        ("auto", "cpu", False),
        ("host", "cuda", False),
        ("cuda_ipc", "cuda", True),
        ("nixl", "cuda", False),
    ],
)
def test_transport_choice(mode, device, expected):
    assert uses_cuda_ipc(mode, device) is expected


@pytest.mark.parametrize("run_mode", ["prefill", "decode"])
def test_a_prefill_node_allocates_its_staging_buffer_before_the_kv_cache_is_sized(monkeypatch, run_mode):
    """The engine sizes its KV cache from the device memory left: a staging buffer allocated afterwards would take
    bytes the cache counted on. A decode node allocates none."""
    from lightllm.server.args import load_server_args
    from lightllm.server.pd import node
    from lightllm.tools.make_tiny_model import tiny_model_dir

    calls = []

    class Stop(Exception):
        pass

    def build_engine(*args, **kwargs):
        calls.append("engine")
        raise Stop

    monkeypatch.setattr(node, "staging_buffer", lambda args, device: calls.append(("staging", device.type)))
    monkeypatch.setattr(node, "build_engine", build_engine)
    args, info = load_server_args([], model_dir=str(tiny_model_dir("qwen3_5")), device="cpu", run_mode=run_mode)
    with pytest.raises(Stop):
        node.serve_node(args, info)
    assert calls == ([("staging", "cpu"), "engine"] if run_mode == "prefill" else ["engine"])


def test_refused_transport_flags_name_the_fix():
    from lightllm.server.args import load_server_args
    from lightllm.tools.make_tiny_model import tiny_model_dir

    model_dir = str(tiny_model_dir("qwen3_5"))
    with pytest.raises(ValueError, match="--pd_transport cuda_ipc moves device memory"):
        load_server_args([], model_dir=model_dir, device="cpu", run_mode="decode", pd_transport="cuda_ipc")
    if nixl_module_name() is None:
        with pytest.raises(ValueError, match="no NIXL package is installed"):
            load_server_args([], model_dir=model_dir, device="cpu", run_mode="decode", pd_transport="nixl")
    args, _ = load_server_args([], model_dir=model_dir, device="cpu", run_mode="decode")
    assert args.pd_transport == "auto" and not uses_cuda_ipc(args.pd_transport, args.device)


def _nixl_prefill(conn, tensors: list[torch.Tensor], overwrite: bool) -> None:
    """A prefill process: stages `tensors` in a NIXL-registered buffer, sends the region, waits for the reader."""
    endpoint = NixlEndpoint("prefill")
    buffer = torch.zeros(1 << 16, dtype=torch.uint8)
    staging = StagingBuffer(buffer, endpoint.share(buffer), NIXL_KIND)
    region, blobs = staging.stage(tensors)
    if overwrite:
        buffer[region.offset : region.offset + region.nbytes] = 7
    conn.send_bytes(msgspec.msgpack.encode([region, blobs]))
    conn.recv()


@pytest.mark.skipif(nixl_module_name() is None, reason="no NIXL package installed (nixl-cu13)")
@pytest.mark.parametrize("overwrite", [False, True], ids=["read", "overwritten-region"])
def test_a_nixl_region_of_another_process_reads_back_bit_for_bit(overwrite):
    tensors = _tensors()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_nixl_prefill, args=(child, tensors, overwrite))
    proc.start()
    try:
        region, blobs = msgspec.msgpack.decode(parent.recv_bytes(), type=tuple[DeviceRegion, list[TensorBlob]])
        reader = RegionReader("cpu", {NixlHandle: NixlEndpoint("decode").read}, [NIXL_KIND])
        local = reader.pull(region)
        parent.send("done")
    finally:
        proc.join(60)
    same = [torch.equal(b.view_in(local), t) for b, t in zip(blobs, tensors) if t.numel()]
    assert same == [not overwrite] * len(same)
