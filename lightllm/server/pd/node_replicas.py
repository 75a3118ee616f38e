"""`--dp N` on a prefill or decode node: N node processes started from one command, each registered with the
pd_master as a node of its own (its own inbox, outbox, engine and node id), so the master routes over them as it
routes over any nodes and needs no notion of replicas.

This process supervises them: one whose process dies is started again under the data-parallel restart policy
(`--dp_restart_attempts`, `--dp_restart_backoff_s`); its requests fail in the master as for any lost node. On CUDA
each replica runs on its own devices, or all share the one visible device (`server.dp.placement`). SIGTERM stops
every replica.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import signal
import sys
import time

from lightllm.server.args import ServerArgs
from lightllm.server.dp.replicas import replica_args, replica_placement
from lightllm.server.dp.restart import RestartPolicy, Strikes
from lightllm.server.model_info import ModelInfo
from lightllm.server.runner_factory import DEFAULT_RUNNER_FACTORY
from lightllm.server.termination import exit_on_sigterm

logger = logging.getLogger(__name__)
# seconds between looks at the replicas' processes
CHECK_INTERVAL_S = 0.5
# a replica's exit code when the master refused it: every replica would be refused alike, so all stop
REFUSED_EXIT_CODE = 2


def _replica_main(args: ServerArgs, info: ModelInfo, runner_factory: str, replica: int) -> None:
    """Entry point of one replica's process: an ordinary node that dies with its supervisor."""
    from lightllm.server.pd.node import RegistrationRefused, serve_node
    from lightllm.server.termination import die_with_parent

    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_on_sigterm()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.run_mode}[{replica}] %(levelname)s %(message)s")
    try:
        sys.exit(serve_node(args, info, runner_factory))
    except RegistrationRefused as exc:
        print(f"lightllm: refusing to start: {exc}", file=sys.stderr)
        sys.exit(REFUSED_EXIT_CODE)


class NodeReplicas:
    def __init__(
        self,
        args: ServerArgs,
        info: ModelInfo,
        runner_factory: str = DEFAULT_RUNNER_FACTORY,
        num_cuda_devices: int | None = None,
    ):
        """`num_cuda_devices`: the CUDA devices to place the replicas on (default: those this process sees)."""
        self.args, self.info, self.runner_factory = args, info, runner_factory
        placement = replica_placement(args, num_cuda_devices)
        # each replica's flags: an ordinary node (--dp 1) on its own device(s)
        self.replica_args = [dataclasses.replace(replica_args(args, i, placement), dp=1) for i in range(args.dp)]
        self.strikes = Strikes(args.dp, RestartPolicy(args.dp_restart_attempts, args.dp_restart_backoff_s))
        self.procs: list[mp.Process | None] = [None] * args.dp
        # replica -> when to start it again (monotonic)
        self.due: dict[int, float] = {}

    def start(self, replica: int) -> None:
        process = mp.get_context("spawn").Process(
            target=_replica_main,
            args=(self.replica_args[replica], self.info, self.runner_factory, replica),
            name=f"lightllm-{self.args.run_mode}-{replica}",
            daemon=True,
        )
        process.start()
        self.procs[replica] = process
        self.strikes.started(replica)
        logger.info("%s node replica %d started (pid %d)", self.args.run_mode, replica, process.pid)

    def check(self) -> int | None:
        """Restart what died and is due; an exit code once the replicas are done (refused, or all down)."""
        now = time.monotonic()
        for i, process in enumerate(self.procs):
            if process is None or process.is_alive():
                continue
            self.procs[i] = None
            if process.exitcode == REFUSED_EXIT_CODE:
                logger.error("the pd_master refused %s node replica %d: stopping every replica", self.args.run_mode, i)
                return REFUSED_EXIT_CODE
            self._schedule(i, self.strikes.died(i), now, f"exited (exit code {process.exitcode})")
        for i, when in list(self.due.items()):
            if now >= when:
                del self.due[i]
                try:
                    self.start(i)
                # the process could not even be spawned (no memory, process or file limits): a failed start
                except OSError as exc:
                    self._schedule(i, self.strikes.failed_start(i), now, f"could not be started ({exc})")
        if not self.due and all(p is None for p in self.procs):
            logger.error("every %s node replica is down", self.args.run_mode)
            return 1
        return None

    def _schedule(self, replica: int, delay: float | None, now: float, what: str) -> None:
        """Log what happened to `replica` and start it again after `delay` (None: it stays down)."""
        logger.error(
            "%s node replica %d %s; %s",
            self.args.run_mode,
            replica,
            what,
            "it stays down" if delay is None else f"restarting it in {delay:.1f} s",
        )
        if delay is not None:
            self.due[replica] = now + delay

    def stop(self, timeout_s: float = 20.0) -> None:
        for process in self.procs:
            if process is not None and process.is_alive():
                process.terminate()
        for process in self.procs:
            if process is not None:
                process.join(timeout_s)
                if process.is_alive():
                    process.kill()
                    process.join(timeout_s)


def serve_node_replicas(args: ServerArgs, info: ModelInfo, runner_factory: str = DEFAULT_RUNNER_FACTORY) -> int:
    """Run `args.dp` node processes until SIGTERM/SIGINT; returns the exit code (2: the master refused them)."""
    replicas = NodeReplicas(args, info, runner_factory)
    try:
        for i in range(args.dp):
            replicas.start(i)
        while True:
            time.sleep(CHECK_INTERVAL_S)
            code = replicas.check()
            if code is not None:
                return code
    finally:
        replicas.stop()
