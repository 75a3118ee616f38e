"""A host (CPU shared-memory) tier of prefix state shared by every engine process of a server: see `tier.py`."""

from __future__ import annotations

from lightllm.cache.host_tier.arena import HostArena
from lightllm.cache.host_tier.key import HostKey, host_key, prefix_keys
from lightllm.cache.host_tier.tier import HostTier, HostTierStats, Ticket

__all__ = ["HostArena", "HostKey", "HostTier", "HostTierStats", "Ticket", "host_key", "prefix_keys"]
