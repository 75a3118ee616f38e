"""ReplicaRestarter: strikes, backoff and giving up, with scripted engine starts (no engine process)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp

from lightllm.server.dp.restart import MAX_BACKOFF_S, STABLE_S, ReplicaRestarter, RestartPolicy
from lightllm.server.launcher import EngineHandle


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _spawner(outcomes: list[dict | None]):
    """spawn(replica) for the restarter: each call answers the next outcome on its start-up pipe (None: the engine
    exits without a word, as a crash during start-up does; SPAWN_FAILS: no process could be spawned);
    `spawn.replicas` lists the replica of each call."""
    calls = []

    def spawn(replica: int):
        spawn.replicas.append(replica)
        outcome = outcomes[len(calls)]
        calls.append(outcome)
        if outcome == SPAWN_FAILS:
            raise OSError(11, "Resource temporarily unavailable")
        parent, child = mp.Pipe(duplex=False)
        if outcome is not None:
            child.send(outcome)
        child.close()
        process = mp.get_context("spawn").Process(target=print)
        return EngineHandle(process, "ipc://in", "ipc://out", "", "/nonexistent"), parent

    spawn.replicas = []
    return spawn, calls


OK = {"ok": True, "report": "fresh"}
FAIL = {"ok": False, "error": "OutOfMemoryError: no room", "traceback": ""}
SPAWN_FAILS = "spawn fails"


def test_policy_doubles_the_wait_up_to_the_cap():
    policy = RestartPolicy(attempts=3, backoff_s=1.5)
    assert [policy.delay_s(k) for k in range(3)] == [1.5, 3.0, 6.0]
    assert policy.delay_s(20) == MAX_BACKOFF_S


def test_a_replica_that_served_long_restarts_with_no_strike():
    clock = _Clock()
    spawn, calls = _spawner([OK])
    restarter = ReplicaRestarter(2, RestartPolicy(3, 0.0), spawn, clock)
    clock.now += STABLE_S
    handle = asyncio.run(restarter.restart(1))
    assert handle is not None and handle.capacity_report == "fresh"
    assert restarter.num_restarts == [0, 1] and restarter.restarting == set() and len(calls) == 1
    # the fresh engine is the dead replica's (its own devices), not another one's
    assert spawn.replicas == [1]


def test_failed_starts_are_strikes_until_the_replica_stays_down():
    clock = _Clock()
    spawn, calls = _spawner([FAIL, None, OK])
    restarter = ReplicaRestarter(2, RestartPolicy(2, 0.0), spawn, clock)
    clock.now += STABLE_S
    # strike 0 fails, strike 1 exits during start-up: 2 strikes of 2, the third start is never tried
    assert asyncio.run(restarter.restart(0)) is None
    assert len(calls) == 2 and restarter.num_restarts == [0, 0]
    assert restarter.given_up == {0} and restarter.may_serve_again()


def test_a_spawn_that_fails_is_a_strike_not_a_lost_restart():
    """An OSError from spawning counts as a failed start: the next attempt still comes, and once the strikes are
    used up the replica is given up (not left restarting for ever)."""
    clock = _Clock()
    spawn, calls = _spawner([SPAWN_FAILS, OK])
    restarter = ReplicaRestarter(1, RestartPolicy(3, 0.0), spawn, clock)
    clock.now += STABLE_S
    assert asyncio.run(restarter.restart(0)) is not None
    assert calls == [SPAWN_FAILS, OK] and restarter.num_restarts == [1]
    spawn, calls = _spawner([SPAWN_FAILS, SPAWN_FAILS])
    restarter = ReplicaRestarter(1, RestartPolicy(2, 0.0), spawn, clock)
    clock.now += STABLE_S
    assert asyncio.run(restarter.restart(0)) is None
    assert restarter.given_up == {0} and restarter.restarting == set() and not restarter.may_serve_again()


def test_a_crash_loop_uses_up_the_strikes():
    """Deaths soon after each start are strikes: with 3 attempts the replica is restarted twice, then stays down."""
    clock = _Clock()
    spawn, calls = _spawner([OK, OK, OK])
    restarter = ReplicaRestarter(1, RestartPolicy(3, 0.0), spawn, clock)
    results = []
    for _ in range(3):
        clock.now += 1.0
        results.append(asyncio.run(restarter.restart(0)))
    assert [r is not None for r in results] == [True, True, False]
    assert restarter.num_restarts == [2] and len(calls) == 2
    assert not restarter.may_serve_again()


def test_the_wait_grows_per_strike(monkeypatch):
    waits = []

    async def sleep(seconds):
        waits.append(seconds)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    clock = _Clock()
    spawn, _ = _spawner([FAIL, FAIL, OK])
    restarter = ReplicaRestarter(1, RestartPolicy(4, 0.5), spawn, clock)
    clock.now += STABLE_S
    assert asyncio.run(restarter.restart(0)) is not None
    assert waits == [0.5, 1.0, 2.0]


def test_no_attempts_never_restarts():
    spawn, calls = _spawner([OK])
    restarter = ReplicaRestarter(1, RestartPolicy(0, 0.0), spawn, _Clock())
    assert asyncio.run(restarter.restart(0)) is None and calls == []
    assert not restarter.may_serve_again()
