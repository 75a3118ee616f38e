"""The uvicorn server of the HTTP front-end (normal and pd_master): httptools' parser, with a deadline on request
heads and a bound on their size.

uvicorn times out idle keep-alive connections (`--http_keep_alive_s`) but waits forever for a request head that
arrives a byte at a time, or not at all on a fresh connection (slow-loris), and its httptools protocol takes a head
of any size. `HeadDeadlineProtocol` closes a connection whose request head is not complete
`--http_header_timeout_s` after its first byte (or after the connection opened), and answers 431 to a head over
`MAX_HEAD_BYTES`; the body has its own deadline and bound in the edge middleware (`edge.py`). httptools rather than
h11: a streamed event is one formatted write instead of a pass through h11's state machine, about an eighth of the
front-end's CPU per streamed token.

`HttpServer` is uvicorn's server that also stops once this process recorded a SIGTERM (`termination.py`): one that
came before uvicorn took the signal over, and whose exception was dropped in a finalizer, would otherwise be lost.
"""

from __future__ import annotations

import asyncio
import socket

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from lightllm.server.args import ServerArgs
from lightllm.server.termination import sigterm_received

# the most bytes a request head may take (its target and headers, as parsed; or received while it is incomplete)
MAX_HEAD_BYTES = 64 * 1024
_HEAD_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: %d\r\nconnection: close\r\n\r\n%s"
)


class _HeadTooLarge(Exception):
    pass


class HeadDeadlineProtocol(HttpToolsProtocol):
    head_timeout_s = 10.0

    def connection_made(self, transport) -> None:
        self._head_deadline: asyncio.TimerHandle | None = None
        # bytes received while a request head is incomplete (None: none is), and the parsed size of the current
        # head: a head that arrives whole in one read is only seen parsed, a huge header still arriving only raw
        self._pending_bytes: int | None = 0
        self._head_size = 0
        self._head_too_large = False
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
        if self._pending_bytes is None or self.transport.is_closing():
            self._disarm_head_deadline()
            return
        # part of a head (or nothing yet): the clock started at its first byte keeps running
        self._pending_bytes += len(data)
        if self._pending_bytes > MAX_HEAD_BYTES:
            self._head_too_large = True
            self.send_400_response("")
        else:
            self._arm_head_deadline()

    def on_message_begin(self) -> None:
        self._pending_bytes, self._head_size = 0, 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._pending_bytes = None
        self._disarm_head_deadline()
        super().on_headers_complete()

    def _count_head(self, size: int) -> None:
        self._head_size += size
        if self._head_size > MAX_HEAD_BYTES:
            self._head_too_large = True
            # stops the parser; uvicorn answers its error with `send_400_response`
            raise _HeadTooLarge()

    def send_400_response(self, msg: str) -> None:
        if not self._head_too_large:
            super().send_400_response(msg)
            return
        self._disarm_head_deadline()
        self.logger.warning("closing a connection from %s: a request head over %d bytes", self.client, MAX_HEAD_BYTES)
        if self.cycle is None or self.cycle.response_complete:
            body = b"request head larger than %d bytes" % MAX_HEAD_BYTES
            self.transport.write(_HEAD_TOO_LARGE % (len(body), body))
        self.transport.close()

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
        if self._pending_bytes is not None and not self.transport.is_closing():
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
