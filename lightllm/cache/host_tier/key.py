"""Host-tier keys: a token prefix named by its length and a 256-bit BLAKE2b of its token ids.

Two prefixes share a key only if they have the same length and the same digest; an entry also stores its token
ids, which a lookup compares before it trusts a key (so even a digest collision cannot hand one prefix's state to
another)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

DIGEST_BYTES = 32


@dataclass(frozen=True)
class HostKey:
    num_tokens: int
    digest: bytes


def token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """The bytes a key hashes and an entry stores: int64 little-endian token ids."""
    return np.asarray(token_ids, dtype="<i8").tobytes()


def digest_of(raw: bytes) -> bytes:
    """The digest of token ids already in `token_bytes` form."""
    return hashlib.blake2b(raw, digest_size=DIGEST_BYTES).digest()


def host_key(token_ids: Sequence[int] | np.ndarray) -> HostKey:
    return HostKey(len(token_ids), digest_of(token_bytes(token_ids)))


def prefix_keys(token_ids: Sequence[int] | np.ndarray, lengths: Iterable[int]) -> list[HostKey]:
    """The keys of the prefixes of `token_ids` at each of `lengths` (ascending, at most `len(token_ids)`), with
    one running hash over the tokens."""
    raw = token_bytes(token_ids)
    digest = hashlib.blake2b(digest_size=DIGEST_BYTES)
    keys, done = [], 0
    for n in lengths:
        assert done <= n <= len(token_ids), f"prefix lengths must ascend within the tokens, got {n} after {done}"
        digest.update(raw[8 * done : 8 * n])
        done = n
        keys.append(HostKey(n, digest.copy().digest()))
    return keys
