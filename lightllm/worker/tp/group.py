"""The ranks of a tensor-parallel engine: rank 0 lives in the engine process, ranks 1..N-1 are follower processes.

Rank 0 starts the followers (`python -m lightllm.server.tp_follower`), forms the torch.distributed group with
them (NCCL on CUDA, gloo on CPU; 127.0.0.1) and a gloo side group for the control plane: every call that changes
device state is broadcast as a `Plan` before rank 0 runs it itself, and the followers run the same call (see
`lockstep`). A watchdog thread notices a follower that exits and calls `on_rank_exit` (default: end this process,
which the HTTP front-end reports as an unhealthy engine and turns into failed requests); a collective never waits
on a dead rank for long.

One group outlives the runners built on it (`lightllm.server.runner_factory.create_tp_runner`, then
`LockstepRunner.close`), so tests can run many engines on one set of processes.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch

logger = logging.getLogger(__name__)
# a collective that waits longer than this on a peer fails (the watchdog normally acts first)
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
WATCH_INTERVAL_S = 0.2


@dataclass(frozen=True)
class Plan:
    """One control-plane message: a runner method with its arguments, or `build` / `close` / `exit`."""

    method: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class RankSetup:
    """What a follower needs to join: written pickled to its stdin."""

    rank: int
    size: int
    init_method: str
    backend: str
    # CPU ranks: intra-op threads (the machine's cores are shared by all ranks)
    num_threads: int | None = None
    # rank 0's process id: a follower whose parent is already gone when it starts must not wait for it
    parent_pid: int = 0
    # CUDA device of rank 0 (a data-parallel replica's first device); rank r runs on base_device + r
    base_device: int = 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_group(setup: RankSetup) -> object:
    """Join the default process group; returns the gloo control group."""
    import torch.distributed as dist

    # the parent-death signal a follower sets at start is not sent for a parent that died before it was set
    if setup.parent_pid and os.getppid() != setup.parent_pid:
        raise RuntimeError(f"tensor-parallel rank 0 (pid {setup.parent_pid}) exited before rank {setup.rank} started")
    if setup.num_threads:
        torch.set_num_threads(setup.num_threads)
    if setup.backend == "nccl":
        torch.cuda.set_device(setup.base_device + setup.rank)
    dist.init_process_group(
        setup.backend,
        init_method=setup.init_method,
        rank=setup.rank,
        world_size=setup.size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    # a separate gloo group: plans are host objects, and on CUDA they must not queue behind the model's NCCL work
    return dist.new_group(backend="gloo")


def broadcast_plan(plan: Plan | None, control: object) -> Plan:
    """Rank 0 sends `plan`; every other rank receives it (pass None)."""
    import torch.distributed as dist

    box = [plan]
    dist.broadcast_object_list(box, src=0, group=control)
    return box[0]


def gather_to_rank0(value, control: object) -> list | None:
    """Every rank's `value` on rank 0 (in rank order); None elsewhere."""
    import torch.distributed as dist

    rank = dist.get_rank()
    out = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(value, out, dst=0, group=control)
    return out


class TPGroup:
    """Rank 0's handle on the tensor-parallel processes."""

    def __init__(
        self,
        size: int,
        device: str,
        num_threads: int | None = None,
        on_rank_exit: Callable[[int, int | None], None] | None = None,
        base_device: int = 0,
    ):
        if size < 2:
            raise ValueError(f"a tensor-parallel group needs at least 2 ranks, got {size}")
        if device == "cuda" and torch.cuda.device_count() < base_device + size:
            raise ValueError(
                f"--tp {size} from CUDA device {base_device} needs devices {base_device}..{base_device + size - 1}, "
                f"{torch.cuda.device_count()} visible"
            )
        if torch.distributed.is_initialized():
            raise RuntimeError(
                "this process already holds a torch.distributed process group (another tensor-parallel engine): "
                "close that one first (LLM.close(), or `with LLM(...)`)"
            )
        self.size = size
        self.device = device
        self.on_rank_exit = on_rank_exit or _exit_process
        backend = "nccl" if device == "cuda" else "gloo"
        init = f"tcp://127.0.0.1:{free_port()}"
        self.followers: list[subprocess.Popen] = []
        for rank in range(1, size):
            proc = subprocess.Popen([sys.executable, "-m", "lightllm.server.tp_follower"], stdin=subprocess.PIPE)
            setup = RankSetup(rank, size, init, backend, num_threads, os.getpid(), base_device)
            proc.stdin.write(pickle.dumps(setup))
            proc.stdin.close()
            self.followers.append(proc)
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._watcher.start()
        try:
            self.control = join_group(RankSetup(0, size, init, backend, num_threads, base_device=base_device))
        except BaseException:
            # the followers would wait for rank 0 until the collective timeout
            self._stopping.set()
            self._kill_followers()
            raise

    def send(self, plan: Plan) -> None:
        broadcast_plan(plan, self.control)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the followers and leave the process group."""
        import torch.distributed as dist

        if self._stopping.is_set():
            return
        self._stopping.set()
        try:
            self.send(Plan("exit"))
        except Exception:
            logger.exception("could not tell the tensor-parallel followers to exit")
        for proc in self.followers:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._watcher is not threading.current_thread():
            self._watcher.join()
        if dist.is_initialized():
            dist.destroy_process_group()

    def abandon(self) -> None:
        """End the group after rank 0 failed in the middle of a call the followers are still in (building a
        runner): they cannot hear an exit plan inside another collective, so they are killed."""
        import torch.distributed as dist

        self._stopping.set()
        self._kill_followers()
        if self._watcher is not threading.current_thread():
            self._watcher.join()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _kill_followers(self) -> None:
        for proc in self.followers:
            proc.kill()
            proc.wait()

    def _watch(self) -> None:
        while not self._stopping.wait(WATCH_INTERVAL_S):
            for rank, proc in enumerate(self.followers, start=1):
                code = proc.poll()
                if code is not None and not self._stopping.is_set():
                    self._stopping.set()
                    self.on_rank_exit(rank, code)
                    return


def _exit_process(rank: int, code: int | None) -> None:
    logger.error("tensor-parallel rank %d exited (code %s): stopping the engine", rank, code)
    logging.shutdown()
    os._exit(1)
