"""The prefix cache: a radix tree of committed tokens whose KV slots requests share, with linear-attention
checkpoints attached to tree nodes.

A hybrid model cannot resume from KV alone: the recurrent state after the prefix is needed too. So a request
resumes at the deepest node on its prompt's path that carries a checkpoint (state at exactly that node's last
token): it shares the KV of the path up to there and prefills the rest. Paths are only ever inserted up to a
checkpoint (`publish`), so a leaf always ends at one; a leaf that loses its checkpoint (pool LRU) is pruned, since
KV past the last checkpoint cannot be resumed from.

KV rows are the runner's request handles. Every KV cache of the model (the main one and, with MTP, the MTP
head's) has one value column in the tree. Token t of a path has the main KV slot of position t and, in the MTP
column, the head's entry for the pair (hidden of token t - 1, token t), which is column t - 1 of the head's row
(-1 for token 0). A request's row holds its shared prefix in its first `shared_cpu[row]` columns (and one fewer in
the MTP row); it appends after them into private slots, so shared slots are never written again.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lightllm.cache.kv_cache import KVCache
from lightllm.cache.prefix.checkpoint_pool import CheckpointPool
from lightllm.cache.prefix.namespace import DEFAULT_NAMESPACE
from lightllm.cache.prefix.radix_tree import RadixTree, TreeNode
from lightllm.linear_att.base import Checkpoint

# returns the checkpoint of a request's current state and, with MTP, its last hidden state
Exporter = Callable[[], tuple[Checkpoint, torch.Tensor | None]]


@dataclass(frozen=True)
class PrefixMatch:
    """A lookup without side effects."""

    # tokens a request would resume: the deepest checkpoint on the tokens' path
    num_tokens: int = 0
    # cached tokens on that path no request holds: reclaimable now, pinned once resumed
    num_pinned: int = 0
    # the longest cached path along the tokens (token-granular, checkpoint or not): where they branch off
    num_matched: int = 0


@dataclass
class Hit:
    num_tokens: int
    checkpoint: Checkpoint
    # the main model's final hidden state at the last resumed token (MTP only)
    hidden: torch.Tensor | None


@dataclass
class PrefixCacheStats:
    num_queried_tokens: int = 0
    num_hit_tokens: int = 0
    num_checkpoints_stored: int = 0
    num_checkpoints_evicted: int = 0


class PrefixCache:
    def __init__(self, pool: CheckpointPool, kv: KVCache, mtp_kv: KVCache | None = None):
        self.pool = pool
        self.caches = [kv] if mtp_kv is None else [kv, mtp_kv]
        self.tree = RadixTree(len(self.caches))
        self.stats = PrefixCacheStats()
        # KV row -> the deepest node it locks
        self._held: dict[int, TreeNode] = {}
        # checkpoint slot -> its node
        self._owners: dict[int, TreeNode] = {}
        # the owners by last access, for eviction: a heap of (access time when pushed, creation order, slot, node)
        # whose stale entries (touched since, or no longer owning the slot) are fixed when they reach the top
        self._by_access: list[tuple[int, int, int, TreeNode]] = []
        self._num_owned = 0
        # called with a node about to lose its checkpoint, while its checkpoint and path KV are intact (the host
        # tier keeps a copy)
        self.on_drop: Callable[[TreeNode], None] | None = None
        for index, cache in enumerate(self.caches):
            cache.reclaim = self._reclaimer(index)

    # queries ---------------------------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], namespace: bytes = DEFAULT_NAMESPACE) -> PrefixMatch:
        """What resuming a request for `tokens` in `namespace` would give; changes nothing."""
        tokens = np.asarray(tokens, dtype=np.int64)
        node, depth = self.tree.deepest(tokens, _has_checkpoint, namespace)
        num_pinned = 0
        while not node.is_root:
            num_pinned += node.num_tokens if node.lock_ref == 0 else 0
            node = node.parent
        return PrefixMatch(depth, num_pinned, self.tree.match_len(tokens, namespace))

    def num_evictable_tokens(self) -> int:
        return self.tree.num_evictable_tokens

    def num_checkpoints(self) -> int:
        return len(self._owners)

    # requests --------------------------------------------------------------------------------------------
    def resume(
        self, row: int, tokens: Sequence[int], num_queried: int, namespace: bytes = DEFAULT_NAMESPACE
    ) -> Hit | None:
        """Start the empty row `row` from the deepest checkpoint on the path of `tokens` in `namespace`: share its
        KV, lock it. `num_queried` (the request's length) only feeds the statistics. None on a miss."""
        self.stats.num_queried_tokens += num_queried
        node, depth = self.tree.deepest(np.asarray(tokens, dtype=np.int64), _has_checkpoint, namespace)
        if depth == 0:
            return None
        values = self.tree.path_values(node)
        self.caches[0].share(row, values[:, 0])
        if len(self.caches) > 1:
            self.caches[1].share(row, values[1:, 1])
        self.tree.lock(node)
        self.tree.touch(node)
        self._held[row] = node
        self.stats.num_hit_tokens += depth
        ckpt, hidden = self.pool.read(node.checkpoint)
        return Hit(depth, ckpt, hidden)

    def publish(
        self, row: int, tokens: Sequence[int], export: Exporter | None, namespace: bytes = DEFAULT_NAMESPACE
    ) -> TreeNode | None:
        """Insert the row's first `len(tokens)` committed tokens (`tokens`) into `namespace` with a checkpoint at
        their end. A row shares KV of one namespace only: it resumed from there, or nothing.

        The tree adopts the row's slots for the tokens it lacks; where it already holds a token, the row's own
        duplicate slot is freed and the row points at the tree's. The row then shares (and locks) the whole
        prefix. `export()` is called only when the node has no checkpoint yet (None: the caller writes the returned
        node's checkpoint slot itself, before the pool is read). Returns the node when it got a new
        checkpoint, else None."""
        n = len(tokens)
        kv = self.caches[0]
        shared = int(kv.shared_cpu[row])
        if n == 0 or n < shared:
            return None
        assert kv.length(row) >= n, f"row {row} holds {kv.length(row)} tokens, cannot publish {n}"
        values = np.full((n, len(self.caches)), -1, dtype=np.int64)
        values[:, 0] = kv.table_cpu[row, :n]
        if len(self.caches) > 1:
            mtp = self.caches[1]
            assert mtp.length(row) >= n - 1, f"MTP row {row} holds {mtp.length(row)} pairs, {n - 1} needed"
            values[1:, 1] = mtp.table_cpu[row, : n - 1]
        node, num_existing = self.tree.insert(np.asarray(tokens, dtype=np.int64), values, namespace)
        if num_existing > shared:
            tree_values = self.tree.path_values(node)
            kv.replace(row, shared, tree_values[shared:num_existing, 0])
            if len(self.caches) > 1:
                first = max(shared, 1)
                self.caches[1].replace(row, first - 1, tree_values[first:num_existing, 1])
        self.tree.lock(node)
        old = self._held.get(row)
        self._held[row] = node
        if old is not None:
            self.tree.unlock(old)
        kv.set_shared(row, n)
        if len(self.caches) > 1:
            self.caches[1].set_shared(row, n - 1)
        self.tree.touch(node)
        if node.checkpoint is None and self.pool.num_slots:
            slot = self._alloc_checkpoint()
            if export is not None:
                ckpt, hidden = export()
                self.pool.write(slot, ckpt, hidden)
            self._own(slot, node)
            self.stats.num_checkpoints_stored += 1
            return node
        return None

    def release(self, row: int) -> None:
        """Drop the row's lock (call after the row's KV was freed: its shared columns are not freed by it)."""
        node = self._held.pop(row, None)
        if node is not None:
            self.tree.unlock(node)
            self._prune(node)

    # memory ----------------------------------------------------------------------------------------------
    def evict(self, num_tokens: int | None = None) -> None:
        """Evict unlocked paths (LRU) until `num_tokens` main KV slots are free; None = everything evictable."""
        kv = self.caches[0]
        enough = (lambda: False) if num_tokens is None else (lambda: kv.num_free_tokens() >= num_tokens)
        self.tree.evict(enough, self._free_node)

    def _reclaimer(self, index: int) -> Callable[[int], None]:
        cache = self.caches[index]

        def reclaim(num_slots: int) -> None:
            self.tree.evict(lambda: cache.num_free_tokens() >= num_slots, self._free_node)

        return reclaim

    def _own(self, slot: int, node: TreeNode) -> None:
        node.checkpoint = slot
        self._owners[slot] = node
        self._num_owned += 1
        heapq.heappush(self._by_access, (node.last_access, self._num_owned, slot, node))
        if len(self._by_access) > 2 * len(self._owners) + 64:
            self._by_access = [e for e in self._by_access if self._owners.get(e[2]) is e[3]]
            heapq.heapify(self._by_access)

    def _least_recent_owner(self) -> TreeNode:
        """The checkpoint owner touched longest ago (the earliest stored among equals), in O(log n) amortized."""
        heap = self._by_access
        while True:
            access, order, slot, node = heap[0]
            if self._owners.get(slot) is not node:
                heapq.heappop(heap)
            elif node.last_access != access:
                heapq.heapreplace(heap, (node.last_access, order, slot, node))
            else:
                return node

    def _alloc_checkpoint(self) -> int:
        if self.pool.num_free() == 0:
            victim = self._least_recent_owner()
            self._drop_checkpoint(victim)
            self._prune(victim)
        return self.pool.alloc()

    def _drop_checkpoint(self, node: TreeNode) -> None:
        if self.on_drop is not None:
            self.on_drop(node)
        self.pool.free(node.checkpoint)
        del self._owners[node.checkpoint]
        node.checkpoint = None
        self.stats.num_checkpoints_evicted += 1

    def _prune(self, node: TreeNode) -> None:
        """Remove `node` if it is an unlocked leaf without a checkpoint (no request can resume from it); its
        parent is checked in turn."""
        if node.checkpoint is None and self.tree.is_evictable_leaf(node):
            self.tree.remove_leaf(node)
            self._free_node(node)

    def _free_node(self, node: TreeNode) -> None:
        if node.checkpoint is not None:
            self._drop_checkpoint(node)
        for index, cache in enumerate(self.caches):
            slots = node.values[:, index]
            slots = slots[slots >= 0]
            if slots.size:
                cache.allocator.free(slots)
        # a parent left without children and without a checkpoint is useless too
        self._prune(node.parent)


def _has_checkpoint(node: TreeNode) -> bool:
    return node.checkpoint is not None
