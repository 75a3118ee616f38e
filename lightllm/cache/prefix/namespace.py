"""Prefix-cache namespaces: which requests may share cached prefixes.

A request's `cache_salt` (vLLM's request field) puts the prefixes it caches and resumes in a namespace of their
own, shared only by requests with the same salt. Without it, a tenant could tell from a request's time to first
token whether another tenant's prompt is cached. Requests without a salt share the default namespace.

A namespace is named by a 256-bit BLAKE2b digest of its salt. The device cache gives each namespace a tree root of
its own, the host tier stores the name beside an entry's token ids and compares both, and the data-parallel
router keys its prefix blocks with it.
"""

from __future__ import annotations

import hashlib

DEFAULT_NAMESPACE = b""
NAMESPACE_BYTES = 32


def salt_namespace(cache_salt: str | None) -> bytes:
    """The namespace of requests sent with `cache_salt` (None: the default one)."""
    if cache_salt is None:
        return DEFAULT_NAMESPACE
    return hashlib.blake2b(cache_salt.encode("utf-8"), digest_size=NAMESPACE_BYTES, person=b"lightllm salt").digest()
