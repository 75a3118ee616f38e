"""The step loop of a process that serves one engine over zmq: the engine process, a prefill node, a decode node.

Each turn it drains the inbox (decoded messages go to the role), lets the role act between steps (`tick`), runs
`Engine.step` when there is work and passes its outputs through the role (`after_step`), and sends everything to
the outbox as one msgpack list, with the engine's stats every half second and right after a request finishes (so
/metrics sees freed slots promptly). What differs between processes is the role: `ServingRole` here (requests
in, tokens out), the prefill and decode roles of `lightllm.server.pd.roles`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import msgspec
import zmq

from lightllm.engine.engine import Engine
from lightllm.engine.messages import Abort, EngineOutput, Finished, NewRequest

logger = logging.getLogger(__name__)
# how often stats go out while idle or busy, seconds
STATS_INTERVAL_S = 0.5


class EngineRole(Protocol):
    engine: Engine

    def has_work(self) -> bool: ...

    def on_message(self, msg) -> list[EngineOutput]: ...

    def on_undecodable(self, raw: bytes, exc: Exception) -> list[EngineOutput]: ...

    def tick(self) -> list[EngineOutput]:
        """Between steps: what the role does on its own (admissions, timeouts)."""

    def after_step(self, outputs: list[EngineOutput]) -> list[EngineOutput]:
        """The step's outputs as the process sends them (a role may take some and add others)."""


class ServingRole:
    """The engine process's role: `NewRequest` and `Abort` from the front-end, every output back to it."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def has_work(self) -> bool:
        return self.engine.has_work()

    def on_message(self, msg) -> list[EngineOutput]:
        if isinstance(msg, NewRequest):
            return self.engine.add_request(msg)
        if isinstance(msg, Abort):
            return self.engine.abort(msg.req_id)
        return []

    def on_undecodable(self, raw: bytes, exc: Exception) -> list[EngineOutput]:
        """A request the typed decoder refuses still has a waiting front-end: answer it with an error if its id
        can be read, so it does not wait forever."""
        try:
            loose = msgspec.msgpack.decode(raw)
        except msgspec.DecodeError:
            loose = None
        req_id = loose.get("req_id") if isinstance(loose, dict) else None
        if not isinstance(req_id, str) or loose.get("type") != "NewRequest":
            logger.error("dropping an undecodable message: %s", exc)
            return []
        return [Finished(req_id, "error", error=f"the engine could not read this request: {exc}")]

    def tick(self) -> list[EngineOutput]:
        return []

    def after_step(self, outputs: list[EngineOutput]) -> list[EngineOutput]:
        return outputs


def dispatch(role: EngineRole, decoder: msgspec.msgpack.Decoder, raw: bytes) -> list[EngineOutput]:
    """One inbox message to the role; one the typed decoder refuses to `on_undecodable`."""
    try:
        msg = decoder.decode(raw)
    except msgspec.DecodeError as exc:
        return role.on_undecodable(raw, exc)
    return role.on_message(msg)


def run_engine_loop(
    role: EngineRole,
    inbox: zmq.Socket,
    outbox: zmq.Socket,
    decoder: msgspec.msgpack.Decoder,
    *,
    idle_poll_ms: int,
    keep_running: Callable[[], bool],
    send: Callable[[bytes], None],
    log_name: str,
) -> None:
    """Serve until `keep_running()` is False. `send` puts one encoded output list on the outbox (blocking or
    not: the caller decides what an unread outbox means); `log_name` names the log an engine fault points to."""
    engine = role.engine
    encoder = msgspec.msgpack.Encoder()
    last_stats = 0.0
    while keep_running():
        outputs: list[EngineOutput] = []
        timeout = 0 if role.has_work() else idle_poll_ms
        while inbox.poll(timeout):
            timeout = 0
            outputs += dispatch(role, decoder, inbox.recv())
        outputs += role.tick()
        try:
            if engine.has_work():
                outputs += role.after_step(engine.step())
        except Exception:
            # runner failures are handled inside step(); reaching here means an engine bug: fail the requests in
            # flight rather than the process, so the server keeps answering
            logger.exception("unexpected engine fault")
            outputs += role.after_step(engine.fail_all(f"internal engine fault (see the {log_name})"))
        now = time.monotonic()
        if now - last_stats > STATS_INTERVAL_S or any(isinstance(o, Finished) for o in outputs):
            outputs.append(engine.snapshot())
            last_stats = now
        if outputs:
            send(encoder.encode(outputs))
