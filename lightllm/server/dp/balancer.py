"""Which data-parallel replica takes a new request (`--dp_balancer`).

A choice is a hint for speed only: every replica serves every request correctly, so a wrong guess costs a prefix
recomputation, never a wrong token. Each balancer sees the prompt's token ids and prefix-cache namespace (its
cache_salt's), every replica's load (sequences in flight) and which replicas are alive, and returns an alive
replica's index.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from lightllm.cache.prefix.namespace import DEFAULT_NAMESPACE

# `cache_aware` follows a prefix to its replica unless that replica is this much busier than the least loaded one:
# more than LOAD_RATIO times its load and LOAD_SLACK sequences more
LOAD_RATIO = 1.5
LOAD_SLACK = 4
# prefix blocks remembered (least recently routed forgotten first): ~100 MB of keys at most
MAX_REMEMBERED_BLOCKS = 1 << 20


class NoReplicaAlive(RuntimeError):
    pass


@dataclass(frozen=True)
class RoutedPrompt:
    """What a balancer routes by: the prompt's token ids and its prefix-cache namespace (its cache_salt's)."""

    token_ids: Sequence[int]
    namespace: bytes = DEFAULT_NAMESPACE


def _alive_indices(alive: Sequence[bool]) -> list[int]:
    indices = [i for i, up in enumerate(alive) if up]
    if not indices:
        raise NoReplicaAlive("no data-parallel replica is alive")
    return indices


def least_loaded(loads: Sequence[int], alive: Sequence[bool]) -> int:
    """The alive replica with the fewest sequences in flight (the lowest index among equals)."""
    return min(_alive_indices(alive), key=lambda i: (loads[i], i))


class RoundRobinBalancer:
    def __init__(self) -> None:
        self._next = 0

    def choose(self, prompt: RoutedPrompt, loads: Sequence[int], alive: Sequence[bool]) -> int:
        up = _alive_indices(alive)
        n = len(alive)
        for step in range(n):
            i = (self._next + step) % n
            if i in up:
                self._next = (i + 1) % n
                return i
        raise AssertionError("unreachable: an alive replica exists")

    def forget_replica(self, replica: int) -> None:
        """Round robin remembers no prefix."""


class LeastLoadedBalancer:
    def choose(self, prompt: RoutedPrompt, loads: Sequence[int], alive: Sequence[bool]) -> int:
        return least_loaded(loads, alive)

    def forget_replica(self, replica: int) -> None:
        """Load alone decides: nothing is remembered."""


def prefix_block_keys(token_ids: Sequence[int], block_tokens: int, namespace: bytes = DEFAULT_NAMESPACE) -> list[bytes]:
    """One key per whole block of the prompt: key k names the first (k + 1) * block_tokens tokens in `namespace` (a
    running BLAKE2b over the namespace's name and the tokens, with the length in the key, so two prefixes share a
    key only if they are equal and of one namespace)."""
    digest = hashlib.blake2b(namespace, digest_size=16)
    keys = []
    for end in range(block_tokens, len(token_ids) + 1, block_tokens):
        digest.update(b"".join(t.to_bytes(4, "little") for t in token_ids[end - block_tokens : end]))
        keys.append(end.to_bytes(8, "little") + digest.copy().digest())
    return keys


class CacheAwareBalancer:
    """Routes a prompt to the replica that took the longest prefix of it (in blocks of `block_tokens`, the prefix
    cache's checkpoint granularity), unless that replica is much busier than the least loaded one
    (`LOAD_RATIO`, `LOAD_SLACK`); otherwise, and for a prefix nobody has seen, to the least loaded replica.
    Every block of the routed prompt is then remembered on the chosen replica, so a conversation's next turn
    follows it."""

    def __init__(self, block_tokens: int, max_blocks: int = MAX_REMEMBERED_BLOCKS):
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {block_tokens}")
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks
        self._owner: OrderedDict[bytes, int] = OrderedDict()

    def choose(self, prompt: RoutedPrompt, loads: Sequence[int], alive: Sequence[bool]) -> int:
        keys = prefix_block_keys(prompt.token_ids, self.block_tokens, prompt.namespace)
        least = least_loaded(loads, alive)
        chosen = least
        for key in reversed(keys):
            owner = self._owner.get(key)
            if owner is not None and alive[owner]:
                if loads[owner] <= max(LOAD_RATIO * loads[least], loads[least] + LOAD_SLACK):
                    chosen = owner
                break
        self._remember(keys, chosen)
        return chosen

    def forget_replica(self, replica: int) -> None:
        """A replica that died (or restarted empty) holds no prefix any more."""
        for key in [k for k, owner in self._owner.items() if owner == replica]:
            del self._owner[key]

    def _remember(self, keys: list[bytes], replica: int) -> None:
        for key in keys:
            self._owner[key] = replica
            self._owner.move_to_end(key)
        while len(self._owner) > self.max_blocks:
            self._owner.popitem(last=False)


BALANCERS = ("cache_aware", "least_loaded", "round_robin")


def create_balancer(name: str, block_tokens: int):
    if name == "cache_aware":
        return CacheAwareBalancer(block_tokens)
    if name == "least_loaded":
        return LeastLoadedBalancer()
    if name == "round_robin":
        return RoundRobinBalancer()
    raise ValueError(f"unknown data-parallel balancer {name!r}; expected one of {BALANCERS}")
