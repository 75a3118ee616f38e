"""Restarting a data-parallel replica whose engine process died: bounded attempts with exponential backoff.

A replica earns strikes: a start attempt that failed, or a death soon after its (re)start (a crash loop). The
first attempt after a death waits `backoff_s`, each strike doubles the wait (at most `MAX_BACKOFF_S`), and once
a replica holds `attempts` strikes it stays down. A replica that served for `STABLE_S` before dying starts again
with no strikes, so a replica that dies once a day is restarted every day.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from lightllm.server.launcher import STARTUP_TIMEOUT_S, EngineHandle, EngineStartError, finish_start

logger = logging.getLogger(__name__)

MAX_BACKOFF_S = 60.0
# a replica up this long before it died was not crash-looping: its strikes are cleared
STABLE_S = 60.0
# seconds between looks at a starting engine's start-up pipe (the event loop goes on meanwhile)
START_POLL_S = 0.1


@dataclass(frozen=True)
class RestartPolicy:
    # strikes a replica may hold and still be restarted (0: never restart)
    attempts: int
    # wait before the first attempt after a death, doubled per strike
    backoff_s: float

    def delay_s(self, strikes: int) -> float:
        return min(self.backoff_s * 2**strikes, MAX_BACKOFF_S)


async def wait_started(handle: EngineHandle, conn: Connection, timeout_s: float = STARTUP_TIMEOUT_S) -> EngineHandle:
    """`finish_start` without blocking the event loop; a cancelled wait stops the engine."""
    deadline = time.monotonic() + timeout_s
    try:
        while not conn.poll():
            if time.monotonic() > deadline:
                raise EngineStartError(f"the engine did not start within {timeout_s:g} s")
            await asyncio.sleep(START_POLL_S)
    except BaseException:
        conn.close()
        handle.stop()
        raise
    return finish_start(handle, conn, 0)


class Strikes:
    """Each replica's strikes under a policy (see the module docstring); the clock is injectable for tests."""

    def __init__(self, num_replicas: int, policy: RestartPolicy, clock: Callable[[], float] = time.monotonic):
        self.policy, self._clock = policy, clock
        self._count = [0] * num_replicas
        self._started_at = [clock()] * num_replicas

    def count(self, replica: int) -> int:
        return self._count[replica]

    def started(self, replica: int) -> None:
        self._started_at[replica] = self._clock()

    def died(self, replica: int) -> float | None:
        """The wait before restarting a replica whose process just died; None: it stays down."""
        if self._clock() - self._started_at[replica] >= STABLE_S:
            self._count[replica] = 0
        else:
            self._count[replica] += 1
        return self._next_delay(replica)

    def failed_start(self, replica: int) -> float | None:
        """The wait before the next start after a failed one; None: the replica stays down."""
        self._count[replica] += 1
        return self._next_delay(replica)

    def _next_delay(self, replica: int) -> float | None:
        if self._count[replica] >= self.policy.attempts:
            return None
        return self.policy.delay_s(self._count[replica])


class ReplicaRestarter:
    """Strikes and restarts of every replica. `spawn(replica)` starts that replica's engine process (on its own
    devices; on the event loop's thread: an engine dies with the thread that spawned it) and returns it with its
    start-up pipe."""

    def __init__(
        self,
        num_replicas: int,
        policy: RestartPolicy,
        spawn: Callable[[int], tuple[EngineHandle, Connection]],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.policy, self._spawn = policy, spawn
        self.strikes = Strikes(num_replicas, policy, clock)
        self.num_restarts = [0] * num_replicas
        self.restarting: set[int] = set()
        # replicas whose strikes are used up: they stay down
        self.given_up: set[int] = set()
        self._num_replicas = num_replicas

    def may_serve_again(self) -> bool:
        """Whether some replica is, or may be, restarted (a dead one not yet seen is restarted too)."""
        return self.policy.attempts > 0 and len(self.given_up) < self._num_replicas

    async def restart(self, replica: int) -> EngineHandle | None:
        """A ready engine for `replica`, whose process died; None once its strikes are used up."""
        self.restarting.add(replica)
        try:
            delay = self.strikes.died(replica)
            while delay is not None:
                logger.warning(
                    "restarting data-parallel replica %d in %.1f s (strike %d of %d)",
                    replica,
                    delay,
                    self.strikes.count(replica),
                    self.policy.attempts,
                )
                await asyncio.sleep(delay)
                try:
                    handle = await wait_started(*self._spawn(replica))
                # OSError: the process could not even be spawned (no memory, process or file limits)
                except (EngineStartError, OSError) as exc:
                    logger.error("data-parallel replica %d failed to restart: %s", replica, exc)
                    delay = self.strikes.failed_start(replica)
                    continue
                self.strikes.started(replica)
                self.num_restarts[replica] += 1
                logger.info("data-parallel replica %d restarted: %s", replica, handle.capacity_report)
                return handle
            logger.error(
                "data-parallel replica %d stays down: %d strikes (--dp_restart_attempts %d)",
                replica,
                self.strikes.count(replica),
                self.policy.attempts,
            )
            self.given_up.add(replica)
            return None
        finally:
            self.restarting.discard(replica)
