"""The host tier's protocol: entries written by every tensor-parallel shard, READY once all have, read only whole.

An entry holds the state of one token prefix in one prefix-cache namespace: its head (the namespace's name and the
token ids, `key.entry_head`), then one section per shard (what that shard's runner wrote: its heads of the state
and KV). Writing:

1. `begin_write` (under the lock) finds the entry of the key or claims a record and a block run for it (state
   WRITING, generation bumped, this shard's writer pid registered); the first writer also copies the head.
2. The shard copies its section outside the lock (`section`).
3. `commit` (under the lock) sets the shard's bit if the record still has the ticket's generation; the bit that
   completes the mask flips the entry to READY. READY is thus published last: a writer killed before its commit
   leaves the entry WRITING forever, and it is reclaimed once every registered writer is dead.

Reading: `lookup` (under the lock) finds the longest READY entry of the namespace whose key is a prefix of the
tokens and whose stored head equals theirs, leases it for `lease_s` (not evicted meanwhile) and returns a ticket with its
generation; the reader copies its section outside the lock and then asks `valid`, which checks that the record is
still READY with that generation. A copy that overlapped an eviction is thus detected, never used.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from lightllm.cache.host_tier.arena import LAYOUT_BYTES, MAX_SHARDS, READY, WRITING, HostArena
from lightllm.cache.host_tier.key import HostKey, digest_of, entry_head, namespace_field, prefix_keys
from lightllm.cache.host_tier.slots import allocate, blocks_for, free_record, is_evictable
from lightllm.cache.prefix.namespace import DEFAULT_NAMESPACE, NAMESPACE_BYTES

# seconds a looked-up entry stays safe from eviction (a reader copies it well within this)
LEASE_S = 30.0
ALIGN = 64


@dataclass(frozen=True)
class Ticket:
    """One shard's hold on one generation of an entry (to write or to read its section)."""

    index: int
    generation: int
    num_tokens: int
    first_block: int
    shard_bytes: int
    shard: int
    # whether this writer claimed the entry (and copies its head)
    creator: bool = False


@dataclass
class HostTierStats:
    num_lookups: int = 0
    num_hits: int = 0
    num_hit_tokens: int = 0
    num_writes: int = 0
    num_written_bytes: int = 0
    num_evicted: int = 0
    # keys that matched while the stored head (namespace and token ids) did not
    num_collisions: int = 0
    num_full: int = 0


