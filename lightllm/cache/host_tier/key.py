"""Host-tier keys: a token prefix in a prefix-cache namespace, named by its length and a 256-bit BLAKE2b of its
entry head (the namespace's name, then its token ids).

Two prefixes share a key only if they have the same length and the same digest; an entry also stores its head,
which a lookup compares before it trusts a key (so even a digest collision cannot hand one prefix's state to
another, nor one namespace's to another)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from lightllm.cache.prefix.namespace import DEFAULT_NAMESPACE, NAMESPACE_BYTES

DIGEST_BYTES = 32


@dataclass(frozen=True)
class HostKey:
    num_tokens: int
    digest: bytes


def token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """The bytes an entry stores its token ids as: int64 little-endian."""
    return np.asarray(token_ids, dtype="<i8").tobytes()


def namespace_field(namespace: bytes) -> bytes:
    """The `NAMESPACE_BYTES` an entry head starts with: the namespace's name (zeros for the default one)."""
    assert len(namespace) in (0, NAMESPACE_BYTES), f"a namespace is named by {NAMESPACE_BYTES} bytes"
    return namespace.ljust(NAMESPACE_BYTES, b"\0")


def entry_head(token_ids: Sequence[int] | np.ndarray, namespace: bytes = DEFAULT_NAMESPACE) -> bytes:
    """What an entry stores before its sections and its key hashes: the namespace field, then the token ids."""
    return namespace_field(namespace) + token_bytes(token_ids)


def digest_of(raw: bytes) -> bytes:
    """The digest of an entry head (`entry_head`)."""
    return hashlib.blake2b(raw, digest_size=DIGEST_BYTES).digest()


def host_key(token_ids: Sequence[int] | np.ndarray, namespace: bytes = DEFAULT_NAMESPACE) -> HostKey:
    return HostKey(len(token_ids), digest_of(entry_head(token_ids, namespace)))


def prefix_keys(
    token_ids: Sequence[int] | np.ndarray, lengths: Iterable[int], namespace: bytes = DEFAULT_NAMESPACE
) -> list[HostKey]:
    """The keys of the prefixes of `token_ids` in `namespace` at each of `lengths` (ascending, at most
    `len(token_ids)`), with one running hash over the tokens."""
    raw = token_bytes(token_ids)
    digest = hashlib.blake2b(namespace_field(namespace), digest_size=DIGEST_BYTES)
    keys, done = [], 0
    for n in lengths:
        assert done <= n <= len(token_ids), f"prefix lengths must ascend within the tokens, got {n} after {done}"
        digest.update(raw[8 * done : 8 * n])
        done = n
        keys.append(HostKey(n, digest.copy().digest()))
    return keys
