"""The engine process, and the other HTTP processes, started before the API server has resolved its flags.

A server's start-up is two Python processes each importing torch, Triton and the model code (seconds each on a
GPU host), one after the other: the API server imports them to resolve its flags, and only then spawns the engine
process, which imports them again. `PrestartedEngine` spawns the engine process first thing, before those imports:
it imports the engine's modules while the API server resolves its flags (with one GPU visible, fla-core's kernels
too, on a thread that goes on while the engine loads its weights), then waits for its engine's arguments
(`take`) and runs `engine_main` with them, or is stopped when the server needs no engine of it (`discard`: a PD
master or node, a refusal to start). With `--dp N` it becomes replica 0.

`PrestartedHttpProcesses` does the same for the HTTP front-end processes beyond the first (`--http_workers`): on
a host where the default would start them, they import the front-end (torch and transformers among it) from the
first moment; each then becomes HTTP process `index` once given its flags (`http/workers.py`).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
from multiprocessing.connection import Connection

logger = logging.getLogger(__name__)

# what the engine process imports before it knows its flags: the engine and the real runner's model code
ENGINE_MODULES = ("lightllm.server.engine_process", "lightllm.server.runner_factory", "lightllm.worker.runner")
# what an HTTP process imports before it knows its flags: the front-end and its tokenizer library
HTTP_MODULES = ("lightllm.server.http.workers", "lightllm.server.http.app", "lightllm.server.tokenizer")
# front-end processes a GPU server starts by default: one event loop parsing, detokenizing and streaming for a
# few hundred concurrent requests falls behind the engine's steps (its stalls delay every stream at once)
MAX_AUTO_HTTP_WORKERS = 4


def http_processes_for_host() -> int:
    """The HTTP processes a GPU server (`--run_mode normal`, `--dp 1`) starts by default on this host: one per four
    usable CPU cores, up to MAX_AUTO_HTTP_WORKERS."""
    return max(1, min(MAX_AUTO_HTTP_WORKERS, len(os.sched_getaffinity(0)) // 4))


class PrestartedEngine:
    """A spawned process that becomes an engine process once it is given one engine's arguments."""

    def __init__(self, modules: tuple[str, ...] = ENGINE_MODULES, import_fla: bool = True):
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=wait_for_engine, args=(child_conn, modules, import_fla), name="lightllm-engine", daemon=True
        )
        self.process.start()
        child_conn.close()
        self.taken = False

    def usable(self) -> bool:
        """Whether `take` may still be called: not taken or discarded, and the process still waiting."""
        return not self.taken and self.process.is_alive()

    def take(self, engine_args: tuple) -> tuple[mp.Process, Connection]:
        """Run `engine_main(*engine_args, conn)` in the process; returns it and the parent's end of the pipe on
        which `engine_main` reports its start-up (as a freshly spawned engine process does)."""
        if not self.usable():
            raise RuntimeError("the prestarted engine process was taken, discarded or has exited")
        self.taken = True
        self.conn.send(engine_args)
        return self.process, self.conn

    def discard(self) -> None:
        """Stop the process unless it became an engine (idempotent). It holds nothing but its imports, so it is
        killed rather than waited for (`--help` or a refusal must not wait for torch's import)."""
        if self.taken:
            return
        self.taken = True
        self.process.kill()
        self.process.join()
        self.conn.close()


def wait_for_engine(conn: Connection, modules: tuple[str, ...], import_fla: bool) -> None:
    """The prestarted process: import `modules` (and start fla's import when `import_fla` and one GPU is visible),
    then run the engine it is given (or exit on None or when the server is gone)."""
    import importlib
    import signal

    from lightllm.server.termination import die_with_parent

    # Ctrl-C reaches the whole process group: the server stops this process (`discard`, or as an engine); and no
    # orphan outlives a server killed while this one imports
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    from lightllm.server.engine_process import engine_main

    for name in modules:
        importlib.import_module(name)
    if import_fla:
        import torch

        from lightllm.linear_att.fla_import import import_in_background
        from lightllm.linear_att.fla_pinning import FLA_ENTRY_MODULES

        # fla's import asks device 0 about itself: only where device 0 is the one device the engine can have
        if torch.cuda.device_count() == 1:
            import_in_background(FLA_ENTRY_MODULES)
        # every Triton kernel's cache key includes a hash of Triton itself, its ~400 MB library read and hashed at
        # a process's first launch (seconds on a cold disk): hashed here instead, while the flags are resolved
        threading.Thread(target=_hash_triton, name="lightllm-triton-key", daemon=True).start()
    _run_when_given(conn, engine_main)


def _hash_triton() -> None:
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        return  # another Triton layout: hashed at the first launch instead
    triton_key()


class PrestartedHttpProcesses:
    """Spawned processes that each become an HTTP process (1..N-1) once given its flags; the ones not taken are
    stopped by `discard`."""

    def __init__(self, count: int):
        ctx = mp.get_context("spawn")
        self._waiting: list[tuple[mp.Process, Connection]] = []
        for _ in range(count):
            conn, child_conn = ctx.Pipe()
            process = ctx.Process(target=wait_for_http, args=(child_conn, HTTP_MODULES), daemon=False)
            process.start()
            child_conn.close()
            self._waiting.append((process, conn))

    @classmethod
    def for_host(cls) -> PrestartedHttpProcesses:
        """As many as the default would start beside the first on this host, where it has a GPU (a guess before
        the flags are known: a process not needed is only stopped)."""
        on_gpu_host = os.path.exists("/dev/nvidiactl")
        return cls(http_processes_for_host() - 1 if on_gpu_host else 0)

    def take(self, job: tuple) -> tuple[mp.Process, Connection] | None:
        """A waiting process, given `worker_main`'s arguments but its pipe (`job`), with the parent's end of that
        pipe; None when none is left."""
        while self._waiting:
            process, conn = self._waiting.pop(0)
            try:
                conn.send(job)
            except (BrokenPipeError, OSError):
                conn.close()
                process.join(1)
                continue
            process.name = f"lightllm-http-{job[2]}"
            return process, conn
        return None

    def discard(self) -> None:
        """Stop the processes not taken (idempotent); they hold nothing but their imports."""
        for process, conn in self._waiting:
            process.kill()
            process.join()
            conn.close()
        self._waiting = []


def wait_for_http(conn: Connection, modules: tuple[str, ...]) -> None:
    """A prestarted HTTP process: import `modules` and the tokenizer library, then run `worker_main` with the
    arguments it is given (or exit on None or when the server is gone)."""
    import importlib
    import signal

    from lightllm.server.termination import die_with_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    for name in modules:
        importlib.import_module(name)
    from lightllm.server.http.workers import worker_main
    from lightllm.server.tokenizer import import_tokenizer_library

    import_tokenizer_library()
    _run_when_given(conn, worker_main)


def _run_when_given(conn: Connection, main) -> None:
    """`main(*arguments, conn)` with the arguments the server sends on `conn`; nothing when it sends None or is
    gone."""
    try:
        arguments = conn.recv()
    except EOFError:
        return
    if arguments is not None:
        main(*arguments, conn)
