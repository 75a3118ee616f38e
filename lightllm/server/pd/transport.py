"""How a prefilled request's messages reach the other node: one small interface, one implementation.

`ZmqHostTransport` sends each message (a `PdTransfer` or `TransferAck`) as msgpack, sealed for its destination
(`auth.py`), over a zmq PUSH socket to the node inbox at its address. A host-staged transfer carries the state's bytes in its `RequestState` blobs: two
device-host copies and the network, on any hosts. With CUDA IPC (`cuda_ipc.py`) the same message carries only
the blobs' shapes, dtypes and offsets and the prefill node's device region; the bytes go device to device.
"""

from __future__ import annotations

from typing import Protocol

import msgspec
import zmq

from lightllm.server.pd.auth import PdAuth


class TransportError(RuntimeError):
    pass


class StateTransport(Protocol):
    def send(self, addr: str, msg: msgspec.Struct) -> None:
        """Queue `msg` (a `PdTransfer` or `TransferAck`) for the node inbox at `addr`; raise TransportError when
        it cannot be queued (the peer is unreachable)."""

    def close(self) -> None: ...


class ZmqHostTransport:
    """Host-staged transfers over zmq PUSH sockets, one per destination inbox (connected on first use)."""

    def __init__(self, ctx: zmq.Context, auth: PdAuth):
        self._ctx, self._auth = ctx, auth
        self._sockets: dict[str, zmq.Socket] = {}
        self._encoder = msgspec.msgpack.Encoder()

    def send(self, addr: str, msg: msgspec.Struct) -> None:
        sock = self._sockets.get(addr)
        if sock is None:
            sock = self._sockets[addr] = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 64)
            sock.connect(addr)
        try:
            sock.send(self._auth.seal(addr, self._encoder.encode(msg)), flags=zmq.NOBLOCK)
        except zmq.Again:
            raise TransportError(f"{addr} does not accept the transfer (unreachable or not reading)") from None

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._sockets.clear()
