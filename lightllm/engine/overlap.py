"""Overlap scheduling: the host prepares step t + 1 while the device runs step t.

With `Engine.overlap_schedule` on (the server's default unless `--disable_overlap_schedule`), a plain decode step
(no drafts, no penalties) is launched and left in flight; the next `Engine.step()` launches its successor, whose
input tokens are the in-flight step's tokens still on the device (argmax, or a draw from the same random stream),
before reading them back, so the host's bookkeeping of step t runs while the GPU computes step t + 1. A successor
is launched only when it would be the same rows anyway (nothing to admit, nobody prefilling, nobody at its length
limit, KV for one more token each); a row that turns out to have stopped at step t rides along in t + 1 and its
extra token is dropped. Everything else (prefill, drafts, penalties, which read the tokens in flight) runs
synchronously, exactly as with overlap off.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lightllm.engine.batch import ForwardOutput
from lightllm.engine.logits_check import NONFINITE_LOGITS_ERROR, nonfinite_rows
from lightllm.engine.messages import EngineOutput
from lightllm.engine.scheduler import ScheduledRow, SchedulePlan

if TYPE_CHECKING:
    from lightllm.engine.engine import Engine

logger = logging.getLogger(__name__)


@dataclass
class InFlight:
    """A launched overlapped decode step whose tokens the host has not read yet."""

    plan: SchedulePlan
    fwd: ForwardOutput
    # [rows] int64 on the device: each row's token (the next step's input)
    tokens: torch.Tensor
    # [2, rows] host copy of (tokens, non-finite flags), valid once `ready` has completed
    host: torch.Tensor
    ready: torch.cuda.Event | None

    def read(self) -> tuple[list[int], list[int]]:
        if self.ready is not None:
            self.ready.synchronize()
        tokens, has_nan = self.host.tolist()
        return tokens, has_nan


def chained_plan(inflight: InFlight) -> SchedulePlan:
    """The in-flight step's rows again, one token each."""
    return SchedulePlan(decode=[ScheduledRow(row.req, 1) for row in inflight.plan.decode])


class OverlapScheduler:
    """The engine's one step in flight: when a step may stay in flight, launching it, and reading it back."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._inflight: InFlight | None = None
        # finishes of a failed overlapped launch, reported by the next step() call
        self._failed_outputs: list[EngineOutput] = []

    def has_work(self) -> bool:
        return self._inflight is not None or bool(self._failed_outputs)

    def take_failed(self) -> list[EngineOutput]:
        outputs, self._failed_outputs = self._failed_outputs, []
        return outputs

    def take_inflight(self) -> InFlight | None:
        inflight, self._inflight = self._inflight, None
        return inflight

    def can_launch(self, plan: SchedulePlan) -> bool:
        """A step that may stay in flight: plain decode rows only, none with penalties or a grammar (they need the
        tokens of the step still in flight)."""
        return (
            self.engine.overlap_schedule
            and not plan.prefill
            and all(
                row.num_tokens == 1 and not (row.req.params.has_penalties or row.req.grammar) for row in plan.decode
            )
        )

    def can_chain(self, inflight: InFlight) -> bool:
        """Whether the next step is the in-flight step's rows again, one token each, whatever tokens it yields."""
        sched, runner = self.engine.scheduler, self.engine.runner
        reqs = [row.req for row in inflight.plan.decode]
        if len(reqs) != len(sched.running) or any(r.is_finished for r in reqs):
            return False
        # a request the scheduler could admit now, or a row whose in-flight token may be its last, changes the batch
        if sched.waiting and len(sched.running) < sched.max_running_requests and runner.num_free_requests():
            return False
        if any(r.num_remaining_tokens < 2 for r in reqs):
            return False
        return runner.num_free_kv_tokens() >= len(reqs)

    def launch(self, plan: SchedulePlan, first_tokens: torch.Tensor | None) -> None:
        """Launch `plan` (plain decode rows) and leave it in flight: its one-token windows are accepted at once
        (nothing to verify), its tokens stay on the device for the successor and are copied back asynchronously."""
        engine = self.engine
        engine.stats.num_steps += 1
        engine.awaiting_accept = False
        try:
            batch = engine.build_batch(plan)
            batch.decode_input_ids = first_tokens
            fwd = engine.runner.forward(batch)
            engine.awaiting_accept = True
            handles = [row.req.handle for row in plan.decode]
            engine.runner.accept(handles, [1] * len(handles))
            engine.awaiting_accept = False
            for row in plan.decode:
                row.req.num_computed_tokens += 1
            logits = fwd.logits
            tokens = self._draw_on_device(plan, logits)
            flags = torch.stack([tokens, nonfinite_rows(logits).long()])
            ready = None
            if flags.is_cuda:
                host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
                host.copy_(flags, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record()
            else:
                host = flags
        except Exception:
            logger.exception("engine step failed; finishing %d requests with an error", len(plan.decode))
            engine.settle_runner(plan)
            self._failed_outputs += engine.fail_rows(plan)
            return
        self._inflight = InFlight(plan, fwd, tokens, host, ready)

    def _draw_on_device(self, plan: SchedulePlan, logits: torch.Tensor) -> torch.Tensor:
        """Each row's token, left on the device: the argmax, or a draw from the same distribution and the same
        random stream as the synchronous step's."""
        if all(row.req.params.greedy for row in plan.decode):
            return logits.argmax(dim=-1)
        sampler = self.engine.sampler
        contexts = [self.engine.row_context(row.req, [], logits.device) for row in plan.decode]
        return sampler.draw_tokens(sampler.target_probs(logits, contexts), contexts)

    def complete(self, inflight: InFlight) -> list[EngineOutput]:
        """Read an overlapped step's tokens back and emit them. Rows whose request finished meanwhile (a stop
        token of the step before, an abort) drop theirs."""
        engine = self.engine
        try:
            tokens, has_nan = inflight.read()
        except Exception:
            logger.exception("engine step failed; finishing %d requests with an error", len(inflight.plan.decode))
            return engine.fail_rows(inflight.plan)
        outputs: list[EngineOutput] = []
        for i, row in enumerate(inflight.plan.decode):
            req = row.req
            if req.is_finished:
                continue
            if has_nan[i]:
                outputs += engine.finish(req, "error", error=NONFINITE_LOGITS_ERROR)
            else:
                outputs += engine.emit(req, [tokens[i]], inflight.fwd.logits, i)
        return outputs
