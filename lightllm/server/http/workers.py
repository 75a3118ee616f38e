"""More than one HTTP front-end process (`--http_workers N`).

One event loop parses requests, detokenizes and streams for every connection, and a step's outputs wake all of
its streams at once: at a few hundred streams it saturates in bursts, and every stream waits behind the burst.
With N processes each binds the port with SO_REUSEPORT (the kernel spreads new connections over them), submits to
the engine's one input socket with its index in each request, and receives its own requests' outputs on its own
socket (the engine routes them). The first process (the CLI's) owns the engine and the others: it starts them beside
the engine (their imports and tokenizer load while the engine loads its weights and warms up), hands each the
engine's addresses once it is up, waits until each listens, and stops the server if one dies. The counters of /metrics and the
admission limit are the server's, summed over the processes' rows (`metric_rows.py`).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_any

from lightllm.server.args import ServerArgs
from lightllm.server.http.engine_client import EngineClient
from lightllm.server.launcher import EngineEndpoint, EngineHandle
from lightllm.server.model_info import ModelInfo
from lightllm.server.prestart import PrestartedHttpProcesses

logger = logging.getLogger("lightllm.server")
# how long a worker may take to listen (imports, the tokenizer)
WORKER_START_TIMEOUT_S = 180


def listen_socket(host: str, port: int, first: bool = False) -> socket.socket:
    """A socket bound to (host, port) that other processes of this user may bind too (SO_REUSEPORT). `first`: the
    server's first process, which refuses a port already bound by anyone (another server started with
    SO_REUSEPORT would otherwise silently take a share of the connections)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    if first:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(address)
    return sock


@dataclass
class WorkerEndpoint(EngineEndpoint):
    """The engine as an HTTP process other than the first sees it: its addresses and its process id."""

    input_addr: str
    output_addr: str
    frontend: int
    engine_pid: int

    def is_alive(self) -> bool:
        try:
            os.kill(self.engine_pid, 0)
        except ProcessLookupError:
            return False
        return True

    def connect(self, args: ServerArgs) -> EngineClient:
        return EngineClient(self.input_addr, self.output_addr, self.frontend)

    def exit_description(self) -> str:
        return f"process {self.engine_pid} is gone"


def worker_main(args: ServerArgs, info: ModelInfo, index: int, rows_path: str, conn) -> None:
    """Entry point of HTTP process `index` (1..N-1): loads what it can before the engine is up, receives the
    engine's `WorkerEndpoint` on `conn` (None: the server is not starting after all), serves until stopped and
    tells the first process on `conn` once it listens."""
    from lightllm.server.collector import freeze_startup_objects
    from lightllm.server.http.app import create_app
    from lightllm.server.http.metric_rows import MetricRows
    from lightllm.server.http.metrics import Metrics
    from lightllm.server.http.server import http_server
    from lightllm.server.termination import die_with_parent, exit_on_sigterm
    from lightllm.server.tokenizer import Tokenizer

    die_with_parent()
    exit_on_sigterm()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s http-{index} %(name)s %(levelname)s %(message)s")
    rows = MetricRows(Metrics.WIDTH, args.http_workers, index, rows_path)
    started = time.monotonic()
    tokenizer = Tokenizer(info)
    logger.info("tokenizer loaded in %.1f s; waiting for the engine", time.monotonic() - started)
    try:
        endpoint = conn.recv()
    except EOFError:
        return
    if endpoint is None:
        return
    server = None

    def on_engine_exit() -> None:
        server.should_exit = True

    # the first process logs the server's throughput; the others would repeat it
    app = create_app(
        dataclasses.replace(args, log_stats_interval=0),
        info,
        tokenizer,
        endpoint,
        on_engine_exit,
        metric_rows=rows,
    )
    server = http_server(app, args)
    sock = listen_socket(args.host, args.port)

    def report_listening() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.02)
        conn.send(server.started)
        conn.close()

    threading.Thread(target=report_listening, daemon=True).start()
    freeze_startup_objects()
    server.run(sockets=[sock])


class Workers:
    """HTTP processes 1..N-1 of a server, started and supervised by the first."""

    def __init__(
        self, args: ServerArgs, info: ModelInfo, rows_path: str, prestarted: PrestartedHttpProcesses | None = None
    ):
        """Starts the processes (taking `prestarted` ones first); each loads the tokenizer, then waits for
        `connect`."""
        ctx = mp.get_context("spawn")
        self.processes: list[mp.Process] = []
        self._pipes = []
        self._stopping = False
        for index in range(1, args.http_workers):
            job = (args, info, index, rows_path)
            taken = prestarted.take(job) if prestarted is not None else None
            if taken is None:
                ours, theirs = ctx.Pipe()
                process = ctx.Process(target=worker_main, args=(*job, theirs), name=f"lightllm-http-{index}")
                process.start()
                theirs.close()
                taken = process, ours
            self.processes.append(taken[0])
            self._pipes.append(taken[1])
        logger.info("started %d more HTTP processes beside the engine", len(self.processes))

    def connect(self, engine: EngineHandle) -> None:
        """Hands each process the engine's addresses and waits until all of them listen; RuntimeError (the
        processes stopped) when one does not within WORKER_START_TIMEOUT_S."""
        for index, pipe in enumerate(self._pipes, start=1):
            endpoint = WorkerEndpoint(
                engine.input_addr, engine.worker_output_addrs[index - 1], index, engine.process.pid
            )
            try:
                pipe.send(endpoint)
            except (BrokenPipeError, EOFError, OSError):
                pass  # the process is gone: reported below with its exit code
        deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        for index, (process, pipe) in enumerate(zip(self.processes, self._pipes), start=1):
            listening = pipe.poll(max(0.0, deadline - time.monotonic())) and _received(pipe)
            if not listening:
                self.stop()
                raise RuntimeError(f"HTTP process {index} did not start (exit code {process.exitcode})")
        self._close_pipes()

    def watch(self, on_exit: Callable[[mp.Process], None]) -> None:
        """Call `on_exit(process)` from a thread once any of the processes has exited (not when `stop` ended
        them)."""

        def wait() -> None:
            ready = wait_any([p.sentinel for p in self.processes])
            if self._stopping:
                return
            for process in self.processes:
                if process.sentinel in ready:
                    process.join(5)
                    on_exit(process)
                    return

        threading.Thread(target=wait, name="lightllm-http-workers", daemon=True).start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        self._close_pipes()
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join(timeout_s)
            if process.is_alive():
                process.kill()
                process.join(timeout_s)

    def _close_pipes(self) -> None:
        for pipe in self._pipes:
            pipe.close()
        self._pipes = []


def _received(recv) -> bool:
    try:
        return bool(recv.recv())
    except EOFError:
        return False
