"""Prefix cache for hybrid models: shared KV of committed prefixes plus linear-attention checkpoints."""

from __future__ import annotations

from lightllm.engine.prefix_cache.cache import Hit, PrefixCache, PrefixCacheStats, PrefixMatch
from lightllm.engine.prefix_cache.checkpoint_pool import CheckpointPool
from lightllm.engine.prefix_cache.radix_tree import RadixTree, TreeNode

__all__ = ["CheckpointPool", "Hit", "PrefixCache", "PrefixCacheStats", "PrefixMatch", "RadixTree", "TreeNode"]
