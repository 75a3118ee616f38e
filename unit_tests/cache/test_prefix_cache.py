"""Prefix cache (radix tree + checkpoint pool over real KV caches) with tiny shapes and exact slot ids: sharing,
splitting, dedup of duplicates, LRU eviction of KV and of checkpoints, reclaim under KV pressure, MTP columns,
and a 1000-request random workload that leaves every pool as it started."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from lightllm.cache.kv_cache import KVCache
from lightllm.cache.prefix import CheckpointPool, PrefixCache, RadixTree
from lightllm.cache.prefix.namespace import DEFAULT_NAMESPACE, salt_namespace
from lightllm.linear_att.base import Checkpoint


def make_kv(capacity: int = 16, rows: int = 3, max_len: int = 12) -> KVCache:
    # one layer, one (token id, position) pair per slot: tests read back what a slot holds
    return KVCache(1, ((2,),), capacity, rows, max_len, torch.float32, "cpu")


def make_cache(num_checkpoints: int = 2, mtp: bool = False, **kv_sizes) -> PrefixCache:
    template = Checkpoint(conv=torch.zeros(1, 1, 2, 3), ssm=torch.zeros(1, 1, 1, 2, 2))
    pool = CheckpointPool(template, num_checkpoints, hidden_size=4 if mtp else 0)
    return PrefixCache(pool, make_kv(**kv_sizes), make_kv(**kv_sizes) if mtp else None)


def marker(value: float, mtp: bool = False):
    """An exporter whose checkpoint (and MTP hidden) is filled with `value`."""
    ckpt = Checkpoint(conv=torch.full((1, 1, 2, 3), value), ssm=torch.full((1, 1, 1, 2, 2), value))
    return lambda: (ckpt, torch.full((1, 4), value) if mtp else None)


def compute(cache: PrefixCache, row: int, tokens: list[int], start: int) -> None:
    """What a forward does to the KV: append `tokens[start:]` to the row, writing (token, position) per slot."""
    for index, kv in enumerate(cache.caches):
        # the MTP row holds one entry per pair: one fewer than the main row
        begin, end = max(start - index, 0), len(tokens) - index
        if end <= begin:
            continue
        slots = kv.extend(row, end - begin)
        values = torch.tensor([[tokens[p + index], p + index] for p in range(begin, end)], dtype=torch.float32)
        kv.write(0, slots, values)


def read_row(kv: KVCache, row: int) -> list[list[int]]:
    return kv.gather(0, kv.req_to_slot[row, : kv.length(row)])[0].long().tolist()


def test_tree_insert_split_and_match_exact_values():
    tree = RadixTree(1)
    vals = np.arange(10, 16, dtype=np.int64)[:, None]
    node, existing = tree.insert(np.array([1, 2, 3, 4, 5, 6]), vals)
    assert existing == 0 and tree.num_evictable_tokens == 6
    upper, existing = tree.insert(np.array([1, 2, 3, 4]), np.full((4, 1), -7))
    # the tree keeps its own values for tokens it already held; the split leaves [5, 6] below
    assert existing == 4 and upper.key.tolist() == [1, 2, 3, 4] and node.key.tolist() == [5, 6]
    assert tree.path_values(node)[:, 0].tolist() == [10, 11, 12, 13, 14, 15]
    assert tree.match_len(np.array([1, 2, 3, 9])) == 3 and tree.match_len(np.array([1, 2, 3, 4, 5, 6, 7])) == 6
    assert tree.deepest(np.array([1, 2, 3, 4, 5]), lambda n: True) == (upper, 4)
    tree.lock(node)
    assert (tree.num_locked_tokens, tree.num_evictable_tokens) == (6, 0)
    tree.unlock(node)
    assert (tree.num_locked_tokens, tree.num_evictable_tokens) == (0, 6)


def test_tree_namespaces_find_only_their_own_paths():
    """One token path in two namespaces: each is found only from its own root (twin: the default namespace's own
    insert is found there), and a namespace's root goes with its last path."""
    tree = RadixTree(1)
    a, b = salt_namespace("a"), salt_namespace("b")
    tokens = np.array([4, 5, 6, 7])
    node, existing = tree.insert(tokens, np.arange(4, dtype=np.int64)[:, None], a)
    assert existing == 0 and tree.num_namespaces() == 2 and tree.namespace(node) == a
    for other in (DEFAULT_NAMESPACE, b):
        assert tree.deepest(tokens, lambda n: True, other)[1] == 0 and tree.match_len(tokens, other) == 0
    assert tree.deepest(tokens, lambda n: True, a) == (node, 4) and tree.match_len(tokens, a) == 4
    plain, existing = tree.insert(tokens[:2], np.full((2, 1), 9), DEFAULT_NAMESPACE)
    assert existing == 0 and tree.deepest(tokens, lambda n: True) == (plain, 2)
    assert tree.path_values(node)[:, 0].tolist() == [0, 1, 2, 3] and tree.namespace(plain) == DEFAULT_NAMESPACE
    removed = []
    tree.evict(lambda: False, removed.append)
    assert {id(n) for n in removed} == {id(node), id(plain)} and tree.num_tokens == 0
    assert tree.num_namespaces() == 1 and tree.match_len(tokens, a) == 0


