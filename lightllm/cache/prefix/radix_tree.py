"""Token-granular radix tree over committed tokens (SGLang-style): shared values, reference counts, LRU leaves.

A node holds a run of tokens (`key`) and, per token, the slot ids that cache it (`values [len, num_caches]`,
one column per KV cache, -1 where a cache holds nothing for that token). A path from the root spells a token
prefix; its nodes' values, concatenated, are the slots of that prefix. Requests `lock` the deepest node they use,
which pins it and every ancestor (`lock_ref` counts the locks below and at a node); unlocked leaves can be
evicted, least recently used first. A node may carry a `checkpoint` id: state saved at exactly its last token.

The tree is partitioned into namespaces (`lightllm.cache.prefix.namespace`): each has a root of its own, and a
path is only ever found from the root it was inserted under. The default namespace's root (`root`) always exists;
another's is made by its first insert and dropped with its last path.

The tree stores slot ids only; freeing them is the caller's job (`evict` reports each removed node).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import numpy as np

from lightllm.cache.prefix.namespace import DEFAULT_NAMESPACE


class TreeNode:
    __slots__ = ("key", "values", "children", "parent", "lock_ref", "last_access", "checkpoint")

    def __init__(self, key: np.ndarray, values: np.ndarray, parent: TreeNode | None):
        self.key = key
        self.values = values
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0
        self.checkpoint: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.key)

    @property
    def is_root(self) -> bool:
        return self.parent is None


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class RadixTree:
    def __init__(self, num_caches: int):
        self.num_caches = num_caches
        self.root = self._new_root()
        self._roots: dict[bytes, TreeNode] = {DEFAULT_NAMESPACE: self.root}
        self._names: dict[TreeNode, bytes] = {self.root: DEFAULT_NAMESPACE}
        self._clock = 0
        self.num_evictable_tokens = 0
        self.num_locked_tokens = 0

    @property
    def num_tokens(self) -> int:
        return self.num_evictable_tokens + self.num_locked_tokens

    def _new_root(self) -> TreeNode:
        root = TreeNode(np.zeros(0, dtype=np.int64), np.zeros((0, self.num_caches), dtype=np.int64), None)
        # a root is never evicted
        root.lock_ref = 1
        return root

    def namespace(self, node: TreeNode) -> bytes:
        """The namespace whose root `node` hangs under."""
        while not node.is_root:
            node = node.parent
        return self._names[node]

    def num_namespaces(self) -> int:
        return len(self._roots)

    # lookup --------------------------------------------------------------------------------------------------
    def deepest(
        self, tokens: np.ndarray, accept: Callable[[TreeNode], bool], namespace: bytes = DEFAULT_NAMESPACE
    ) -> tuple[TreeNode, int]:
        """The deepest node of `namespace` whose whole path is a prefix of `tokens` and that `accept`s, with its
        depth in tokens; (a root, 0) when there is none."""
        root = self._roots.get(namespace)
        if root is None:
            return self.root, 0
        node, depth, best = root, 0, (root, 0)
        while depth < len(tokens):
            child = node.children.get(int(tokens[depth]))
            if child is None:
                break
            n = child.num_tokens
            if depth + n > len(tokens) or common_prefix_len(child.key, tokens[depth : depth + n]) < n:
                break
            node, depth = child, depth + n
            if accept(node):
                best = (node, depth)
        return best

    def match_len(self, tokens: np.ndarray, namespace: bytes = DEFAULT_NAMESPACE) -> int:
        """Length of the longest prefix of `tokens` spelled by a path of `namespace` (it may end inside a node)."""
        node, depth = self._roots.get(namespace), 0
        if node is None:
            return 0
        while depth < len(tokens):
            child = node.children.get(int(tokens[depth]))
            if child is None:
                break
            k = common_prefix_len(child.key, tokens[depth:])
            depth += k
            if k < child.num_tokens:
                break
            node = child
        return depth

    def path_values(self, node: TreeNode) -> np.ndarray:
        """Values of every token from the root to the end of `node`, `[depth, num_caches]`."""
        parts = []
        while not node.is_root:
            parts.append(node.values)
            node = node.parent
        if not parts:
            return np.zeros((0, self.num_caches), dtype=np.int64)
        return np.concatenate(parts[::-1])

    def path_tokens(self, node: TreeNode) -> np.ndarray:
        """The tokens spelled from the root to the end of `node`."""
        parts = []
        while not node.is_root:
            parts.append(node.key)
            node = node.parent
        return np.concatenate(parts[::-1]) if parts else np.zeros(0, dtype=np.int64)

    def depth(self, node: TreeNode) -> int:
        n = 0
        while not node.is_root:
            n += node.num_tokens
            node = node.parent
        return n

    def touch(self, node: TreeNode) -> None:
        """Mark `node` and its ancestors as just used (LRU)."""
        self._clock += 1
        while node is not None:
            node.last_access = self._clock
            node = node.parent

    # insertion -----------------------------------------------------------------------------------------------
    def insert(
        self, tokens: np.ndarray, values: np.ndarray, namespace: bytes = DEFAULT_NAMESPACE
    ) -> tuple[TreeNode, int]:
        """Make the path of `tokens` in `namespace` end exactly at a node, adopting `values` for the tokens the
        tree lacks.

        Returns that node and how many leading tokens were in the tree already: those keep the tree's values
        (the caller's duplicates are not adopted)."""
        node = self._roots.get(namespace)
        if node is None:
            node = self._roots[namespace] = self._new_root()
            self._names[node] = namespace
        depth = 0
        while depth < len(tokens):
            child = node.children.get(int(tokens[depth]))
            if child is None:
                new = TreeNode(tokens[depth:].copy(), values[depth:].copy(), node)
                node.children[int(tokens[depth])] = new
                self.num_evictable_tokens += new.num_tokens
                return new, depth
            k = common_prefix_len(child.key, tokens[depth:])
            if k < child.num_tokens:
                child = self._split(child, k)
            node, depth = child, depth + k
        return node, len(tokens)

    def _split(self, node: TreeNode, k: int) -> TreeNode:
        """Cut `node` after its first `k` tokens; returns the new upper part (the checkpoint stays below, at the
        original end)."""
        upper = TreeNode(node.key[:k], node.values[:k], node.parent)
        upper.lock_ref, upper.last_access = node.lock_ref, node.last_access
        upper.children = {int(node.key[k]): node}
        node.parent.children[int(node.key[0])] = upper
        node.key, node.values, node.parent = node.key[k:], node.values[k:], upper
        return upper

    # references ----------------------------------------------------------------------------------------------
    def lock(self, node: TreeNode) -> None:
        while not node.is_root:
            if node.lock_ref == 0:
                self.num_evictable_tokens -= node.num_tokens
                self.num_locked_tokens += node.num_tokens
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while not node.is_root:
            assert node.lock_ref > 0, "unlock of an unlocked node"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.num_evictable_tokens += node.num_tokens
                self.num_locked_tokens -= node.num_tokens
            node = node.parent

    # removal -------------------------------------------------------------------------------------------------
    def is_evictable_leaf(self, node: TreeNode) -> bool:
        """An unlocked leaf still in the tree (a removed node keeps its parent pointer but is no longer its
        parent's child)."""
        if node.is_root or node.children or node.lock_ref:
            return False
        return self._attached(node)

    def _attached(self, node: TreeNode) -> bool:
        if node.is_root:
            return self._roots.get(self._names.get(node)) is node
        return node.parent.children.get(int(node.key[0])) is node

    def remove_leaf(self, node: TreeNode) -> None:
        assert self.is_evictable_leaf(node), "only unlocked leaves can be removed"
        parent = node.parent
        del parent.children[int(node.key[0])]
        self.num_evictable_tokens -= node.num_tokens
        if parent.is_root and not parent.children and parent is not self.root:
            # a namespace left without paths: its root goes too (salts are many, and each would keep one)
            del self._roots[self._names.pop(parent)]

    def evict(self, enough: Callable[[], bool], on_remove: Callable[[TreeNode], None]) -> None:
        """Remove unlocked leaves, least recently used first (a parent left as an unlocked leaf joins the
        candidates), until `enough()` or nothing is evictable; `on_remove(node)` frees each removed node's slots."""
        if enough():
            return
        heap = [(n.last_access, id(n), n) for n in self._nodes() if self.is_evictable_leaf(n)]
        heapq.heapify(heap)
        while heap and not enough():
            _, _, node = heapq.heappop(heap)
            if not self.is_evictable_leaf(node):
                continue
            self.remove_leaf(node)
            on_remove(node)
            # `on_remove` may have removed ancestors too: the nearest one still in the tree may now be a leaf
            # (none when the namespace's root went with its last path)
            parent = node.parent
            while parent is not None and not self._attached(parent):
                parent = parent.parent
            if parent is not None and self.is_evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))

    def _nodes(self) -> list[TreeNode]:
        out, stack = [], list(self._roots.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def nodes(self) -> list[TreeNode]:
        """Every node but the roots."""
        return [node for node in self._nodes() if not node.is_root]