def aligned(n: int) -> int:
    """`n` bytes rounded up to `ALIGN`: where a section and each tensor in it start."""
    return -(-n // ALIGN) * ALIGN


def head_bytes(num_tokens: int) -> int:
    """The bytes an entry's head (`key.entry_head`) takes before its sections."""
    return aligned(NAMESPACE_BYTES + 8 * num_tokens)


class HostTier:
    """One process's (one shard's) handle on the arena. `layout`: a digest of what a section holds (shapes,
    dtypes, shard count); entries of another layout are invisible to this handle."""

    def __init__(self, arena: HostArena, layout: bytes, num_shards: int = 1, shard: int = 0, lease_s: float = LEASE_S):
        if not 1 <= num_shards <= MAX_SHARDS or not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} of {num_shards}: the host tier takes 1 to {MAX_SHARDS} shards")
        self.arena = arena
        self.layout = np.frombuffer(layout[:LAYOUT_BYTES].ljust(LAYOUT_BYTES, b"\0"), dtype=np.uint8)
        self.num_shards, self.shard, self.lease_s = num_shards, shard, lease_s
        self.stats = HostTierStats()
        self._pid = os.getpid()

    # writing ---------------------------------------------------------------------------------------------
    def begin_write(self, token_ids, shard_bytes: int, namespace: bytes = DEFAULT_NAMESPACE) -> Ticket | None:
        """This shard's ticket to write its `shard_bytes`-byte section of the entry of `token_ids` in `namespace`;
        None when the entry is READY already, this shard wrote (or is writing) it, or the tier cannot make room."""
        # the head as the entry stores it, built once (the key hashes the same bytes)
        raw = entry_head(token_ids, namespace)
        key, arena = HostKey(len(token_ids), digest_of(raw)), self.arena
        shard_bytes = aligned(shard_bytes)
        with arena.locked():
            index = self._find(key)
            if index is not None:
                record = arena.entries[index]
                stale = int(record["state"]) == WRITING and is_evictable(record, time.time())
                if not stale:
                    # this shard's section is written, or its writer is at it (alive or not)
                    taken = (int(record["shard_mask"]) >> self.shard) & 1 or int(record["writer_pids"][self.shard])
                    if int(record["state"]) == READY or taken or int(record["shard_bytes"]) != shard_bytes:
                        return None
                    record["writer_pids"][self.shard] = self._pid
                    return self._ticket(index)
                free_record(arena, index)
            num_blocks = blocks_for(arena, head_bytes(key.num_tokens) + self.num_shards * shard_bytes)
            found = allocate(arena, num_blocks, time.time(), self._count_eviction)
            if found is None:
                self.stats.num_full += 1
                return None
            index, first_block = found
            record = arena.entries[index]
            record["generation"] += 1
            record["num_tokens"], record["digest"] = key.num_tokens, np.frombuffer(key.digest, dtype=np.uint8)
            record["layout"], record["num_shards"], record["shard_bytes"] = self.layout, self.num_shards, shard_bytes
            record["first_block"], record["num_blocks"] = first_block, num_blocks
            record["shard_mask"], record["writer_pids"] = 0, 0
            record["writer_pids"][self.shard] = self._pid
            record["last_access"] = arena.tick()
            record["state"] = WRITING
            ticket = self._ticket(index, creator=True)
        arena.region(first_block, len(raw))[:] = np.frombuffer(raw, dtype=np.uint8)
        return ticket

    def commit(self, ticket: Ticket) -> bool:
        """Publish this shard's section; the last shard's commit makes the entry READY. False when the entry was
        reclaimed meanwhile (its section is lost)."""
        with self.arena.locked():
            record = self.arena.entries[ticket.index]
            if int(record["generation"]) != ticket.generation or int(record["state"]) != WRITING:
                return False
            record["shard_mask"] |= 1 << ticket.shard
            if int(record["shard_mask"]) == (1 << self.num_shards) - 1:
                record["state"] = READY
        self.stats.num_writes += 1
        self.stats.num_written_bytes += ticket.shard_bytes
        return True

    # reading ---------------------------------------------------------------------------------------------
    def lookup(self, token_ids, min_tokens: int = 0, namespace: bytes = DEFAULT_NAMESPACE) -> Ticket | None:
        """The longest READY entry of `namespace` whose tokens are a prefix of `token_ids`, longer than
        `min_tokens`, leased for `lease_s` seconds; None on a miss."""
        self.stats.num_lookups += 1
        tokens = np.asarray(token_ids, dtype=np.int64)
        arena = self.arena
        with arena.locked():
            table = arena.entries
            ok = (table["state"] == READY) & (table["num_tokens"] > min_tokens) & (table["num_tokens"] <= len(tokens))
            ok = self._of_layout(ok)
            lengths = sorted({int(n) for n in table["num_tokens"][ok]})
            field = np.frombuffer(namespace_field(namespace), dtype=np.uint8)
            for key in reversed(prefix_keys(tokens, lengths, namespace)):
                for index in self._matches(key, ok):
                    record = table[index]
                    stored = arena.region(int(record["first_block"]), NAMESPACE_BYTES + 8 * key.num_tokens)
                    same = np.array_equal(stored[:NAMESPACE_BYTES], field) and np.array_equal(
                        stored[NAMESPACE_BYTES:].view("<i8"), tokens[: key.num_tokens]
                    )
                    if not same:
                        self.stats.num_collisions += 1
                        continue
                    record["lease_until"] = max(float(record["lease_until"]), time.time() + self.lease_s)
                    record["last_access"] = arena.tick()
                    self.stats.num_hits += 1
                    self.stats.num_hit_tokens += key.num_tokens
                    return self._ticket(int(index))
        return None

    def valid(self, ticket: Ticket) -> bool:
        """Whether the entry still is the READY generation the ticket was taken on (ask after copying)."""
        with self.arena.locked():
            record = self.arena.entries[ticket.index]
            return int(record["generation"]) == ticket.generation and int(record["state"]) == READY

    # both ------------------------------------------------------------------------------------------------
    def section(self, ticket: Ticket) -> np.ndarray:
        """The ticket's shard section: a writable uint8 view of shared memory."""
        offset = head_bytes(ticket.num_tokens) + ticket.shard * ticket.shard_bytes
        return self.arena.region(ticket.first_block, ticket.shard_bytes, offset)

    def num_entries(self) -> int:
        with self.arena.locked():
            return int((self.arena.entries["state"] == READY).sum())

    def _find(self, key: HostKey) -> int | None:
        """The record of `key` in this layout, READY or WRITING (under the lock)."""
        table = self.arena.entries
        found = self._matches(key, self._of_layout(table["state"] != 0))
        return int(found[0]) if len(found) else None

    def _of_layout(self, mask: np.ndarray) -> np.ndarray:
        """`mask` narrowed to records of this handle's layout (the byte compare only on the records it keeps: the
        table's scalar columns are cheap to scan, its byte columns are not)."""
        rows = np.flatnonzero(mask)
        mask = np.zeros_like(mask)
        mask[rows[(self.arena.entries["layout"][rows] == self.layout).all(axis=1)]] = True
        return mask

    def _matches(self, key: HostKey, mask: np.ndarray) -> np.ndarray:
        """Records under `mask` holding `key` (length first, then the digest of the few that remain)."""
        table = self.arena.entries
        rows = np.flatnonzero(mask & (table["num_tokens"] == key.num_tokens))
        digest = np.frombuffer(key.digest, dtype=np.uint8)
        return rows[(table["digest"][rows] == digest).all(axis=1)]

    def _ticket(self, index: int, creator: bool = False) -> Ticket:
        r = self.arena.entries[index]
        return Ticket(
            index,
            int(r["generation"]),
            int(r["num_tokens"]),
            int(r["first_block"]),
            int(r["shard_bytes"]),
            self.shard,
            creator,
        )

    def _count_eviction(self) -> None:
        self.stats.num_evicted += 1