def test_salted_requests_share_prefixes_only_within_their_salt():
    """A prefix published under one salt is resumed by that salt's requests only; the same tokens published by
    another salt take slots of their own."""
    cache = make_cache(num_checkpoints=3, capacity=32, rows=4)
    kv = cache.caches[0]
    a, b = salt_namespace("a"), salt_namespace("b")
    prompt = [3, 1, 4, 1, 5, 9]
    writer = kv.alloc_row()
    compute(cache, writer, prompt, 0)
    assert cache.publish(writer, prompt, marker(1.0), a) is not None
    # the match and the resume look only in the request's namespace
    assert cache.match(prompt, b).num_tokens == 0 and cache.match(prompt).num_tokens == 0
    reader = kv.alloc_row()
    assert cache.resume(reader, prompt, 7, b) is None and cache.resume(reader, prompt, 7) is None
    hit = cache.resume(reader, prompt, 7, a)
    assert hit is not None and hit.num_tokens == 6 and float(hit.checkpoint.conv.flatten()[0]) == 1.0
    assert kv.slots(reader).tolist() == kv.slots(writer).tolist()
    # b computes and publishes the same tokens: its own slots and checkpoint, a's untouched
    other = kv.alloc_row()
    compute(cache, other, prompt, 0)
    assert cache.publish(other, prompt, marker(2.0), b) is not None
    assert set(kv.slots(other).tolist()).isdisjoint(kv.slots(writer).tolist())
    late = kv.alloc_row()
    hit = cache.resume(late, prompt, 7, b)
    assert hit.num_tokens == 6 and float(hit.checkpoint.conv.flatten()[0]) == 2.0
    assert kv.slots(late).tolist() == kv.slots(other).tolist()


