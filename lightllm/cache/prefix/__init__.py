"""Prefix cache for hybrid models: shared KV of committed prefixes plus linear-attention checkpoints."""

from __future__ import annotations

from lightllm.cache.prefix.cache import Hit, PrefixCache, PrefixCacheStats, PrefixMatch
from lightllm.cache.prefix.checkpoint_pool import CheckpointPool
from lightllm.cache.prefix.radix_tree import RadixTree, TreeNode

__all__ = ["CheckpointPool", "Hit", "PrefixCache", "PrefixCacheStats", "PrefixMatch", "RadixTree", "TreeNode"]
