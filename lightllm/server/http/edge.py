"""The HTTP edge, as one ASGI middleware around the app: API-key check, request body cap, a deadline on reading
the body (408), a bound on the body's JSON structure checked before anything parses it (parsing runs on the event
loop: a body of millions of tiny values would stall every client for seconds), the callbacks a request leaves to
run when its response is over (`ON_FINISH`), and a last-resort handler that turns any unexpected exception into a
well-formed response.

It is plain ASGI rather than an exception handler on purpose: Starlette re-raises exceptions after running a
handler for `Exception`, and uvicorn then closes the keep-alive connection, so the client's next request on it
would be reset.
"""

from __future__ import annotations

import asyncio
import contextvars
import hmac
import json
import logging

logger = logging.getLogger(__name__)

# paths that need the API key when one is set (vLLM guards /v1; tokenizing endpoints expose the model too, the
# schema pages the API, /pd/nodes the PD nodes' addresses and processes, /dp/replicas the replicas' load)
PROTECTED_PREFIXES = (
    "/v1/",
    "/tokenize",
    "/detokenize",
    "/openapi.json",
    "/docs",
    "/redoc",
    "/pd/nodes",
    "/dp/replicas",
)
# scope key: callables run once the app is done with the request (its response sent, streamed or failed)
ON_FINISH = "lightllm.on_finish"
# the ASGI scope of the request this task serves (the handlers run in the middleware's task)
REQUEST_SCOPE: contextvars.ContextVar[dict | None] = contextvars.ContextVar("lightllm_request_scope", default=None)


def json_items(body: bytes) -> int:
    """An upper bound of the values a JSON body holds, counted without parsing it (C-speed byte scans): every
    value after the first follows a comma, every array or object opens with a bracket or brace. Additive over
    the chunks of a body (plus one), so it is counted as the chunks arrive."""
    return body.count(b",") + body.count(b"[") + body.count(b"{") + 1


def _error(status: int, message: str, kind: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()


async def _send_json(send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = ()) -> None:
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class EdgeMiddleware:
    def __init__(
        self,
        app,
        *,
        max_body_bytes: int,
        api_key: str | None,
        max_json_items: int = 1 << 62,
        body_timeout_s: float = 30.0,
    ):
        self.app = app
        self.max_body_bytes, self.max_json_items = max_body_bytes, max_json_items
        self.api_key = api_key
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.api_key is not None and scope["path"].startswith(PROTECTED_PREFIXES) and not self._authorized(scope):
            body = _error(
                401, "invalid or missing API key: send the header 'Authorization: Bearer <key>'", "authentication_error"
            )
            await _send_json(send, 401, body, [(b"www-authenticate", b"Bearer")])
            return
        try:
            async with asyncio.timeout(self.body_timeout_s):
                body = await self._read_body(scope, receive, send)
        except TimeoutError:
            message = f"the request body did not arrive within {self.body_timeout_s:g} s (--http_body_timeout_s)"
            await _send_json(send, 408, _error(408, message, "invalid_request_error"), [(b"connection", b"close")])
            return
        if body is None:
            return
        token = REQUEST_SCOPE.set(scope)
        try:
            await self._run(scope, self._replay(body, receive), send)
        finally:
            REQUEST_SCOPE.reset(token)
            for finish in scope.get(ON_FINISH, ()):
                finish()

    def _authorized(self, scope) -> bool:
        headers = dict(scope["headers"])
        scheme, _, token = headers.get(b"authorization", b"").strip().partition(b" ")
        # the auth scheme is case-insensitive (RFC 9110 11.1); the key is not
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key.encode())

    async def _read_body(self, scope, receive, send) -> bytes | None:
        """The whole body, or None after answering 413 (too many bytes or JSON values; or when the client left
        while sending it)."""
        declared = dict(scope["headers"]).get(b"content-length")
        too_large = _error(
            413,
            f"the request body exceeds {self.max_body_bytes} bytes (--max_request_body_bytes)",
            "invalid_request_error",
        )
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await _send_json(send, 413, too_large)
            return None
        chunks, size, items = [], 0, 1
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await _send_json(send, 413, too_large)
                return None
            items += json_items(chunk) - 1
            if items > self.max_json_items:
                message = (
                    f"the request body holds over {self.max_json_items} JSON values, the most accepted "
                    "(--max_request_json_items)"
                )
                await _send_json(send, 413, _error(413, message, "invalid_request_error"))
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    @staticmethod
    def _replay(body: bytes, receive):
        sent = False

        async def replayed():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            # later receives wait for the disconnect, as the app's disconnect watcher expects
            return await receive()

        return replayed

    async def _run(self, scope, receive, send) -> None:
        state = {"started": False, "complete": False}

        async def tracked(message):
            if message["type"] == "http.response.start":
                state["started"] = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["complete"] = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception:
            logger.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if not state["started"]:
                await _send_json(send, 500, _error(500, "internal server error", "server_error"))
            elif not state["complete"]:
                # the status line is out: end the body cleanly so the connection stays usable
                await send({"type": "http.response.body", "body": b"", "more_body": False})