def test_share_dedup_and_checkpoint_lru_with_exact_slots():
    cache = make_cache(num_checkpoints=2)
    kv = cache.caches[0]
    a = kv.alloc_row()
    compute(cache, a, [1, 2, 3, 4, 5, 6], 0)
    assert kv.slots(a).tolist() == [0, 1, 2, 3, 4, 5]
    cache.publish(a, [1, 2, 3, 4, 5, 6], marker(6.0))
    assert kv.shared_cpu[a] == 6 and cache.num_checkpoints() == 1
    kv.free_row(a)
    cache.release(a)
    # the tree holds A's slots: not free, but reclaimable
    assert kv.num_free_tokens() == 10 and cache.num_evictable_tokens() == 6
    # B branches off at 4: no checkpoint on its path yet, the match says where to take one
    tokens_b = [1, 2, 3, 4, 9, 9, 9]
    match = cache.match(tokens_b[:-1])
    assert (match.num_tokens, match.num_pinned, match.num_matched) == (0, 0, 4)
    b = kv.alloc_row()
    assert cache.resume(b, tokens_b[:-1], len(tokens_b)) is None
    compute(cache, b, tokens_b[:4], 0)
    assert kv.slots(b).tolist() == [6, 7, 8, 9]
    cache.publish(b, tokens_b[:4], marker(4.0))
    # B's duplicates 6..9 were freed and B points at the tree's slots 0..3
    assert kv.slots(b).tolist() == [0, 1, 2, 3] and kv.num_free_tokens() == 16 - 6
    compute(cache, b, tokens_b, 4)
    assert kv.slots(b).tolist() == [0, 1, 2, 3, 6, 7, 8]
    assert read_row(kv, b) == [[t, p] for p, t in enumerate(tokens_b)]
    # the pool is full: the least recently used checkpoint ([5, 6], A's end) goes, and its leaf with it
    cache.publish(b, tokens_b, marker(7.0))
    assert cache.stats.num_checkpoints_evicted == 1 and cache.num_checkpoints() == 2
    assert kv.num_free_tokens() == 16 - 7, "slots 4, 5 of the pruned leaf are free again"
    assert cache.match([1, 2, 3, 4, 5, 6]).num_tokens == 4
    # C resumes from B's end: shares all 7 slots, gets the checkpoint B stored
    c = kv.alloc_row()
    hit = cache.resume(c, tokens_b + [5], 9)
    assert hit.num_tokens == 7 and float(hit.checkpoint.ssm.flatten()[0]) == 7.0
    assert kv.slots(c).tolist() == [0, 1, 2, 3, 6, 7, 8] and kv.shared_cpu[c] == 7
    assert (cache.stats.num_queried_tokens, cache.stats.num_hit_tokens) == (7 + 9, 7)


def test_locked_paths_are_never_evicted_and_lru_leaves_go_first():
    cache = make_cache(num_checkpoints=4, capacity=12)
    kv = cache.caches[0]
    rows = {}
    for name, tokens in (("old", [1, 1, 1, 1]), ("mid", [2, 2, 2, 2]), ("held", [3, 3, 3, 3])):
        row = rows[name] = kv.alloc_row()
        compute(cache, row, tokens, 0)
        cache.publish(row, tokens, marker(1.0))
    for name in ("old", "mid"):
        kv.free_row(rows[name])
        cache.release(rows[name])
    assert kv.num_free_tokens() == 0 and cache.num_evictable_tokens() == 8
    # a new row needs 3 slots: the least recently used leaf goes, whole
    row = kv.alloc_row()
    assert kv.extend(row, 3).tolist() == [0, 1, 2]
    assert cache.match([1, 1, 1, 1, 0]).num_tokens == 0 and cache.match([2, 2, 2, 2, 0]).num_tokens == 4
    # then the next one (its slots come out first: the free list is a stack, slot 3 was freed before them)
    assert kv.extend(row, 5).tolist() == [4, 5, 6, 7, 3]
    assert cache.match([2, 2, 2, 2, 0]).num_tokens == 0
    assert cache.num_evictable_tokens() == 0 and cache.stats.num_checkpoints_evicted == 2
    # only the held path is left, and it cannot be evicted
    with pytest.raises(RuntimeError, match="KV cache full"):
        kv.extend(row, 1)
    assert cache.match([3, 3, 3, 3, 0]).num_tokens == 4


