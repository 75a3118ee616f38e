"""The uvicorn server of the HTTP front-end (normal and pd_master), with a deadline on request heads.

`HttpServer` is uvicorn's server that also stops once this process recorded a SIGTERM (`termination.py`): one that
came before uvicorn took the signal over, and whose exception was dropped in a finalizer, would otherwise be lost.

uvicorn times out idle keep-alive connections (`--http_keep_alive_s`) but waits forever for a request head that
arrives a byte at a time, or not at all on a fresh connection (slow-loris). `HeadDeadlineProtocol` closes a
connection whose request head is not complete `--http_header_timeout_s` after its first byte (or after the
connection opened); the body has its own deadline in the edge middleware (`edge.py`).
"""

from __future__ import annotations

import asyncio
import socket

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from lightllm.server.args import ServerArgs
from lightllm.server.termination import sigterm_received


class HeadDeadlineProtocol(H11Protocol):
    head_timeout_s = 10.0

    def connection_made(self, transport) -> None:
        self._head_deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # a response goes out as several writes (head, body chunks): with Nagle each waits for the client's
            # delayed ACK, 40 ms on Linux. asyncio sets this only on sockets opened with proto IPPROTO_TCP, and a
            # socket handed to uvicorn (`sockets=`) may have been opened with proto 0
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._arm_head_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:
            # part of a head (or nothing yet): the clock started at its first byte keeps running
            self._arm_head_deadline()
        else:
            self._disarm_head_deadline()

    def connection_lost(self, exc) -> None:
        self._disarm_head_deadline()
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        if self._head_deadline is None:
            self._head_deadline = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _disarm_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.warning(
                "closing a connection from %s: no complete request head within %g s", self.client, self.head_timeout_s
            )
            self.transport.close()


def uvicorn_config(app, args: ServerArgs, **overrides) -> uvicorn.Config:
    """The server's uvicorn config: the listen address, keep-alive and head deadlines from `args`."""
    protocol = type("HeadDeadline", (HeadDeadlineProtocol,), {"head_timeout_s": args.http_header_timeout_s})
    options = dict(
        host=args.host,
        port=args.port,
        log_level="info",
        timeout_graceful_shutdown=10,
        timeout_keep_alive=args.http_keep_alive_s,
        http=protocol,
    )
    return uvicorn.Config(app, **{**options, **overrides})


class HttpServer(uvicorn.Server):
    async def on_tick(self, counter: int) -> bool:
        if sigterm_received():
            self.should_exit = True
        return await super().on_tick(counter)


def http_server(app, args: ServerArgs) -> HttpServer:
    """The server's uvicorn server for `app`, configured by `uvicorn_config`."""
    return HttpServer(uvicorn_config(app, args))
