"""Overlap scheduling: the host prepares step t + 1 while the device runs step t.

With `Engine.overlap_schedule` on (the server's default unless `--disable_overlap_schedule`), a plain decode step
(no drafts, no penalties) is launched and left in flight; the next `Engine.step()` launches its successor, whose
input tokens are the in-flight step's tokens still on the device (argmax, or a draw from the same random stream),
before reading them back, so the host's bookkeeping of step t runs while the GPU computes step t + 1. A successor
is launched only when it would be the same rows anyway (nothing to admit, nobody prefilling, nobody at its length
limit, KV for one more token each); a row that turns out to have stopped at step t rides along in t + 1 and its
extra token is dropped, and t + 2 chains on without it. Everything else (prefill, drafts, penalties, which read the tokens in flight) runs
synchronously, exactly as with overlap off.

Rows with a grammar overlap too. The mask of step t + 1 depends on step t's token, which only the host's matcher
can turn into a mask, so a batch with constrained rows defers only its draw: step t + 1's forward is launched
from the tokens on the device, then step t's tokens are read back and emitted (advancing the matchers), the masks
of step t + 1 are computed on the host while the device still runs its forward, and the masked draw is queued
behind it. The draw sees the same masked logits as the synchronous step, so the tokens are the same; the device
waits only when computing the masks takes longer than a forward. (Computing masks on the device for every
possible in-flight token is not possible: a matcher's state is host data of llguidance.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from lightllm.cache.device_copy import to_device
from lightllm.engine import grammar
from lightllm.engine.batch import ForwardOutput
from lightllm.engine.logits_check import NONFINITE_LOGITS_ERROR, nonfinite_rows
from lightllm.engine.messages import EngineOutput
from lightllm.engine.scheduler import ScheduledRow, SchedulePlan
from lightllm.engine.spec_overlap import SpecInFlight, SpecOverlap, chained_spec_plan

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


def chained_plan(inflight: InFlight | SpecInFlight) -> SchedulePlan:
    """The in-flight step's rows again, one token each (a full window each for a verify step)."""
    if isinstance(inflight, SpecInFlight):
        return chained_spec_plan(inflight)
    return SchedulePlan(decode=[ScheduledRow(row.req, 1) for row in inflight.plan.decode if not row.req.is_finished])


