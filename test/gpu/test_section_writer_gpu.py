"""Host-tier writes from CUDA tensors in the background: `write` returns while the device is still busy (no host
wait), the entry holds the tensors as they were at `write` even though later work on the same stream overwrites
them, and the copy to the host does not hold up the work queued after it (it runs on the writer's stream)."""

from __future__ import annotations

import time
import uuid

import pytest
import torch

from lightllm.cache.host_tier import HostArena, HostTier
from lightllm.worker.transfer.section_writer import SectionWriter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _write(tier: HostTier, writer: SectionWriter, tokens: list[int], src: torch.Tensor) -> None:
    """`src` as the section's data past a 64-byte head, the entry claimed by the writer."""
    nbytes = 64 + src.numel() * src.element_size()
    writer.write(lambda: tier.begin_write(tokens, nbytes), b"x", 64, [src], [0])


def _section(tier: HostTier, tokens: list[int], src: torch.Tensor) -> torch.Tensor:
    """The READY entry of `tokens`, read back as `src`'s dtype."""
    ticket = tier.lookup(tokens + [-1], len(tokens) - 1)
    assert ticket is not None and ticket.num_tokens == len(tokens)
    raw = tier.section(ticket)[64 : 64 + src.numel() * src.element_size()].copy()
    return torch.from_numpy(raw).view(src.dtype)


def test_write_does_not_wait_and_keeps_the_values_of_its_time():
    arena = HostArena.create(f"lightllm-test-{uuid.uuid4().hex}", 256 << 20, block_bytes=1 << 20, max_entries=16)
    try:
        tier = HostTier(arena, b"gpu-writer-test")
        writer = SectionWriter(tier, background=True)
        src = torch.randn(4 << 20, device="cuda")
        expected = src.cpu()
        # warm the writer (its first staging buffer is pinned on first use)
        _write(tier, writer, [0], src)
        writer.flush()

        # a busy device: a spinning kernel of a measured ~0.3 s queued ahead of the copy
        t0 = time.perf_counter()
        torch.cuda._sleep(int(1e8))
        torch.cuda.synchronize()
        cycles = int(1e8 * 0.3 / (time.perf_counter() - t0))
        torch.cuda._sleep(cycles)
        t0 = time.perf_counter()
        _write(tier, writer, [1, 2], src)
        returned_s = time.perf_counter() - t0
        src.fill_(7.0)
        writer.flush()
        waited_s = time.perf_counter() - t0
        assert waited_s > 0.2, f"the spin lasted {waited_s * 1e3:.0f} ms: the test proves nothing"
        assert returned_s < 0.05, f"write took {returned_s * 1e3:.1f} ms: it waited for the device"
        stored = _section(tier, [1, 2], src)
        assert torch.equal(stored, expected)
        assert not torch.equal(stored, src.cpu())
        writer.close()
    finally:
        arena.unlink()


def test_work_queued_after_a_write_does_not_wait_for_its_copy():
    arena = HostArena.create(f"lightllm-test-{uuid.uuid4().hex}", 640 << 20, block_bytes=1 << 20, max_entries=16)
    try:
        tier = HostTier(arena, b"gpu-writer-stream-test")
        writer = SectionWriter(tier, background=True, staging_bytes=1 << 30)
        src = torch.randn(64 << 20, device="cuda")
        # the device-to-host copy alone, into pinned memory as the writer's
        pinned = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pinned.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        d2h_s = time.perf_counter() - t0
        for tokens in ([0], [1, 2]):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            _write(tier, writer, tokens, src)
            # a small kernel queued after the write: with the copy on the same stream it would wait for all of it
            after = src[:1] + 1
            done = torch.cuda.Event()
            done.record()
            done.synchronize()
            after_s = time.perf_counter() - t0
            writer.flush()
        assert d2h_s > 0.004, f"the copy took {d2h_s * 1e3:.1f} ms: the test proves nothing"
        assert after_s < d2h_s / 2, f"work after the write waited {after_s * 1e3:.1f} ms (the copy: {d2h_s * 1e3:.1f})"
        stored = _section(tier, [1, 2], src)
        # `after` is fp32 from the device: compared there, not against Python's double sum
        assert torch.equal(stored, src.cpu()) and torch.equal(after, src[:1] + 1)
        writer.close()
    finally:
        arena.unlink()
