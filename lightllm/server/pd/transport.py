"""How a prefilled request's state reaches its decode node: one small interface, one implementation here.

`ZmqHostTransport` stages the state in host memory (`RequestState`'s byte blobs) and sends it, with the request,
as one msgpack message over TCP to the decode node's inbox; acknowledgements come back the same way. It works on
any host and across hosts and costs two device-host copies and the network.

A GPU transport (NIXL RDMA, or CUDA IPC between processes of one host) moves the tensors device to device:
`GpuStateTransport` names what it needs. The `PdTransfer` would still go over zmq, its `RequestState` blobs
holding shapes and dtypes only, plus a descriptor of the sender's registered device buffers; the decode node
would reserve its slot and KV, pull into them, then confirm. None is implemented: `--run_mode prefill` always
uses `ZmqHostTransport`.
"""

from __future__ import annotations

from typing import Protocol

import msgspec
import torch
import zmq


class TransportError(RuntimeError):
    pass


class StateTransport(Protocol):
    def send(self, addr: str, msg: msgspec.Struct) -> None:
        """Queue `msg` (a `PdTransfer` or `TransferAck`) for the node inbox at `addr`; raise TransportError when
        it cannot be queued (the peer is unreachable)."""

    def close(self) -> None: ...


class GpuStateTransport(Protocol):
    """Device-to-device state movement (NIXL, CUDA IPC). An interface only: no implementation exists yet."""

    def expose(self, tensors: list[torch.Tensor]) -> bytes:
        """Prefill side: make an exported request's device tensors readable by a peer until `release`; returns an
        opaque descriptor to send along with the `PdTransfer`."""

    def pull(self, descriptor: bytes, into: list[torch.Tensor]) -> None:
        """Decode side: copy the peer tensors named by `descriptor` into local device tensors (same shapes and
        dtypes, in order); returns when the data is in place."""

    def release(self, descriptor: bytes) -> None:
        """Prefill side: the decode node confirmed; the exposed tensors may be reused."""


class ZmqHostTransport:
    """Host-staged transfers over zmq PUSH sockets, one per destination inbox (connected on first use)."""

    def __init__(self, ctx: zmq.Context):
        self._ctx = ctx
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
            sock.send(self._encoder.encode(msg), flags=zmq.NOBLOCK)
        except zmq.Again:
            raise TransportError(f"{addr} does not accept the transfer (unreachable or not reading)") from None

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._sockets.clear()
