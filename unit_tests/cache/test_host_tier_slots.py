"""The host tier's allocator against plain references over random tables: first fit over the occupied runs (a
block map scanned one block at a time) and the least recently used evictable entry (a loop over every record)."""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

from lightllm.cache.host_tier import HostArena
from lightllm.cache.host_tier.arena import FREE, READY, WRITING
from lightllm.cache.host_tier.slots import _free_run, _least_recent_evictable, is_evictable

NUM_BLOCKS = 64
NOW = 1000.0


@pytest.fixture
def arena():
    a = HostArena.create(f"lightllm-test-{uuid.uuid4().hex}", NUM_BLOCKS * 4096, block_bytes=4096, max_entries=32)
    yield a
    a.unlink()


def _fill(arena: HostArena, rng: np.random.Generator, dead_pid: int) -> None:
    """Random non-overlapping runs in random records, random states, access times, leases and writers."""
    entries = arena.entries
    entries["state"] = FREE
    block = int(rng.integers(0, 4))
    for index in rng.permutation(len(entries))[: int(rng.integers(0, len(entries)))]:
        size = int(rng.integers(1, 6))
        if block + size > NUM_BLOCKS:
            break
        record = entries[index]
        record["state"] = rng.choice([READY, WRITING])
        record["first_block"], record["num_blocks"] = block, size
        record["last_access"] = int(rng.integers(0, 20))
        record["lease_until"] = NOW + float(rng.choice([-1.0, 1.0]))
        record["writer_pids"] = 0
        record["writer_pids"][0] = rng.choice([os.getpid(), dead_pid])
        block += size + int(rng.integers(0, 4))


def _reference_free_run(arena: HostArena, num_blocks: int) -> int | None:
    taken = np.zeros(arena.num_blocks, dtype=bool)
    for record in arena.entries:
        if record["state"] != FREE:
            taken[int(record["first_block"]) : int(record["first_block"] + record["num_blocks"])] = True
    for start in range(arena.num_blocks - num_blocks + 1):
        if not taken[start : start + num_blocks].any():
            return start
    return None


def _reference_victim(arena: HostArena) -> int | None:
    best = None
    for i, record in enumerate(arena.entries):
        if record["state"] != FREE and is_evictable(record, NOW):
            if best is None or int(record["last_access"]) < int(arena.entries[best]["last_access"]):
                best = i
    return best


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_first_fit_and_victim_match_the_references(arena):
    rng, dead = np.random.default_rng(11), _dead_pid()
    sizes_seen = set()
    for _ in range(200):
        _fill(arena, rng, dead)
        for num_blocks in (1, 3, 7, 20, NUM_BLOCKS):
            got = _free_run(arena, num_blocks)
            assert got == _reference_free_run(arena, num_blocks), num_blocks
            sizes_seen.add(got is None)
        assert _least_recent_evictable(arena, NOW) == _reference_victim(arena)
    # both outcomes of the fit were met
    assert sizes_seen == {True, False}


def test_a_table_with_one_run_shortened_gives_other_fits(arena):
    """Twin: the same tables with one occupied run a block shorter (a block freed that the reference counts as
    taken) must give another first fit for some size, against the references of the intact tables."""
    rng, dead = np.random.default_rng(11), _dead_pid()
    differ = 0
    for _ in range(200):
        _fill(arena, rng, dead)
        used = np.flatnonzero((arena.entries["state"] != FREE) & (arena.entries["num_blocks"] > 1))
        expected = [_reference_free_run(arena, n) for n in (1, 3, 7)]
        if used.size:
            arena.entries[used[0]]["num_blocks"] -= 1
        differ += [_free_run(arena, n) for n in (1, 3, 7)] != expected
    assert differ > 0


def test_first_fit_edges(arena):
    """Runs at blocks [0, 3) and [5, 8): a 2-block gap at 3, then free to the end."""
    entries = arena.entries
    entries["state"] = FREE
    for index, (first, size) in zip((4, 9), ((5, 3), (0, 3))):
        entries[index]["state"], entries[index]["first_block"], entries[index]["num_blocks"] = READY, first, size
    assert _free_run(arena, 2) == 3
    assert _free_run(arena, 3) == 8
    assert _free_run(arena, NUM_BLOCKS - 8) == 8
    assert _free_run(arena, NUM_BLOCKS - 7) is None
