"""The CUDA IPC transport's host-side parts: region allocation in the staging buffer (aligned, first fit, freed
ranges merge, a full buffer says so), and staging then reading a region on CPU tensors (the handle's open replaced
by the buffer itself) returns every tensor's dtype, shape and bytes. The cross-process open is in
test/gpu/test_pd_cuda_ipc_gpu.py."""

from __future__ import annotations

import random

import pytest
import torch

from lightllm.server.pd.cuda_ipc import (
    ALIGN,
    CudaIpcHandle,
    RegionAllocator,
    RegionReader,
    StagingBuffer,
    uses_cuda_ipc,
)


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


def test_staged_then_read_tensors_equal_the_originals():
    handle = CudaIpcHandle("cpu", b"h", 1 << 16, 0, b"", 0, b"", False)
    buffer = torch.full((1 << 16,), 0xAB, dtype=torch.uint8)
    staging = StagingBuffer(buffer, share=lambda _: handle, synchronize=lambda: None)
    reader = RegionReader("cpu", open=lambda _: buffer, synchronize=lambda: None)
    tensors = [torch.randn(2, 5, 3).bfloat16(), torch.randn(7), torch.empty(0, 4), torch.randint(0, 9, (3, 3))]
    first = staging.stage([torch.ones(3)])
    region, blobs = staging.stage(tensors)
    assert region.offset == first[0].nbytes and region.buffer == handle
    local = reader.pull(region)
    staging.release(region)
    # the reader's copy is its own: the staging region may be reused at once
    buffer.zero_()
    for want, blob in zip(tensors, blobs):
        got = blob.view_in(local)
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    assert staging.stage([torch.zeros(1 << 16)]) is None


@pytest.mark.parametrize(
    "mode, device, expected",
    [("auto", "cuda", True), ("auto", "cpu", False), ("host", "cuda", False), ("cuda_ipc", "cuda", True)],
)
def test_transport_choice(mode, device, expected):
    assert uses_cuda_ipc(mode, device) is expected


def test_cuda_ipc_on_the_cpu_is_refused_with_the_flag_to_change():
    from lightllm.server.args import load_server_args
    from lightllm.tools.make_tiny_model import tiny_model_dir

    with pytest.raises(ValueError, match="--pd_transport cuda_ipc moves device memory"):
        load_server_args([], model_dir=str(tiny_model_dir("qwen3_5")), device="cpu", run_mode="decode",
                         pd_transport="cuda_ipc")  # fmt: skip
    args, _ = load_server_args([], model_dir=str(tiny_model_dir("qwen3_5")), device="cpu", run_mode="decode")
    assert args.pd_transport == "auto" and not uses_cuda_ipc(args.pd_transport, args.device)
