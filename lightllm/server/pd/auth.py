"""Authentication of the PD control plane: registrations (HTTP) and every zmq frame between master and nodes.

Master and nodes share a secret (`--pd_secret`; the API key when none is given). Each frame is
`version | timestamp | nonce | HMAC-SHA256 tag | payload`, the tag covering the header, the channel (the address
the frame is sent to, so a frame captured on one socket is refused on another) and the payload. A receiver refuses
a frame whose tag does not match (constant-time compare), whose timestamp is more than `max_skew_s` from its clock,
or whose nonce it has seen within that window (replay). Registrations carry the same seal of their JSON body in
the `x-lightllm-pd-seal` header, on the channel `REGISTER_CHANNEL`.

Without a secret the frames are sealed with an empty key: they are still framed and checked for replay, but anyone
who can reach the sockets can forge them (`docs/security.md`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import struct
import threading
import time
from collections import deque
from collections.abc import Callable

import msgspec

VERSION = b"\x01"
# version (1) + timestamp (float64, 8) + nonce (16)
_HEAD = struct.Struct(">cd16s")
TAG_BYTES = 32
SEAL_HEADER = "x-lightllm-pd-seal"
REGISTER_CHANNEL = "pd-register"
# how far a frame's timestamp may be from the receiver's clock (hosts must keep their clocks within this)
MAX_SKEW_S = 60.0


class Unauthenticated(msgspec.DecodeError):
    """A frame that is not sealed with the deployment's secret, is stale, or replays one already taken. A
    `msgspec.DecodeError` so the engine loop's inbox drops it as it drops any unreadable message."""


class PdAuth:
    """Seals and opens frames with one secret; `open` keeps the nonces it has taken (thread-safe)."""

    def __init__(self, secret: str | None, max_skew_s: float = MAX_SKEW_S, clock: Callable[[], float] = time.time):
        self.authenticated = bool(secret)
        # a key derived for this use only: the API key, when it is the secret, never keys a MAC directly
        self._key = hashlib.sha256(b"lightllm-pd-control-plane\0" + (secret or "").encode()).digest()
        self.max_skew_s, self._clock = max_skew_s, clock
        self._lock = threading.Lock()
        self._seen: set[bytes] = set()
        self._expiry: deque[tuple[float, bytes]] = deque()

    def _tag(self, head: bytes, channel: str, payload: bytes | memoryview) -> bytes:
        mac = hmac.new(self._key, head, hashlib.sha256)
        mac.update(channel.encode() + b"\0")
        mac.update(payload)
        return mac.digest()

    def seal(self, channel: str, payload: bytes) -> bytes:
        head = _HEAD.pack(VERSION, self._clock(), os.urandom(16))
        return head + self._tag(head, channel, payload) + payload

    def open(self, channel: str, frame: bytes) -> bytes:
        """The payload of a frame sealed for `channel`; Unauthenticated when it is forged, stale or replayed."""
        start = _HEAD.size + TAG_BYTES
        if len(frame) < start:
            raise Unauthenticated(f"a frame of {len(frame)} bytes is shorter than the {start}-byte seal")
        view = memoryview(frame)
        head, tag = bytes(view[: _HEAD.size]), bytes(view[_HEAD.size : start])
        version, sent_at, nonce = _HEAD.unpack(head)
        if version != VERSION:
            raise Unauthenticated(f"unknown seal version {version!r}")
        if not hmac.compare_digest(tag, self._tag(head, channel, view[start:])):
            raise Unauthenticated(
                f"the seal does not match (wrong secret, or a frame for another channel than {channel})"
            )
        now = self._clock()
        if not abs(now - sent_at) <= self.max_skew_s:
            raise Unauthenticated(f"a stale frame: sent {now - sent_at:.1f} s ago (accepted: {self.max_skew_s:g} s)")
        with self._lock:
            while self._expiry and self._expiry[0][0] < now:
                self._seen.discard(self._expiry.popleft()[1])
            if nonce in self._seen:
                raise Unauthenticated("a replayed frame (its nonce was already taken)")
            self._seen.add(nonce)
            self._expiry.append((now + 2 * self.max_skew_s, nonce))
        return bytes(view[start:])


class SealedDecoder:
    """A msgpack decoder of sealed frames: what the node's engine loop decodes its inbox with."""

    def __init__(self, auth: PdAuth, channel: str, decoder: msgspec.msgpack.Decoder):
        self.auth, self.channel, self.decoder = auth, channel, decoder

    def decode(self, frame: bytes):
        return self.decoder.decode(self.auth.open(self.channel, frame))


# tcp://host:port with an IPv4 address, a bracketed IPv6 address or a DNS name
_ENDPOINT = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252}))(?::(\d{1,5}))$")
_WILDCARDS = ("0.0.0.0", "[::]", "*")


def endpoint_problem(addr: object) -> str | None:
    """None for an endpoint the master and other nodes can connect to (tcp://host:port), else why not."""
    if not isinstance(addr, str):
        return f"an endpoint must be a string, got {type(addr).__name__}"
    match = _ENDPOINT.fullmatch(addr)
    if match is None:
        return f"{addr[:100]!r} is not a tcp://host:port endpoint"
    host, port = match.group(1), int(match.group(2))
    if host in _WILDCARDS:
        return f"{addr!r} is a wildcard address: advertise an address others can connect to"
    if not 1 <= port <= 65535:
        return f"{addr!r}: the port must be in 1..65535"
    return None
