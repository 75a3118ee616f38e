"""NodeReplicas.check, the supervisor of a `--dp` prefill/decode node, over scripted replica processes: a dead
replica is started again under the strikes policy, one past its strikes stays down, all down ends the command
with 1, and a replica the master refused ends it with 2."""

from __future__ import annotations

from lightllm.server.args import ServerArgs
from lightllm.server.pd.node_replicas import REFUSED_EXIT_CODE, NodeReplicas


class _Process:
    def __init__(self):
        self.exitcode: int | None = None

    def is_alive(self) -> bool:
        return self.exitcode is None


class _ScriptedReplicas(NodeReplicas):
    """Starts scripted processes instead of node processes."""

    def __init__(self, attempts: int):
        args = ServerArgs(run_mode="decode", device="cpu", dp=2, dp_restart_attempts=attempts, dp_restart_backoff_s=0)
        super().__init__(args, info=None)
        self.starts: list[int] = []
        # how many of the next starts fail to spawn a process
        self.num_spawn_failures = 0

    def start(self, replica: int) -> None:
        if self.num_spawn_failures:
            self.num_spawn_failures -= 1
            raise OSError(11, "Resource temporarily unavailable")
        self.procs[replica] = _Process()
        self.strikes.started(replica)
        self.starts.append(replica)


def test_a_dead_replica_is_started_again_until_its_strikes_are_used_up():
    replicas = _ScriptedReplicas(attempts=2)
    replicas.start(0)
    replicas.start(1)
    assert replicas.check() is None and replicas.starts == [0, 1]
    # a death soon after the start: strike 1 of 2, started again (no backoff here)
    replicas.procs[1].exitcode = -9
    assert replicas.check() is None and replicas.starts == [0, 1, 1]
    # strike 2 of 2: it stays down while replica 0 serves
    replicas.procs[1].exitcode = 1
    assert replicas.check() is None and replicas.starts == [0, 1, 1] and replicas.procs[1] is None
    replicas.procs[0].exitcode = -9
    assert replicas.check() is None and replicas.starts == [0, 1, 1, 0]
    replicas.procs[0].exitcode = -9
    # every replica down for good: the command ends with 1
    assert replicas.check() == 1


def test_a_refused_replica_stops_the_command():
    replicas = _ScriptedReplicas(attempts=3)
    replicas.start(0)
    replicas.start(1)
    replicas.procs[1].exitcode = REFUSED_EXIT_CODE
    assert replicas.check() == REFUSED_EXIT_CODE
    assert replicas.starts == [0, 1]


def test_without_restarts_the_command_runs_until_every_replica_is_down():
    replicas = _ScriptedReplicas(attempts=0)
    replicas.start(0)
    replicas.start(1)
    replicas.procs[0].exitcode = -9
    assert replicas.check() is None and replicas.starts == [0, 1]
    replicas.procs[1].exitcode = -9
    assert replicas.check() == 1


def test_a_replica_that_cannot_be_spawned_takes_a_strike_and_is_tried_again():
    replicas = _ScriptedReplicas(attempts=3)
    replicas.start(0)
    replicas.start(1)
    # strike 1: the death; strike 2: the restart cannot spawn a process; the next start succeeds
    replicas.procs[1].exitcode = -9
    replicas.num_spawn_failures = 1
    assert replicas.check() is None and replicas.starts == [0, 1] and 1 in replicas.due
    assert replicas.check() is None and replicas.starts == [0, 1, 1] and not replicas.due


def test_twin_spawn_failures_use_up_the_strikes_while_the_others_serve():
    replicas = _ScriptedReplicas(attempts=2)
    replicas.start(0)
    replicas.start(1)
    replicas.procs[1].exitcode = -9
    replicas.num_spawn_failures = 1
    assert replicas.check() is None and replicas.procs[1] is None and not replicas.due
    assert replicas.starts == [0, 1] and replicas.procs[0].is_alive()
