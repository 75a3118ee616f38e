"""Data-parallel balancers: exact replica choices for given prompts, loads and liveness."""

from __future__ import annotations

import random

import pytest

from lightllm.cache.prefix.namespace import salt_namespace
from lightllm.server.dp.balancer import (
    CacheAwareBalancer,
    LeastLoadedBalancer,
    NoReplicaAlive,
    RoundRobinBalancer,
    RoutedPrompt,
    create_balancer,
    prefix_block_keys,
)

BLOCK = 4


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def test_round_robin_cycles_over_alive_replicas():
    b = RoundRobinBalancer()
    alive = [True, True, True]
    assert [b.choose(RoutedPrompt([]), [0, 0, 0], alive) for _ in range(4)] == [0, 1, 2, 0]
    alive[2] = False
    assert [b.choose(RoutedPrompt([]), [0, 0, 0], alive) for _ in range(3)] == [1, 0, 1]


def test_least_loaded_takes_the_lowest_index_among_equals():
    b = LeastLoadedBalancer()
    assert b.choose(RoutedPrompt([]), [3, 1, 1], [True] * 3) == 1
    assert b.choose(RoutedPrompt([]), [3, 1, 0], [True, True, False]) == 1


def test_no_alive_replica_is_refused():
    with pytest.raises(NoReplicaAlive):
        LeastLoadedBalancer().choose(RoutedPrompt([]), [0, 0], [False, False])


def test_block_keys_name_whole_blocks_and_differ_for_different_prefixes():
    a = _prompt(1, 10)
    keys = prefix_block_keys(a, BLOCK)
    assert len(keys) == 2
    assert prefix_block_keys(a[:8] + [7, 7, 7], BLOCK) == keys
    b = list(a)
    b[5] += 1
    other = prefix_block_keys(b, BLOCK)
    assert other[0] == keys[0] and other[1] != keys[1]


def test_keys_carry_the_length_and_fixed_width_tokens():
    """A key names exactly one token sequence: the same 8 tokens give one key whatever the block size; token
    boundaries cannot be shifted (fixed-width encoding), and lengths differ between keys."""
    a = _prompt(2, 8)
    assert prefix_block_keys(a, BLOCK)[1] == prefix_block_keys(a, 2 * BLOCK)[0]
    assert prefix_block_keys([0x0102, 0x03, 5, 6], BLOCK) != prefix_block_keys([0x01, 0x0203, 5, 6], BLOCK)
    assert {k[:8] for k in prefix_block_keys(a, 2)} == {n.to_bytes(8, "little") for n in (2, 4, 6, 8)}


def test_cache_aware_follows_the_longest_prefix_and_falls_back_to_least_loaded():
    b = CacheAwareBalancer(BLOCK)
    alive = [True, True, True]
    system = _prompt(3, 8)
    # nobody has seen it: the least loaded replica
    assert b.choose(RoutedPrompt(system + [1, 2]), [2, 0, 1], alive) == 1
    # the next turn carries the same prefix: replica 1 again, although replica 2 is now less loaded
    assert b.choose(RoutedPrompt(system + [1, 2, 3, 4, 5]), [2, 1, 0], alive) == 1
    # a different prompt goes to the least loaded
    assert b.choose(RoutedPrompt(_prompt(4, 9)), [2, 1, 0], alive) == 2
    # a prompt shorter than one block has no prefix to follow
    assert b.choose(RoutedPrompt([1, 2, 3]), [0, 5, 5], alive) == 0


def test_cache_aware_follows_a_prefix_only_within_its_cache_salt():
    """A salted prompt's blocks are keyed in its namespace: the same tokens under another salt (or none) are a prefix
    nobody has seen; under the same salt they follow their replica."""
    b = CacheAwareBalancer(BLOCK)
    alive = [True, True, True]
    system, a, other = _prompt(5, 8), salt_namespace("tenant-a"), salt_namespace("tenant-b")
    assert prefix_block_keys(system, BLOCK, a) != prefix_block_keys(system, BLOCK)
    assert b.choose(RoutedPrompt(system + [1], a), [1, 0, 1], alive) == 1
    # another salt, and no salt: the least loaded replica, not the salted prompt's
    assert b.choose(RoutedPrompt(system + [2], other), [1, 1, 0], alive) == 2
    assert b.choose(RoutedPrompt(system + [3]), [0, 1, 1], alive) == 0
    # twin: the same salt follows its prefix to replica 1
    assert b.choose(RoutedPrompt(system + [4], a), [0, 1, 0], alive) == 1


def test_cache_aware_leaves_a_replica_much_busier_than_the_least_loaded():
    b = CacheAwareBalancer(BLOCK)
    alive = [True, True]
    prompt = _prompt(5, 12)
    assert b.choose(RoutedPrompt(prompt), [0, 0], alive) == 0
    # 4 more than the least loaded (0) is within the slack: stays
    assert b.choose(RoutedPrompt(prompt), [4, 0], alive) == 0
    # 5 more: too busy, the least loaded takes it and the prefix moves there
    assert b.choose(RoutedPrompt(prompt), [5, 0], alive) == 1
    assert b.choose(RoutedPrompt(prompt), [5, 3], alive) == 1
    # with both busy the ratio decides: 15 <= 1.5 * 10 stays, 16 does not
    assert b.choose(RoutedPrompt(prompt), [10, 15], alive) == 1
    assert b.choose(RoutedPrompt(prompt), [10, 16], alive) == 0


