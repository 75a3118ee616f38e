"""CUDA IPC of the prefill node's staging buffer between two real processes (skipped without CUDA).

A child process opens the parent's buffer from the msgpack-encoded handle (the bytes a `PdTransfer` carries) and
copies a staged region into its own memory; the tensors it rebuilds from the blobs equal the parent's bit for bit.
Teeth: a region the parent overwrote before the child read it gives other bytes.
"""

from __future__ import annotations

import multiprocessing as mp

import msgspec
import pytest
import torch

from lightllm.engine.transfer.payload import TensorBlob
from lightllm.server.pd.cuda_ipc import CudaIpcHandle, CudaIpcReads, share_cuda_buffer
from lightllm.server.pd.staging import DeviceRegion, RegionReader, StagingBuffer

pytestmark = pytest.mark.gpu


def _child(wire: bytes, blobs_wire: bytes, conn) -> None:
    region = msgspec.msgpack.decode(wire, type=DeviceRegion)
    blobs = msgspec.msgpack.decode(blobs_wire, type=list[TensorBlob])
    local = RegionReader("cuda", {CudaIpcHandle: CudaIpcReads()}, ["cuda_ipc@here"]).pull(region)
    conn.send([b.view_in(local).cpu() for b in blobs])
    conn.close()


def _read_in_child(region: DeviceRegion, blobs: list[TensorBlob]) -> list[torch.Tensor]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(msgspec.msgpack.encode(region), msgspec.msgpack.encode(blobs), child))
    proc.start()
    tensors = parent.recv()
    proc.join(60)
    assert proc.exitcode == 0
    return tensors


def test_a_staged_region_read_by_another_process_equals_the_tensors():
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    buffer = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    staging = StagingBuffer(buffer, share_cuda_buffer(buffer), "cuda_ipc@here")
    # a filler region first, so the transfer's region does not start at offset 0
    filler = staging.stage([torch.ones(1000, device="cuda")])
    tensors = [
        torch.randn(2, 37, 4, 128, generator=gen, device="cuda").bfloat16(),
        torch.randn(3, 1, 96, 3, generator=gen, device="cuda"),
        torch.randn(3, 1, 8, 64, 64, generator=gen, device="cuda"),
        torch.randn(1, 512, generator=gen, device="cuda").half(),
    ]
    region, blobs = staging.stage(tensors)
    assert region.offset > 0 and all(b.data == b"" for b in blobs)
    found = _read_in_child(region, blobs)
    for want, got in zip(tensors, found):
        assert got.dtype == want.dtype and torch.equal(got, want.cpu())
    staging.release(region)
    staging.release(filler[0])
    assert staging.allocator.num_free_bytes() == 64 << 20

    # teeth: the region overwritten before the read
    region, blobs = staging.stage(tensors)
    staging.buffer[region.offset : region.offset + region.nbytes] = 0
    torch.cuda.synchronize()
    found = _read_in_child(region, blobs)
    assert not any(torch.equal(got, want.cpu()) for want, got in zip(tensors, found))
