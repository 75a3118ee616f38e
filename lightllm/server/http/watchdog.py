"""A progress watchdog in the HTTP process: sequences are in flight and no token has arrived for
`--progress_timeout_s` seconds means the engine is stuck (a hung device, a scheduler that admits nothing, a lost
link). Then /health answers 503 with the reason, the log names the waiting requests and the engine's last
reported step, and `lightllm_progress_stalls_total` counts the stall (once per stall). The first token after it
clears the state.

It watches what a client sees, so it covers every engine behind the front-end alike (an engine process, DP
replicas, the pd_master's router).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter

from lightllm.engine.messages import EngineStats, TokenChunk

logger = logging.getLogger(__name__)
# most request ids one stall's log line names
MAX_LOGGED_REQUESTS = 20


class ProgressWatchdog:
    def __init__(
        self,
        timeout_s: float,
        in_flight: Callable[[], dict[str, float]],
        stats: Callable[[], EngineStats],
        registry: CollectorRegistry,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`in_flight()`: submitted, unfinished sequences -> submit time (monotonic); `stats()`: the engine's last
        stats. A `timeout_s` of 0 turns the watchdog off."""
        self.timeout_s, self._in_flight, self._stats, self._clock = timeout_s, in_flight, stats, clock
        self.stalls = Counter(
            "lightllm_progress_stalls",
            "times sequences were in flight with no token for --progress_timeout_s",
            registry=registry,
        )
        self._last_token = clock()
        self._stalled = False

    def observe(self, out) -> None:
        if isinstance(out, TokenChunk) and out.token_ids:
            self._last_token = self._clock()
            self._stalled = False

    def problem(self) -> str | None:
        """None while tokens flow (or nothing is in flight); else why the server is not making progress. Logs and
        counts a stall the first time it sees it."""
        if not self.timeout_s:
            return None
        now = self._clock()
        pending = self._in_flight()
        if not pending:
            self._last_token, self._stalled = now, False
            return None
        # a wait that began after the last token counts from the oldest submission since
        since = max(self._last_token, min(pending.values()))
        silent_s = now - since
        if silent_s <= self.timeout_s:
            return None
        if not self._stalled:
            self._stalled = True
            self.stalls.inc()
            stats = self._stats()
            oldest = sorted(pending, key=pending.get)[:MAX_LOGGED_REQUESTS]
            logger.error(
                "no progress for %.0f s with %d sequences in flight (oldest: %s); the engine's last report: step %d, "
                "%d running, %d waiting",
                silent_s,
                len(pending),
                ", ".join(f"{r} ({now - pending[r]:.0f} s)" for r in oldest),
                stats.num_steps,
                stats.num_running,
                stats.num_waiting,
            )
        return f"no token produced for {silent_s:.0f} s with {len(pending)} sequences in flight"