def test_cache_aware_skips_a_dead_owner_and_forgets_it():
    b = CacheAwareBalancer(BLOCK)
    prompt = _prompt(6, 8)
    assert b.choose(RoutedPrompt(prompt), [0, 1], [True, True]) == 0
    assert b.choose(RoutedPrompt(prompt), [0, 1], [False, True]) == 1
    b.forget_replica(1)
    assert b.choose(RoutedPrompt(prompt), [1, 0], [True, True]) == 1


def test_cache_aware_memory_is_bounded_least_recent_first():
    b = CacheAwareBalancer(BLOCK, max_blocks=2)
    first, second = _prompt(7, 4), _prompt(8, 8)
    assert b.choose(RoutedPrompt(first), [0, 0], [True, True]) == 0
    # two more blocks: the first prompt's block is forgotten
    assert b.choose(RoutedPrompt(second), [1, 0], [True, True]) == 1
    assert b.choose(RoutedPrompt(first), [1, 0], [True, True]) == 1


def test_teeth_a_balancer_without_memory_loses_the_conversation():
    """The cache-aware choice above is not what load alone gives."""
    system = _prompt(3, 8)
    assert LeastLoadedBalancer().choose(RoutedPrompt(system + [1, 2, 3, 4, 5]), [2, 1, 0], [True] * 3) == 2


def test_create_balancer_names():
    assert isinstance(create_balancer("cache_aware", 16), CacheAwareBalancer)
    with pytest.raises(ValueError, match="unknown data-parallel balancer"):
        create_balancer("random", 16)


def test_cache_aware_takes_the_longest_prefix_among_owners():
    """Replica 0 took one block of a prefix and replica 1 three blocks of it: a prompt that diverges inside the
    second block goes to 0 (only whole blocks count), one that diverges inside the first block to the idle replica,
    and one with all three blocks to 1."""
    b = CacheAwareBalancer(BLOCK)
    alive = [True, True, True]
    base = _prompt(9, 3 * BLOCK)
    assert b.choose(RoutedPrompt(base), [1, 0, 0], alive) == 1
    # replica 1 is too busy for a prompt of the first block: replica 0 takes it (and now owns that block)
    assert b.choose(RoutedPrompt(base[:BLOCK] + [1]), [0, 9, 9], alive) == 0
    diverged_in_second = base[: BLOCK + 3] + [base[BLOCK + 3] + 1] + base[BLOCK + 4 :]
    assert b.choose(RoutedPrompt(diverged_in_second), [1, 1, 0], alive) == 0
    diverged_in_first = [base[0] + 1] + base[1:]
    assert b.choose(RoutedPrompt(diverged_in_first), [1, 1, 0], alive) == 2
    assert b.choose(RoutedPrompt(base + [5, 6]), [1, 1, 0], alive) == 1


def test_cache_aware_falls_back_to_a_shorter_prefix_of_an_alive_replica():
    b = CacheAwareBalancer(BLOCK)
    base = _prompt(10, 2 * BLOCK)
    assert b.choose(RoutedPrompt(base), [1, 0, 0], [True] * 3) == 1
    assert b.choose(RoutedPrompt(base[:BLOCK]), [0, 9, 9], [True] * 3) == 0
    # the longest prefix's replica is dead: the shorter one's replica takes it, not the idle replica 2
    assert b.choose(RoutedPrompt(base), [1, 0, 0], [True, False, True]) == 0


def test_cache_aware_sends_new_prefixes_to_idle_replicas_first():
    b = CacheAwareBalancer(BLOCK)
    loads = [3, 1, 0, 0]
    assert b.choose(RoutedPrompt(_prompt(20, 2 * BLOCK)), loads, [True] * 4) == 2
    # the lowest-index idle replica among equals; a dead idle replica is skipped
    assert b.choose(RoutedPrompt(_prompt(30, 2 * BLOCK)), [3, 1, 0, 0], [True, True, False, True]) == 3
    assert b.choose(RoutedPrompt(_prompt(31, 2 * BLOCK)), [2, 2, 1, 1], [True] * 4) == 2


def test_cache_aware_bound_is_against_the_least_loaded_alive_replica():
    """A dead replica's (stale) zero load does not make the owner look busy."""
    b = CacheAwareBalancer(BLOCK)
    prompt = _prompt(11, 2 * BLOCK)
    assert b.choose(RoutedPrompt(prompt), [0, 0, 0], [True] * 3) == 0
    assert b.choose(RoutedPrompt(prompt), [6, 0, 3], [True, False, True]) == 0
    assert b.choose(RoutedPrompt(prompt), [6, 1, 1], [True, True, True]) == 1
