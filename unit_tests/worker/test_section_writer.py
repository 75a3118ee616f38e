"""Host-tier writes in the background (`SectionWriter`) on CPU tensors: an entry stays invisible until its copy has
landed and been committed, then holds exactly the bytes the tensors had when `write` was called (not later ones);
the entry is claimed by the worker, not by the caller, and one the tier holds already is not copied again;
staging is bounded (a write waits for room); a failed commit is counted and the writer goes on; the foreground
mode writes and commits at once."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch

from lightllm.cache.host_tier import HostArena, HostTier
from lightllm.cache.host_tier.arena import READY, WRITING
from lightllm.cache.host_tier.tier import head_bytes
from lightllm.worker.transfer import section_writer
from lightllm.worker.transfer.section_writer import SectionWriter

LAYOUT = b"writer-test"
HEAD = b"\x07head"
DATA_START = 64


@pytest.fixture
def tier():
    arena = HostArena.create(f"lightllm-test-{uuid.uuid4().hex}", 64 << 20, block_bytes=1 << 16, max_entries=64)
    yield HostTier(arena, LAYOUT)
    arena.unlink()


def _tensors(seed: int) -> tuple[list[torch.Tensor], list[int]]:
    g = torch.Generator().manual_seed(seed)
    tensors = [
        torch.randn(3, 5, 7, generator=g),
        torch.randint(-9, 9, (11,), generator=g, dtype=torch.int64),
        torch.randn(4, 33, generator=g).to(torch.bfloat16),
    ]
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end += -(-(t.numel() * t.element_size()) // 64) * 64
    return tensors, offsets


def _start(tier: HostTier, writer: SectionWriter, tokens: list[int], tensors, offsets, claims=None) -> bool:
    """`claims`: the thread names that claimed the entry, appended to."""
    nbytes = DATA_START + offsets[-1] + tensors[-1].numel() * tensors[-1].element_size()

    def begin():
        if claims is not None:
            claims.append(threading.current_thread().name)
        return tier.begin_write(tokens, nbytes)

    return writer.write(begin, HEAD, DATA_START, tensors, offsets)


def _index(tier: HostTier, tokens: list[int], state: int = READY) -> int:
    """The record of the entry of exactly `tokens` in `state`, once there is one (a worker claims it)."""
    for _ in range(500):
        rows = [
            i
            for i in range(tier.arena.max_entries)
            if int(tier.arena.entries[i]["num_tokens"]) == len(tokens) and int(tier.arena.entries[i]["state"]) == state
        ]
        if rows:
            return rows[0]
        time.sleep(0.01)
    raise AssertionError(f"no entry of {len(tokens)} tokens in state {state}")


def _stored(tier: HostTier, index: int, like: list[torch.Tensor], offsets) -> list[torch.Tensor]:
    """The tensors as the arena holds them, read back by offset (independently of the writer)."""
    record = tier.arena.entries[index]
    section = tier.arena.region(
        int(record["first_block"]),
        int(record["shard_bytes"]),
        head_bytes(int(record["num_tokens"])),
    )
    assert section[: len(HEAD)].tobytes() == HEAD
    data = section[DATA_START:]
    out = []
    for t, o in zip(like, offsets):
        raw = data[o : o + t.numel() * t.element_size()].copy()
        out.append(torch.from_numpy(raw).view(t.dtype).view(t.shape))
    return out


class _Gate:
    """Holds the worker before its copy until opened (a slow device, seen from the host)."""

    def __init__(self, monkeypatch):
        self.open = threading.Event()
        real = section_writer.torch.from_numpy

        def gated(a):
            self.open.wait(10)
            return real(a)

        monkeypatch.setattr(section_writer, "_arena_view", gated)


@pytest.mark.parametrize("background", [False, True])
def test_entry_holds_the_tensors_as_they_were_at_write(tier, background):
    writer = SectionWriter(tier, background)
    tensors, offsets = _tensors(0)
    expected = [t.clone() for t in tensors]
    claims = []
    assert _start(tier, writer, [1, 2, 3], tensors, offsets, claims)
    for t in tensors:
        # the caller may reuse its tensors (on a GPU: later kernels overwrite the source) right after write
        t.fill_(-1)
    writer.flush()
    index = _index(tier, [1, 2, 3])
    # in the background the worker claims the entry: the caller never takes the arena's lock
    assert (claims[0] != threading.current_thread().name) == background
    for got, want in zip(_stored(tier, index, expected, offsets), expected):
        assert torch.equal(got, want)
    # twin: what the tensors hold now is not what was stored
    assert not torch.equal(_stored(tier, index, expected, offsets)[0], tensors[0])
    writer.close()


def test_invisible_until_committed(tier, monkeypatch):
    gate = _Gate(monkeypatch)
    writer = SectionWriter(tier, background=True)
    tensors, offsets = _tensors(1)
    _start(tier, writer, [4, 5, 6, 7], tensors, offsets)
    _index(tier, [4, 5, 6, 7], WRITING)
    assert tier.lookup([4, 5, 6, 7, 8]) is None
    gate.open.set()
    writer.flush()
    assert tier.lookup([4, 5, 6, 7, 8]).num_tokens == 4
    writer.close()


def test_staging_is_bounded(tier, monkeypatch):
    gate = _Gate(monkeypatch)
    one = 1 << 20
    writer = SectionWriter(tier, background=True, staging_bytes=one)
    big = [torch.randn(one // 4 - 64)]
    _start(tier, writer, [1], big, [0])
    second = threading.Thread(target=_start, args=(tier, writer, [2], [torch.randn(one // 4 - 64)], [0]))
    second.start()
    second.join(0.3)
    # the second write waits: the first holds all the staging until its copy has landed
    assert second.is_alive()
    gate.open.set()
    second.join(10)
    assert not second.is_alive()
    writer.flush()
    assert tier.lookup([1, 0]) is not None and tier.lookup([2, 0]) is not None
    writer.close()


def test_a_lost_entry_is_counted_and_the_writer_goes_on(tier, monkeypatch):
    gate = _Gate(monkeypatch)
    writer = SectionWriter(tier, background=True)
    tensors, offsets = _tensors(2)
    _start(tier, writer, [9, 9], tensors, offsets)
    index = _index(tier, [9, 9], WRITING)
    # the record is reclaimed while the copy is pending (as a stale WRITING entry would be)
    tier.arena.entries[index]["generation"] += 1
    gate.open.set()
    writer.flush()
    assert writer.num_failed == 1 and int(tier.arena.entries[index]["state"]) == WRITING
    _start(tier, writer, [8, 8], tensors, offsets)
    writer.flush()
    assert writer.num_failed == 1 and int(tier.arena.entries[_index(tier, [8, 8])]["state"]) == READY
    writer.close()


@pytest.mark.parametrize("background", [False, True])
def test_an_entry_the_tier_holds_is_not_copied_again(tier, monkeypatch, background):
    writer = SectionWriter(tier, background)
    tensors, offsets = _tensors(4)
    assert _start(tier, writer, [6, 1], tensors, offsets)
    writer.flush()
    copies = []
    arena_view = section_writer._arena_view
    monkeypatch.setattr(section_writer, "_arena_view", lambda region: copies.append(1) or arena_view(region))
    # foreground: not written; background: queued, then found there by the worker
    assert _start(tier, writer, [6, 1], tensors, offsets) == background
    writer.flush()
    assert copies == [] and writer.num_failed == 0
    # twin: a new prefix is copied
    assert _start(tier, writer, [6, 2], tensors, offsets)
    writer.flush()
    assert copies == [1]
    writer.close()


def test_close_stops_the_workers_and_drops_the_staging(tier):
    writer = SectionWriter(tier, background=True)
    tensors, offsets = _tensors(3)
    _start(tier, writer, [5, 5], tensors, offsets)
    threads = list(writer._threads)
    assert threads and all(t.is_alive() for t in threads)
    writer.close()
    assert not any(t.is_alive() for t in threads) and not writer._free
    # the pending write landed first
    assert tier.lookup([5, 5, 1]).num_tokens == 2
    writer.close()
