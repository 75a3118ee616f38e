"""The host tier's protocol on CPU: entries are READY only once every shard committed, a writer killed mid-write
never yields a READY entry, a read that overlapped an eviction is detected, keys cannot be confused (a forged
colliding key is refused by the stored token ids), LRU eviction under pressure, longest-prefix lookups."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import uuid

import numpy as np
import pytest

from lightllm.cache.host_tier import HostArena, HostTier, host_key
from lightllm.cache.host_tier.arena import READY, WRITING
from lightllm.cache.prefix.namespace import salt_namespace

LAYOUT = b"test-layout"
BLOCK = 4096


@pytest.fixture
def arena():
    a = HostArena.create(f"lightllm-test-{uuid.uuid4().hex}", 16 * BLOCK, block_bytes=BLOCK, max_entries=8)
    yield a
    a.unlink()


def _write(tier: HostTier, tokens, payload: np.ndarray, namespace: bytes = b"") -> bool:
    ticket = tier.begin_write(tokens, payload.nbytes, namespace)
    if ticket is None:
        return False
    tier.section(ticket)[: payload.nbytes] = payload
    return tier.commit(ticket)


def _read(tier: HostTier, tokens, nbytes: int, min_tokens: int = 0):
    ticket = tier.lookup(tokens, min_tokens)
    if ticket is None:
        return None
    data = tier.section(ticket)[:nbytes].copy()
    return (ticket.num_tokens, data) if tier.valid(ticket) else None


def _payload(rng, nbytes=1000):
    return rng.integers(0, 256, nbytes, dtype=np.uint8)


def test_round_trip_and_longest_prefix(arena):
    rng = np.random.default_rng(0)
    tier = HostTier(arena, LAYOUT)
    tokens = rng.integers(0, 1000, 23).tolist()
    short, long_ = _payload(rng), _payload(rng)
    assert _write(tier, tokens[:5], short) and _write(tier, tokens[:17], long_)
    num, data = _read(tier, tokens, 1000)
    assert num == 17 and np.array_equal(data, long_)
    num, data = _read(tier, tokens[:16], 1000)
    assert num == 5 and np.array_equal(data, short)
    assert _read(tier, tokens, 1000, min_tokens=17) is None
    # a second write of the same key is refused (READY already); another layout sees nothing
    assert tier.begin_write(tokens[:17], 1000) is None
    assert HostTier(HostArena.attach(arena.name), b"other-layout").lookup(tokens) is None
    # twin: other tokens of the same length miss
    assert _read(tier, [t + 1 for t in tokens], 1000) is None


def test_ready_only_when_every_shard_committed(arena):
    rng = np.random.default_rng(1)
    shards = [HostTier(HostArena.attach(arena.name), LAYOUT, num_shards=2, shard=s) for s in range(2)]
    tokens = rng.integers(0, 1000, 9).tolist()
    parts = [_payload(rng), _payload(rng)]
    tickets = [shard.begin_write(tokens, 1000) for shard in shards]
    assert tickets[0].creator and not tickets[1].creator and tickets[0].index == tickets[1].index
    shards[0].section(tickets[0])[:1000] = parts[0]
    assert shards[0].commit(tickets[0])
    assert all(s.lookup(tokens) is None for s in shards)
    shards[1].section(tickets[1])[:1000] = parts[1]
    assert shards[1].commit(tickets[1])
    for shard, part in zip(shards, parts):
        num, data = _read(shard, tokens, 1000)
        assert num == 9 and np.array_equal(data, part)


def _killed_writer(name: str, tokens: list[int], num_shards: int, shard: int, commit_first: bool) -> None:
    tier = HostTier(HostArena.attach(name), LAYOUT, num_shards=num_shards, shard=shard)
    ticket = tier.begin_write(tokens, 2000)
    # half the section, then death before the commit
    tier.section(ticket)[:1000] = 7
    os.kill(os.getpid(), signal.SIGKILL)


def _run_killed_writer(name, tokens, num_shards, shard):
    proc = mp.get_context("spawn").Process(target=_killed_writer, args=(name, tokens, num_shards, shard, False))
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL


@pytest.mark.parametrize("num_shards", [1, 2], ids=["one-shard", "second-shard-killed"])
def test_writer_killed_mid_write_never_ready(arena, num_shards):
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 1000, 11).tolist()
    tier = HostTier(arena, LAYOUT, num_shards=num_shards, shard=0)
    if num_shards == 2:
        ticket = tier.begin_write(tokens, 2000)
        tier.section(ticket)[:2000] = 3
        assert tier.commit(ticket)
    _run_killed_writer(arena.name, tokens, num_shards, num_shards - 1)
    index = host_key(tokens)
    record = arena.entries[(arena.entries["num_tokens"] == index.num_tokens)][0]
    assert int(record["state"]) == WRITING
    assert tier.lookup(tokens) is None
    # the dead writer's entry is reclaimed: a new write of the same key completes (one shard)
    fresh = HostTier(arena, LAYOUT)
    payload = _payload(rng, 2000)
    if num_shards == 1:
        assert _write(fresh, tokens, payload)
        num, data = _read(fresh, tokens, 2000)
        assert num == 11 and np.array_equal(data, payload)


def test_dead_writers_blocks_are_reclaimed_under_pressure(arena):
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 1000, 5).tolist()
    _run_killed_writer(arena.name, tokens, 1, 0)
    tier = HostTier(arena, LAYOUT)
    # every block needed: the WRITING entry of the dead writer must go
    big = _payload(rng, arena.capacity_bytes - 64)
    assert _write(tier, [1, 2, 3], big)
    assert not (arena.entries["state"] == WRITING).any()


def test_live_writer_keeps_its_entry(arena):
    rng = np.random.default_rng(4)
    tier = HostTier(arena, LAYOUT)
    ticket = tier.begin_write([5, 6, 7], 8 * BLOCK)
    # this process is alive and still writing: a write that needs its blocks is refused rather than taking them
    assert tier.begin_write([8, 9], arena.capacity_bytes - 4 * BLOCK) is None
    tier.section(ticket)[:] = _payload(rng, 8 * BLOCK)
    assert tier.commit(ticket)


def test_forged_colliding_key_is_refused(arena):
    rng = np.random.default_rng(5)
    tier = HostTier(arena, LAYOUT)
    a = rng.integers(0, 1000, 12).tolist()
    b = [t + 1 for t in a]
    assert _write(tier, a, _payload(rng))
    # forge: the entry of `a` now claims `b`'s key (as if the hash had collided)
    record = arena.entries[np.flatnonzero(arena.entries["state"] == READY)[0]]
    record["digest"] = np.frombuffer(host_key(b).digest, dtype=np.uint8)
    assert tier.lookup(b) is None
    assert tier.stats.num_collisions == 1
    # twin: without the forgery the same entry answers `a` (here: restore the digest)
    record["digest"] = np.frombuffer(host_key(a).digest, dtype=np.uint8)
    assert tier.lookup(a) is not None


def test_namespaces_keep_their_entries_apart(arena):
    """An entry written in a cache salt's namespace is found only there: not by the default namespace nor by
    another salt's, even for a key forged to match (the stored head holds the namespace); the default namespace's
    entry of the same tokens is a separate one."""
    rng = np.random.default_rng(7)
    tier = HostTier(arena, LAYOUT)
    a, b = salt_namespace("tenant-a"), salt_namespace("tenant-b")
    tokens = rng.integers(0, 1000, 10).tolist()
    payload = _payload(rng)
    assert _write(tier, tokens, payload, a)
    assert tier.lookup(tokens + [1]) is None and tier.lookup(tokens + [1], namespace=b) is None
    ticket = tier.lookup(tokens + [1], namespace=a)
    assert ticket is not None and ticket.num_tokens == len(tokens)
    np.testing.assert_array_equal(tier.section(ticket)[: payload.nbytes], payload)
    # forged: the entry now claims b's key for the same tokens; b's lookup compares the stored namespace
    record = arena.entries[ticket.index]
    record["digest"] = np.frombuffer(host_key(tokens, b).digest, dtype=np.uint8)
    assert tier.lookup(tokens, namespace=b) is None and tier.stats.num_collisions == 1
    record["digest"] = np.frombuffer(host_key(tokens, a).digest, dtype=np.uint8)
    # the default namespace writes its own entry of these tokens, with its own bytes
    other = _payload(rng)
    assert _write(tier, tokens, other)
    assert tier.num_entries() == 2
    np.testing.assert_array_equal(tier.section(tier.lookup(tokens))[: other.nbytes], other)
    np.testing.assert_array_equal(tier.section(tier.lookup(tokens, namespace=a))[: payload.nbytes], payload)


def test_lru_eviction_under_pressure(arena):
    rng = np.random.default_rng(6)
    tier = HostTier(arena, LAYOUT, lease_s=0.0)
    # 16 blocks; each entry: its tokens' block share + 3 blocks = 4 blocks -> four fit
    prompts = [[100 + i, 7, 8] for i in range(5)]
    payloads = [_payload(rng, 3 * BLOCK) for _ in prompts]
    for p, data in zip(prompts[:4], payloads[:4]):
        assert _write(tier, p, data)
    # touch the first: the least recently used is now the second
    assert tier.lookup(prompts[0]) is not None
    assert _write(tier, prompts[4], payloads[4])
    present = [tier.lookup(p) is not None for p in prompts]
    assert present == [True, False, True, True, True]
    assert tier.stats.num_evicted == 1
    num, data = _read(tier, prompts[4], 3 * BLOCK)
    assert np.array_equal(data, payloads[4])


def test_read_overlapping_an_eviction_is_detected(arena):
    rng = np.random.default_rng(7)
    tier = HostTier(arena, LAYOUT, lease_s=0.0)
    assert _write(tier, [1, 2], _payload(rng, 6 * BLOCK))
    ticket = tier.lookup([1, 2, 3])
    assert ticket is not None and tier.valid(ticket)
    # the lease is over: a write that needs the room evicts the entry while the "reader" copies
    assert _write(tier, [3, 4], _payload(rng, 14 * BLOCK))
    assert not tier.valid(ticket)


def test_lease_protects_a_looked_up_entry(arena):
    rng = np.random.default_rng(8)
    tier = HostTier(arena, LAYOUT, lease_s=60.0)
    assert _write(tier, [1, 2], _payload(rng, 6 * BLOCK))
    ticket = tier.lookup([1, 2, 3])
    assert not _write(tier, [3, 4], _payload(rng, 14 * BLOCK))
    assert tier.valid(ticket)


def test_attach_by_name_and_unlink():
    name = f"lightllm-test-{uuid.uuid4().hex}"
    owner = HostArena.create(name, 4 * BLOCK, block_bytes=BLOCK, max_entries=4)
    assert os.path.exists(f"/dev/shm/{name}")
    HostTier(owner, LAYOUT).begin_write([1], 10)
    other = HostArena.attach(name)
    assert int(other.entries["state"][0]) == WRITING
    owner.unlink()
    assert not os.path.exists(f"/dev/shm/{name}")
    with pytest.raises(FileNotFoundError):
        HostArena.attach(name)
