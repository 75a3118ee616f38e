"""The engine process started before the API server has resolved its flags.

A server's start-up is two Python processes each importing torch, Triton and the model code (seconds each on a
GPU host), one after the other: the API server imports them to resolve its flags, and only then spawns the engine
process, which imports them again. `PrestartedEngine` spawns the engine process first thing, before those imports:
it imports the engine's modules while the API server resolves its flags (with one GPU visible, fla-core's kernels
too, on a thread that goes on while the engine loads its weights), then waits for its engine's arguments
(`take`) and runs `engine_main` with them, or is stopped when the server needs no engine of it (`discard`: a PD
master or node, a refusal to start). With `--dp N` it becomes replica 0.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
from multiprocessing.connection import Connection

logger = logging.getLogger(__name__)

# what the engine process imports before it knows its flags: the engine and the real runner's model code
ENGINE_MODULES = ("lightllm.server.engine_process", "lightllm.server.runner_factory", "lightllm.worker.runner")


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
    try:
        engine_args = conn.recv()
    except EOFError:
        return
    if engine_args is None:
        return
    engine_main(*engine_args, conn)