def test_mtp_column_shares_one_pair_fewer():
    cache = make_cache(num_checkpoints=2, mtp=True)
    kv, mtp = cache.caches
    a = kv.alloc_row()
    mtp.alloc_row()
    compute(cache, a, [5, 6, 7, 8], 0)
    assert mtp.slots(a).tolist() == [0, 1, 2]
    cache.publish(a, [5, 6, 7, 8], marker(3.0, mtp=True))
    assert (kv.shared_cpu[a], mtp.shared_cpu[a]) == (4, 3)
    b = kv.alloc_row()
    mtp.alloc_row()
    hit = cache.resume(b, [5, 6, 7, 8, 1], 6)
    assert hit.num_tokens == 4 and hit.hidden.tolist() == [[3.0] * 4]
    assert mtp.slots(b).tolist() == [0, 1, 2] and mtp.shared_cpu[b] == 3
    # each token's MTP entry is the pair ending at it
    assert read_row(mtp, b) == [[6, 1], [7, 2], [8, 3]]
    for row in (a, b):
        kv.free_row(row)
        mtp.free_row(row)
        cache.release(row)
    cache.evict()
    assert kv.num_free_tokens() == mtp.num_free_tokens() == 16 and cache.tree.num_tokens == 0


def test_publish_of_a_shorter_prefix_than_shared_changes_nothing():
    cache = make_cache()
    kv = cache.caches[0]
    a = kv.alloc_row()
    compute(cache, a, [1, 2, 3], 0)
    cache.publish(a, [1, 2, 3], marker(1.0))
    cache.publish(a, [1, 2], marker(2.0))
    assert kv.shared_cpu[a] == 3 and cache.num_checkpoints() == 1


class _Workload:
    """Random requests over a few shared stems: resume, compute, publish at random points, finish or abort."""

    def __init__(self, seed: int, mtp: bool):
        self.rng = random.Random(seed)
        self.cache = make_cache(num_checkpoints=5, mtp=mtp, capacity=64, rows=4, max_len=24)
        self.stems = [[self.rng.randrange(1, 6) for _ in range(self.rng.randrange(2, 12))] for _ in range(4)]
        self.live: dict[int, list[int]] = {}
        self.num_hits = 0

    def start(self) -> None:
        kv = self.cache.caches[0]
        stem = self.rng.choice(self.stems)
        tokens = stem[: self.rng.randrange(1, len(stem) + 1)] + [self.rng.randrange(1, 6) for _ in range(4)]
        tokens = tokens[: self.rng.randrange(2, 17)]
        row = kv.alloc_row()
        if len(self.cache.caches) > 1:
            self.cache.caches[1].alloc_row()
        hit = self.cache.resume(row, tokens[:-1], len(tokens))
        start = 0
        if hit is not None:
            self.num_hits += 1
            start = hit.num_tokens
            # the checkpoint is the one stored for exactly these tokens, the shared slots hold exactly them
            assert float(hit.checkpoint.conv.flatten()[0]) == _key(tokens[:start])
            for index, cache_kv in enumerate(self.cache.caches):
                got = read_row(cache_kv, row)
                assert got == [[tokens[p + index], p + index] for p in range(start - index)]
        self.live[row] = tokens
        # commit in a few pieces, publishing some of them (as chunk ends / prompt ends would)
        ends = sorted({self.rng.randrange(start + 1, len(tokens) + 1) for _ in range(2)} | {len(tokens)})
        for end in ends:
            try:
                compute(self.cache, row, tokens[:end], self.cache.caches[0].length(row))
            except RuntimeError:
                # KV full with everything pinned: this request gives up (an abort)
                self.finish(row, publish=False)
                return
            if self.rng.random() < 0.6:
                self.cache.publish(row, tokens[:end], _exporter(tokens[:end], len(self.cache.caches) > 1))

    def finish(self, row: int, publish: bool) -> None:
        tokens = self.live.pop(row)
        kv = self.cache.caches[0]
        n = kv.length(row)
        if publish and n:
            self.cache.publish(row, tokens[:n], _exporter(tokens[:n], len(self.cache.caches) > 1))
        for cache_kv in self.cache.caches:
            cache_kv.free_row(row)
        self.cache.release(row)


def _key(tokens: list[int]) -> float:
    return float(sum((t + 1) * 7**i for i, t in enumerate(tokens)) % 1_000_003)


