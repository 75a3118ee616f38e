"""The server's host tier: created before the engines start, attached by each of them by name, unlinked when the
server stops.

One arena per server, shared by every engine process (each data-parallel replica and each tensor-parallel rank):
a file in /dev/shm named after this process. Its size is `--host_tier_gb`, or by default 16 GiB capped at half
of the free space of /dev/shm (the file is sparse: memory is used as entries are written). It is off without the
prefix cache, outside `--run_mode normal` and beyond `MAX_SHARDS` (8) tensor-parallel ranks. With several
replicas, engines copy each new checkpoint at once (the others may need it); a single replica copies only what its
device cache drops.

Arenas left behind by a server that was killed (its pid no longer runs) are removed when the next one starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import uuid
from collections.abc import Callable

from lightllm.cache.host_tier import HostArena
from lightllm.cache.host_tier.arena import MAX_SHARDS, SHM_DIR
from lightllm.cache.host_tier.slots import pid_alive
from lightllm.server.args import ServerArgs

logger = logging.getLogger(__name__)

DEFAULT_HOST_TIER_GB = 16
# blocks of the arena: an entry takes whole blocks (a tiny model's prefix takes one)
BLOCK_BYTES = 1 << 20
PREFIX = "lightllm-host-"


def host_tier_bytes(args: ServerArgs) -> int:
    """The arena's size for these flags (0: off)."""
    if args.disable_prefix_cache or args.run_mode != "normal" or args.host_tier_name or args.tp > MAX_SHARDS:
        return 0
    if args.host_tier_gb is not None:
        return int(args.host_tier_gb * 2**30)
    shm = os.statvfs(SHM_DIR)
    return min(DEFAULT_HOST_TIER_GB << 30, shm.f_bavail * shm.f_frsize // 2)


class WithHostTier:
    """An engine (one process or the replicas) and the host tier it uses: stopping it unlinks the arena. Every
    other attribute is the engine's."""

    def __init__(self, engine, arena: HostArena):
        self.engine = engine
        self.arena = arena

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def stop(self, *args, **kwargs) -> None:
        try:
            self.engine.stop(*args, **kwargs)
        finally:
            self.arena.unlink()


def start_with_host_tier(args: ServerArgs, start: Callable[[ServerArgs], object]):
    """`start(args)` with the host tier created first and named in the engines' flags (as is when it is off)."""
    num_bytes = host_tier_bytes(args)
    if num_bytes < BLOCK_BYTES:
        return start(args)
    remove_orphans()
    name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    arena = HostArena.create(name, num_bytes, BLOCK_BYTES, write_through=args.dp > 1)
    logger.info("host tier: %.2f GiB in %s/%s", arena.capacity_bytes / 2**30, SHM_DIR, arena.name)
    try:
        engine = start(dataclasses.replace(args, host_tier_name=arena.name))
    except BaseException:
        arena.unlink()
        raise
    return WithHostTier(engine, arena)


def remove_orphans() -> list[str]:
    """Unlink the arenas of servers whose process is gone (killed before it could); returns their names."""
    removed = []
    for name in os.listdir(SHM_DIR):
        pid = name.removeprefix(PREFIX).split("-", 1)[0]
        if name.startswith(PREFIX) and pid.isdigit() and not pid_alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
    if removed:
        logger.info("removed host tiers of servers no longer running: %s", ", ".join(removed))
    return removed
