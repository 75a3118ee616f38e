"""Prefix-cache publishes that wait for the next engine step.

A step's tokens go out when `Engine.step` returns. What the step leaves for the prefix cache (the checkpoint at a
prefill chunk's end, a finished request's committed tokens, whose slot and KV the publish reads and which are
freed after it) is queued here and run at the start of the next step, after its drafts: the checkpoint export,
and with MTP the head's pass over the prompt (which those drafts make anyway), stay out of the step that returns
the tokens.
"""

from __future__ import annotations

import logging

from lightllm.engine.batch import ModelRunnerProtocol
from lightllm.engine.request import Request
from lightllm.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


class PublishQueue:
    def __init__(self, scheduler: Scheduler, runner: ModelRunnerProtocol):
        self._scheduler, self._runner = scheduler, runner
        # (request, whether it left the engine: its resources are released after the publish)
        self._entries: list[tuple[Request, bool]] = []

    def __bool__(self) -> bool:
        return bool(self._entries)

    def checkpoint(self, req: Request) -> None:
        """A running request whose committed tokens end at a checkpoint point."""
        self._entries.append((req, False))

    def leaving(self, req: Request) -> None:
        """A finished request, out of the scheduler's queues with its resources still held."""
        self._entries.append((req, True))

    def take(self) -> list[tuple[Request, bool]]:
        """The queued entries, leaving the queue empty (what a step queues after this waits for the next)."""
        entries, self._entries = self._entries, []
        return entries

    def run_now(self, reqs: list[Request]) -> None:
        """Run the queued entries of `reqs` now (a request leaving the engine with its state: a PD hand-off)."""
        ids = {id(req) for req in reqs}
        self.run([e for e in self._entries if id(e[0]) in ids])
        self._entries = [e for e in self._entries if id(e[0]) not in ids]

    def run(self, entries: list[tuple[Request, bool]]) -> None:
        """Publish each entry's committed tokens; a request that left then gives its resources back. A running
        request that left meanwhile (an abort publishes and releases at once) is skipped. A failure costs the cache
        its entry, never the request (its tokens are out) nor the others."""
        running = [req for req, left in entries if not left and req.handle is not None and not req.is_finished]
        if running:
            try:
                # one call for all of them: with MTP one pass of the head over what their prefills left pending
                self._runner.publish_many([(req.handle, req.all_ids[: req.num_computed_tokens]) for req in running])
            except Exception:
                logger.exception("prefix-cache publish of %d requests failed", len(running))
        for req, left in entries:
            if not left:
                continue
            try:
                self._scheduler.release(req, publish=True)
            except Exception:
                logger.exception("prefix-cache publish of %s failed", req.req_id)
                try:
                    self._scheduler.release(req, publish=False)
                except Exception:
                    logger.exception("could not release %s", req.req_id)
