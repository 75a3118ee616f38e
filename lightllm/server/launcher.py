"""Start and stop the engine process from the HTTP process (or a test)."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from lightllm.server.args import ServerArgs
from lightllm.server.engine_process import engine_main
from lightllm.server.http.engine_client import EngineClient
from lightllm.server.model_info import ModelInfo
from lightllm.server.prestart import PrestartedEngine
from lightllm.server.runner_factory import DEFAULT_RUNNER_FACTORY

STARTUP_TIMEOUT_S = 900


class EngineStartError(RuntimeError):
    pass


class EngineEndpoint:
    """What the HTTP front-end needs of whatever stands where the engine process stands (an engine process, the
    PD master's router): its zmq addresses, liveness, its process's exit, and /health's body."""

    input_addr: str
    output_addr: str
    process: mp.Process

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def connect(self, args: ServerArgs) -> EngineClient:
        """The HTTP process's client of this engine (call on the event loop that will use it)."""
        return EngineClient(self.input_addr, self.output_addr)

    def health(self) -> dict:
        """/health's body while the engine is alive."""
        return {"status": "ok"}

    def accepts_requests(self) -> bool:
        """Whether a new request may be submitted now (else the front-end answers 503)."""
        return self.is_alive()

    def serving_problem(self) -> str | None:
        """Why the engine, though alive, cannot serve now (None: it can); /health answers 503 with it."""
        return None

    def add_routes(self, app) -> None:
        """Routes of this kind of engine beyond the common ones (none)."""

    def register_metrics(self, registry) -> None:
        """Prometheus collectors of this kind of engine beyond the common ones (none)."""

    def exit_description(self) -> str:
        return f"exit code {self.process.exitcode}"


@dataclass
class EngineHandle(EngineEndpoint):
    process: mp.Process
    # front-end → engine and engine → front-end zmq addresses (the latter of the first HTTP process)
    input_addr: str
    output_addr: str
    capacity_report: str
    socket_dir: str
    # engine → front-end addresses of HTTP processes 1..N-1 (`--http_workers`)
    worker_output_addrs: list[str] = field(default_factory=list)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout_s)
        shutil.rmtree(self.socket_dir, ignore_errors=True)


def start_engine(
    args: ServerArgs,
    info: ModelInfo,
    runner_factory: str = DEFAULT_RUNNER_FACTORY,
    prestarted: PrestartedEngine | None = None,
) -> EngineHandle:
    """Spawn the engine process (or take `prestarted`) and wait until its model is loaded; raises
    EngineStartError with the cause."""
    handle, conn = spawn_engine(args, info, runner_factory, prestarted)
    return finish_start(handle, conn, STARTUP_TIMEOUT_S)


def spawn_engine(
    args: ServerArgs, info: ModelInfo, runner_factory: str, prestarted: PrestartedEngine | None = None
) -> tuple[EngineHandle, Connection]:
    """Start the engine process without waiting for it: `prestarted` when it is still waiting for an engine (its
    imports are done or under way), else a freshly spawned one; `finish_start` waits for its start-up report on
    the returned pipe. Call it from a thread that lives as long as the engine: the engine dies with the thread that
    spawned it (`die_with_parent`)."""
    socket_dir = tempfile.mkdtemp(prefix="lightllm-")
    input_addr = f"ipc://{os.path.join(socket_dir, 'in')}"
    output_addrs = [f"ipc://{os.path.join(socket_dir, f'out-{i}')}" for i in range(args.http_workers)]
    engine_args = (args, info, input_addr, output_addrs, runner_factory)
    if prestarted is not None and prestarted.usable():
        process, parent_conn = prestarted.take(engine_args)
    else:
        ctx = mp.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        process = ctx.Process(target=engine_main, args=(*engine_args, child_conn), name="lightllm-engine", daemon=True)
        process.start()
        child_conn.close()
    handle = EngineHandle(process, input_addr, output_addrs[0], "", socket_dir, output_addrs[1:])
    return handle, parent_conn


def finish_start(handle: EngineHandle, conn: Connection, timeout_s: float) -> EngineHandle:
    """Wait up to `timeout_s` for a spawned engine's start-up report; stops it and raises EngineStartError when it
    failed, exited or did not report in time."""
    try:
        if not conn.poll(timeout_s):
            raise EngineStartError(f"the engine did not start within {timeout_s:g} s")
        status = conn.recv()
    except EOFError:
        handle.stop()
        raise EngineStartError(
            f"the engine process exited during start-up (exit code {handle.process.exitcode})"
        ) from None
    except EngineStartError:
        handle.stop()
        raise
    finally:
        conn.close()
    if not status["ok"]:
        handle.stop()
        raise EngineStartError(f"{status['error']}\n{status['traceback']}")
    handle.capacity_report = status["report"]
    return handle