class OverlapScheduler:
    """The engine's one step in flight: when a step may stay in flight, launching it, and reading it back."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._inflight: InFlight | SpecInFlight | None = None
        # finishes of a failed overlapped launch, reported by the next step() call
        self._failed_outputs: list[EngineOutput] = []
        # MTP verify steps (spec_overlap.py)
        self.spec = SpecOverlap(engine)

    def has_work(self) -> bool:
        return self._inflight is not None or bool(self._failed_outputs)

    def take_failed(self) -> list[EngineOutput]:
        outputs, self._failed_outputs = self._failed_outputs, []
        return outputs

    def add_failed(self, outputs: list[EngineOutput]) -> None:
        self._failed_outputs += outputs

    def take_inflight(self) -> InFlight | SpecInFlight | None:
        inflight, self._inflight = self._inflight, None
        return inflight

    def can_launch(self, plan: SchedulePlan) -> bool:
        """A step that may stay in flight: plain decode rows only, none with penalties (they need every token of
        the output, the one in flight included, to shape the next distribution). With drafts (MTP):
        `SpecOverlap.can_launch`."""
        if self.engine.speculator.num_drafts:
            return self.spec.can_launch(plan)
        return (
            self.engine.overlap_schedule
            and not plan.prefill
            and all(row.num_tokens == 1 and not row.req.params.has_penalties for row in plan.decode)
        )

    def can_chain(self, inflight: InFlight | SpecInFlight) -> bool:
        """Whether the next step is the in-flight step's running rows again (those that finished are left out), one
        token each, whatever tokens it yields."""
        if isinstance(inflight, SpecInFlight):
            return self.spec.can_chain(inflight)
        sched, runner = self.engine.scheduler, self.engine.runner
        reqs = [row.req for row in inflight.plan.decode if not row.req.is_finished]
        if not reqs or len(reqs) != len(sched.running):
            return False
        # a request the scheduler could admit now, or a row whose in-flight token may be its last, changes the batch
        if sched.waiting and len(sched.running) < sched.max_running_requests and runner.num_free_requests():
            return False
        if any(r.num_remaining_tokens < 2 for r in reqs):
            return False
        return runner.num_free_kv_tokens() >= len(reqs)

    def launch(self, plan: SchedulePlan, previous: InFlight | None) -> list[EngineOutput]:
        """Launch `plan` (plain decode rows) and leave it in flight: its one-token windows are accepted at once
        (nothing to verify), its tokens stay on the device for the successor and are copied back asynchronously.
        `previous`: the in-flight step `plan` chains from (its tokens are the input); it is read back and emitted
        here, and its outputs are returned. Verify rows (MTP): `SpecOverlap.launch`."""
        if isinstance(previous, SpecInFlight) or (previous is None and self.engine.speculator.num_drafts):
            self._inflight = self.spec.launch(plan, previous)
            return self.complete(previous) if previous is not None else []
        engine = self.engine
        engine.stats.num_steps += 1
        engine.awaiting_accept = False
        outputs: list[EngineOutput] = []
        try:
            batch = engine.build_batch(plan)
            batch.decode_input_ids = None if previous is None else _tokens_of(previous, plan.decode)
            fwd = engine.runner.forward(batch)
            engine.awaiting_accept = True
            handles = [row.req.handle for row in plan.decode]
            engine.runner.accept(handles, [1] * len(handles))
            engine.awaiting_accept = False
            for row in plan.decode:
                row.req.num_computed_tokens += 1
            if previous is not None and any(row.req.grammar is not None for row in plan.decode):
                # the masks need the tokens in flight: read them while the device runs this step's forward
                done, previous = previous, None
                outputs += self.complete(done)
            logits = self._masked(plan, fwd.logits)
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
        else:
            self._inflight = InFlight(plan, fwd, tokens, host, ready)
        if previous is not None:
            outputs += self.complete(previous)
        return outputs

    @staticmethod
    def _masked(plan: SchedulePlan, logits: torch.Tensor) -> torch.Tensor:
        """The logits with each constrained row masked by its grammar; rows whose request finished at the step
        before ride along unmasked (their token is dropped)."""
        windows = [(row.req, i, 1, []) for i, row in enumerate(plan.decode) if not row.req.is_finished]
        return grammar.mask_windows(windows, logits)

    def _draw_on_device(self, plan: SchedulePlan, logits: torch.Tensor) -> torch.Tensor:
        """Each row's token, left on the device: the argmax, or a draw from the same distribution and the same
        random stream as the synchronous step's."""
        if all(row.req.params.greedy for row in plan.decode):
            return logits.argmax(dim=-1)
        sampler = self.engine.sampler
        contexts = [self.engine.row_context(row.req, [], logits.device) for row in plan.decode]
        return sampler.draw_tokens(sampler.target_probs(logits, contexts), contexts)

    def complete(self, inflight: InFlight | SpecInFlight) -> list[EngineOutput]:
        """Read an overlapped step's tokens back and emit them. Rows whose request finished meanwhile (a stop
        token of the step before, an abort) drop theirs."""
        if isinstance(inflight, SpecInFlight):
            return self.spec.complete(inflight)
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


def _tokens_of(previous: InFlight, rows: list[ScheduledRow]) -> torch.Tensor:
    """`previous`'s device tokens for `rows`, a subset of its rows in its order (rows that finished meanwhile are
    left out)."""
    if len(rows) == len(previous.plan.decode):
        return previous.tokens
    position = {id(row.req): i for i, row in enumerate(previous.plan.decode)}
    index = to_device(np.asarray([position[id(row.req)] for row in rows], dtype=np.int64), previous.tokens.device)
    return previous.tokens[index]
