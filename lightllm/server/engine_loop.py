"""The step loop of a process that serves one engine over zmq: the engine process, a prefill node, a decode node.

Each turn it drains the inbox (decoded messages go to the role), lets the role act between steps (`tick`), runs
`Engine.step` when there is work and passes its outputs through the role (`after_step`), and sends everything to
the outbox as one list, with the engine's stats every half second and right after a request finishes (so
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
from lightllm.engine.messages import Abort, EngineOutput, EngineStats, Finished, NewRequest
from lightllm.server.termination import sigterm_received

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


class FrontendRoutes:
    """Which HTTP front-end process each request came from (`NewRequest.frontend`): the engine process sends a
    request's outputs to that process only, and its stats to every one."""

    def __init__(self, count: int):
        self.count = count
        self._of: dict[str, int] = {}

    def note(self, req_id: str, frontend: object) -> None:
        # an index no process has (a peer that is not a front-end of this server) answers to the first one
        self._of[req_id] = frontend if isinstance(frontend, int) and 0 <= frontend < self.count else 0

    def split(self, outputs: list[EngineOutput]) -> list[list[EngineOutput]]:
        """`outputs` per front-end process, in their order; a request's route is dropped with its `Finished`."""
        parts: list[list[EngineOutput]] = [[] for _ in range(self.count)]
        for out in outputs:
            if isinstance(out, EngineStats):
                for part in parts:
                    part.append(out)
                continue
            parts[self._of.get(out.req_id, 0)].append(out)
            if isinstance(out, Finished):
                self._of.pop(out.req_id, None)
        return parts


class ServingRole:
    """The engine process's role: `NewRequest` and `Abort` from the front-end processes, each request's outputs
    back to the process that sent it (`routes`)."""

    def __init__(self, engine: Engine, num_frontends: int = 1):
        self.engine = engine
        self.routes = FrontendRoutes(num_frontends)

    def has_work(self) -> bool:
        return self.engine.has_work()

    def on_message(self, msg) -> list[EngineOutput]:
        if isinstance(msg, NewRequest):
            self.routes.note(msg.req_id, msg.frontend)
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
        self.routes.note(req_id, loose.get("frontend", 0))
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
    decoder: msgspec.msgpack.Decoder,
    *,
    idle_poll_ms: int,
    keep_running: Callable[[], bool],
    send: Callable[[list[EngineOutput]], None],
    log_name: str,
) -> None:
    """Serve until `keep_running()` is False or SIGTERM came. `send` puts a turn's outputs on the outbox (blocking or not: the
    caller decides what an unread outbox means); `log_name` names the log an engine fault points to."""
    engine = role.engine
    last_stats = 0.0
    while keep_running() and not sigterm_received():
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
            send(outputs)