def _exporter(tokens: list[int], mtp: bool):
    return marker(_key(tokens), mtp)


def _run_workload(mtp: bool, num_requests: int = 1000) -> _Workload:
    work = _Workload(seed=7 if mtp else 3, mtp=mtp)
    for _ in range(num_requests):
        if len(work.live) == 4 or (work.live and work.rng.random() < 0.5):
            work.finish(work.rng.choice(list(work.live)), publish=work.rng.random() < 0.7)
        else:
            work.start()
    for row in list(work.live):
        work.finish(row, publish=False)
    return work


@pytest.mark.parametrize("mtp", [False, True])
def test_thousand_random_requests_leave_every_pool_as_it_started(mtp):
    work = _run_workload(mtp)
    cache = work.cache
    kv = cache.caches[0]
    assert work.num_hits > 200, "the workload should resume from the cache often"
    assert cache.stats.num_checkpoints_evicted > 50, "the small pool should have evicted often"
    # idle: nothing locked, everything held by the tree is reclaimable
    assert cache.tree.num_locked_tokens == 0 and not cache._held
    assert kv.num_free_tokens() + cache.num_evictable_tokens() == kv.capacity
    assert kv.num_free_rows() == 4 and not kv.shared_cpu.any()
    cache.evict()
    assert cache.tree.num_tokens == 0 and not cache.tree.root.children
    assert cache.pool.num_free() == cache.pool.num_slots and cache.num_checkpoints() == 0
    for cache_kv in cache.caches:
        assert cache_kv.num_free_tokens() == cache_kv.capacity
        # every slot is free exactly once
        assert sorted(cache_kv.allocator._stack[: cache_kv.capacity].tolist()) == list(range(cache_kv.capacity))


def test_teeth_rows_that_free_shared_slots_break_the_workload(monkeypatch):
    """Teeth: if a finished row freed the slots it shares with the tree, later requests would read reused slots
    (or the allocator would see a double free)."""
    monkeypatch.setattr(KVCache, "set_shared", lambda self, row, n: None)
    with pytest.raises(AssertionError):
        _run_workload(mtp=False)


def _brute_force_victim(cache: PrefixCache):
    """The owner a full scan picks: least recently touched, the earliest stored among equals."""
    return min(cache._owners.values(), key=lambda n: n.last_access)


@pytest.mark.parametrize("touch_every", [1, 3])
def test_eviction_picks_the_least_recently_used_checkpoint_like_a_full_scan(touch_every):
    """Many requests publish into a small pool while earlier ones are touched by hits in between; before every
    eviction the heap's victim is the full scan's. Twin: a heap that never refreshes touched owners disagrees."""
    rng = random.Random(touch_every)
    for refresh in (True, False):
        cache = make_cache(num_checkpoints=6, capacity=4000, rows=4, max_len=40)
        kv = cache.caches[0]
        if not refresh:
            # live entries by the access time they were pushed with, never refreshed
            cache._least_recent_owner = lambda c=cache: min(e for e in c._by_access if c._owners.get(e[2]) is e[3])[3]
        disagreements = 0
        for i in range(120):
            tokens = [rng.randrange(1, 6) for _ in range(rng.randrange(3, 8))] + [100 + i]
            row = kv.alloc_row()
            hit = cache.resume(row, tokens[:-1], len(tokens))
            compute(cache, row, tokens, hit.num_tokens if hit else 0)
            if cache.pool.num_free() == 0:
                disagreements += cache._least_recent_owner() is not _brute_force_victim(cache)
            cache.publish(row, tokens, marker(float(i)))
            kv.free_row(row)
            cache.release(row)
            if i % touch_every == 0 and cache._owners:
                cache.tree.touch(rng.choice(list(cache._owners.values())))
        if refresh:
            assert disagreements == 0 and cache.stats.num_checkpoints_evicted > 50
        else:
            assert disagreements > 0
