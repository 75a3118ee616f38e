"""The host tier's allocator: entry records and contiguous block runs, reclaimed least recently used first.

Every function here runs under the arena's lock. An entry occupies one record of the table and one run of blocks
of the data region; the occupied runs are read from the table itself (no second structure to keep in sync). When
no record or no run is free, entries are evicted by `last_access`: READY entries whose read lease has expired, and
WRITING entries all of whose writers are dead (a writer killed mid-write never finished its entry; one still alive
may be copying into its blocks, so its entry is never taken from it).
"""

from __future__ import annotations

import os

import numpy as np

from lightllm.cache.host_tier.arena import FREE, READY, WRITING, HostArena


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not yet reaped by its parent, counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return True


def is_evictable(record: np.void, now: float) -> bool:
    state = int(record["state"])
    if state == READY:
        return float(record["lease_until"]) <= now
    if state == WRITING:
        return not any(pid_alive(int(p)) for p in record["writer_pids"] if p)
    return False


def free_record(arena: HostArena, index: int) -> None:
    """Forget entry `index`: a reader still holding its old generation finds it changed."""
    record = arena.entries[index]
    record["state"] = FREE
    record["generation"] += 1
    record["shard_mask"] = 0
    record["writer_pids"] = 0
    record["num_tokens"] = -1


def _free_run(arena: HostArena, num_blocks: int) -> int | None:
    """The first block of the first free run of `num_blocks` blocks (first fit), or None."""
    # the two columns only: a whole record (digest, layout, writer pids) is ~10x their bytes
    entries = arena.entries
    used = entries["state"] != FREE
    firsts, sizes = entries["first_block"][used].astype(np.int64), entries["num_blocks"][used].astype(np.int64)
    order = np.argsort(firsts, kind="stable")
    firsts = firsts[order]
    ends = firsts + sizes[order]
    # gap i starts after the furthest run before run i (the last gap runs to the end of the region)
    starts = np.maximum.accumulate(np.concatenate([[0], ends]))
    gaps = np.append(firsts, arena.num_blocks) - starts
    fits = np.flatnonzero(gaps >= num_blocks)
    return int(starts[fits[0]]) if fits.size else None


def _free_record(arena: HostArena) -> int | None:
    free = np.flatnonzero(arena.entries["state"] == FREE)
    return int(free[0]) if free.size else None


def _least_recent_evictable(arena: HostArena, now: float) -> int | None:
    """The evictable entry of the oldest `last_access` (the lowest index among equals), or None. The table is
    scanned as arrays: it holds thousands of records, and this runs under the lock for every write once full."""
    entries = arena.entries
    state = entries["state"]
    evictable = (state == READY) & (entries["lease_until"] <= now)
    # writers are few at a time; each needs its processes looked up
    for i in np.flatnonzero(state == WRITING):
        evictable[i] = is_evictable(entries[i], now)
    candidates = np.flatnonzero(evictable)
    if not candidates.size:
        return None
    return int(candidates[np.argmin(entries["last_access"][candidates])])


def allocate(arena: HostArena, num_blocks: int, now: float, on_evict=None) -> tuple[int, int] | None:
    """A free record and a free run of `num_blocks` blocks, evicting LRU entries until both exist: (record index,
    first block), the record still FREE (the caller claims it). None when evicting everything evictable is not
    enough (the tier is full of entries in use), or the entry can never fit."""
    if num_blocks > arena.num_blocks:
        return None
    while True:
        record, first = _free_record(arena), _free_run(arena, num_blocks)
        if record is not None and first is not None:
            return record, first
        victim = _least_recent_evictable(arena, now)
        if victim is None:
            return None
        if on_evict is not None and int(arena.entries[victim]["state"]) == READY:
            on_evict()
        free_record(arena, int(victim))


def blocks_for(arena: HostArena, num_bytes: int) -> int:
    return max(1, -(-num_bytes // arena.block_bytes))


__all__ = ["FREE", "READY", "WRITING", "allocate", "blocks_for", "free_record", "is_evictable", "pid_alive"]
