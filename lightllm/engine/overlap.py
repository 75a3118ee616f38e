"""Overlap scheduling: the host prepares step t + 1 while the device runs step t.

With `Engine.overlap_schedule` on (the server's default unless `--disable_overlap_schedule`), a step without drafts
or penalties (decode rows of one token, prefill chunks, or both) is launched and left in flight; the next
`Engine.step()` launches its successor before reading the in-flight step's tokens back, so the host's bookkeeping
of step t (emitting, finishing, publishing, scheduling, building the batch) runs while the GPU computes step
t + 1. A successor's decode rows whose last token is still in flight take it from the device (argmax, or a draw
from the same random stream); its other rows (prefill chunks, a prompt's last token fed as a window) need nothing
from step t. When the successor is the in-flight step's rows again (nothing to admit, nobody prefilling, nobody at
its length limit, KV for one more token each) it is chained without asking the scheduler; otherwise the scheduler
plans it while step t is in flight (`schedule_ahead`), leaving out the rows whose token in flight is their last
(they leave at the read-back) and never preempting (the step falls back to reading step t first when KV is short).
A row that turns out to have stopped at step t rides along in t + 1 and its extra token is dropped, and t + 2
goes on without it. Drafts, penalties and prompt log-probabilities (which need the tokens in flight, or the
step's logits on the host) run synchronously, exactly as with overlap off.

Rows with a grammar overlap too. The mask of step t + 1 depends on step t's token, which only the host's matcher
can turn into a mask, so a batch with constrained rows defers its masks (`grammar_masks.MaskJob`): step t + 1's
forward is launched from the tokens on the device, then step t's tokens are read back, the matchers advanced, and
the masks of step t + 1 filled on a background thread while step t's tokens are emitted. On a GPU the masked draw
of step t + 1 was queued before, behind a device wait for the masks, so the host goes on to launch step t + 2
while the masks are computed; elsewhere the draw is queued once they are done. Either way the draw sees the same
masked logits as the synchronous step, so the tokens are the same. (Computing masks on the device for every
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
from lightllm.engine.request import Request
from lightllm.engine.scheduler import ScheduledRow, SchedulePlan
from lightllm.engine.spec_overlap import SpecInFlight, SpecOverlap, chained_spec_plan

if TYPE_CHECKING:
    from lightllm.engine.engine import Engine

logger = logging.getLogger(__name__)


@dataclass
class InFlight:
    """A launched overlapped step whose tokens the host has not read yet."""

    plan: SchedulePlan
    fwd: ForwardOutput
    # the requests that sample a token in this step, in the order of its logits rows: prefill rows ending their
    # prompt, then decode rows
    windows: list[Request]
    # [windows] int64 on the device: each window's token (the next step's input)
    tokens: torch.Tensor
    # [2, windows] host copy of (tokens, non-finite flags), valid once `ready` has completed
    host: torch.Tensor
    ready: torch.cuda.Event | None
    # the deferred masks of its constrained rows' draw, filled on a background thread
    masks: grammar.MaskJob | None = None

    def read(self) -> tuple[list[int], list[int]]:
        if self.ready is not None:
            self.ready.synchronize()
        tokens, has_nan = self.host.tolist()
        return tokens, has_nan


def chained_plan(inflight: InFlight | SpecInFlight) -> SchedulePlan:
    """The in-flight step's sampling rows again, one token each (a full window each for a verify step)."""
    if isinstance(inflight, SpecInFlight):
        return chained_spec_plan(inflight)
    return SchedulePlan(decode=[ScheduledRow(req, 1) for req in inflight.windows if not req.is_finished])


def sampling_rows(plan: SchedulePlan) -> list[Request]:
    """The requests that sample a token in `plan`, in the order of the step's logits rows: prefill rows whose chunk
    ends the prefill, then every decode row (one-token windows)."""
    ends = [
        row.req for row in plan.prefill if row.req.num_computed_tokens + row.num_tokens == row.req.num_prefill_tokens
    ]
    return ends + [row.req for row in plan.decode]


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
        """A step that may stay in flight: decode rows of one token and prefill chunks, none whose distribution
        depends on the output so far (penalties, min_tokens: they need every token of the output, the one in flight
        included) and no chunk
        gathering prompt log-probabilities (read from the step's logits on the host). With drafts (MTP):
        `SpecOverlap.can_launch`."""
        engine = self.engine
        if engine.speculator.num_drafts:
            return self.spec.can_launch(plan)
        return (
            engine.overlap_schedule
            and all(row.num_tokens == 1 and not row.req.params.needs_output_history for row in plan.decode)
            and not any(
                row.req.params.needs_output_history or engine.asks_prompt_logits(row.req, row.num_tokens)
                for row in plan.prefill
            )
        )

    def schedule_ahead(self, inflight: InFlight | SpecInFlight) -> SchedulePlan | None:
        """The next step's plan from the scheduler while `inflight` still runs, or None when it needs the in-flight
        tokens on the host first (drafts, too little free KV for the running rows, or a waiting request of a better
        priority than a running one: only a preemption could make room, and a preempted request must not have a
        token in flight). Rows whose token in flight is their last
        are left out: they finish at the read-back."""
        engine = self.engine
        if isinstance(inflight, SpecInFlight) or engine.speculator.num_drafts or not engine.overlap_schedule:
            return None
        sched = engine.scheduler
        if engine.runner.num_free_kv_tokens() < len(sched.running):
            return None
        last = [req for req in inflight.windows if not req.is_finished and req.num_remaining_tokens < 2]
        if sched.priority_victim(held=last) is not None:
            # a request of a better priority takes a running one's place: the preempted one's token must be read
            return None
        return sched.schedule(held=last, may_preempt=False)

    def can_chain(self, inflight: InFlight | SpecInFlight) -> bool:
        """Whether the next step is the in-flight step's running rows again (those that finished are left out), one
        token each, whatever tokens it yields."""
        if isinstance(inflight, SpecInFlight):
            return self.spec.can_chain(inflight)
        sched, runner = self.engine.scheduler, self.engine.runner
        reqs = [req for req in inflight.windows if not req.is_finished]
        if not reqs or len(reqs) != len(sched.running):
            return False
        # a request the scheduler could admit now, or a row whose in-flight token may be its last, changes the batch
        if sched.waiting_would_join():
            return False
        if any(r.num_remaining_tokens < 2 for r in reqs):
            return False
        return runner.num_free_kv_tokens() >= len(reqs)

    def launch(self, plan: SchedulePlan, previous: InFlight | None) -> list[EngineOutput]:
        """Launch `plan` (prefill chunks and one-token decode rows) and leave it in flight: its one-token windows
        are accepted at once (nothing to verify), its tokens stay on the device for the successor and are copied
        back asynchronously. `previous`: the in-flight step launched before (the source of the decode rows' tokens
        it holds); it is read back and emitted here, and its outputs are returned. Verify rows (MTP):
        `SpecOverlap.launch`."""
        if isinstance(previous, SpecInFlight) or (previous is None and self.engine.speculator.num_drafts):
            self._inflight = self.spec.launch(plan, previous)
            return self.complete(previous) if previous is not None else []
        engine = self.engine
        engine.stats.num_steps += 1
        engine.awaiting_accept = False
        outputs: list[EngineOutput] = []
        windows = sampling_rows(plan)
        job = None
        try:
            if previous is not None and any(req.grammar is not None for req in windows):
                # the masks need the tokens in flight: the mask thread reads them as soon as the device has them,
                # moves the matchers over them and fills the masks, while this thread launches the forward
                # the device is the in-flight tokens' (the logits are not there yet)
                device = previous.tokens.device
                job = grammar.MaskJob.of(self._mask_rows(windows), len(windows), engine.runner.vocab_size, device)
                job.start(before=_advancing(previous))
            batch = engine.build_batch(plan)
            batch.decode_input_ids = None if previous is None else _tokens_of(previous, plan.decode)
            fwd = engine.runner.forward(batch)
            if plan.decode:
                engine.awaiting_accept = True
                handles = [row.req.handle for row in plan.decode]
                engine.runner.accept(handles, [1] * len(handles))
                engine.awaiting_accept = False
            for row in plan.rows:
                row.req.num_computed_tokens += row.num_tokens
            engine.queue_prefill_checkpoints(plan)
            if job is not None:
                done, previous = previous, None
                done_outputs, (tokens, host, ready) = self._complete_with_masks(done, job, windows, fwd.logits)
                outputs += done_outputs
            else:
                tokens, host, ready = self._sample(windows, self._masked(windows, fwd.logits))
        except Exception:
            logger.exception("engine step failed; finishing %d requests with an error", len(plan.rows))
            engine.settle_runner(plan)
            self._failed_outputs += engine.fail_rows(plan)
        else:
            self._inflight = InFlight(plan, fwd, windows, tokens, host, ready, job)
        if previous is not None:
            outputs += self.complete(previous, advanced_by=job)
        return outputs

    def _complete_with_masks(self, previous: InFlight, job: grammar.MaskJob, windows: list[Request], logits):
        """Read `previous` back and emit it while `job` (started with `previous`'s tokens) fills the masks of this
        step's `windows`; returns the outputs and this step's draw (`_sample`), queued before the masks exist where
        the device can wait for them."""
        drawn = None
        try:
            if job.deferred:
                drawn = self._sample(windows, job.apply(logits))
            outputs = self.complete(previous, advanced_by=job)
        finally:
            # a device waiting for the masks is never left waiting
            job.start_or_release()
        if drawn is None:
            job.wait()
            drawn = self._sample(windows, job.apply(logits))
        return outputs, drawn

    @staticmethod
    def _mask_rows(windows: list[Request]) -> list[tuple[Request, int, int, list[int]]]:
        return [(req, i, 1, []) for i, req in enumerate(windows)]

    def _sample(
        self, windows: list[Request], logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]:
        """Each window's token left on the device (drawn from `logits`, masked already), and its host copy (with the
        non-finite flags) on its way."""
        if not windows:
            return logits.new_empty(0, dtype=torch.long), logits.new_empty((2, 0), dtype=torch.long, device="cpu"), None
        tokens = self._draw_on_device(windows, logits)
        flags = torch.stack([tokens, nonfinite_rows(logits).long()])
        if not flags.is_cuda:
            return tokens, flags, None
        host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
        host.copy_(flags, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return tokens, host, ready

    @staticmethod
    def _masked(windows: list[Request], logits: torch.Tensor) -> torch.Tensor:
        """The logits with each constrained row masked by its grammar; rows whose request finished at the step
        before ride along unmasked (their token is dropped)."""
        rows = [(req, i, 1, []) for i, req in enumerate(windows) if not req.is_finished]
        return grammar.mask_windows(rows, logits)

    def _draw_on_device(self, windows: list[Request], logits: torch.Tensor) -> torch.Tensor:
        """Each row's token, left on the device: the argmax, or a draw from the same distribution and the same
        random stream as the synchronous step's."""
        if all(req.params.takes_raw_argmax for req in windows):
            return logits.argmax(dim=-1)
        sampler = self.engine.sampler
        contexts = [self.engine.row_context(req, [], logits.device) for req in windows]
        return sampler.draw_tokens(sampler.target_probs(logits, contexts), contexts)

    def complete(
        self, inflight: InFlight | SpecInFlight, advanced_by: grammar.MaskJob | None = None
    ) -> list[EngineOutput]:
        """Read an overlapped step's tokens back and emit them. Rows whose request finished meanwhile (a stop
        token of the step before, an abort) drop theirs. `advanced_by`: the next step's mask job, started with this
        step's tokens (`_advancing`): the rows' matchers were moved on the mask thread, and their outcomes come
        from it."""
        if isinstance(inflight, SpecInFlight):
            return self.spec.complete(inflight)
        engine = self.engine
        if not inflight.windows:
            return []
        errors = None
        try:
            if inflight.masks is not None:
                # its masks were filled on the mask thread: done before its matchers move again
                inflight.masks.wait()
            tokens, has_nan = inflight.read()
            if advanced_by is not None and advanced_by.runs_before:
                errors = advanced_by.before_result()
        except Exception:
            logger.exception("engine step failed; finishing %d requests with an error", len(inflight.windows))
            return engine.fail_rows(inflight.plan)
        outputs: list[EngineOutput] = []
        for i, req in enumerate(inflight.windows):
            if req.is_finished:
                continue
            if has_nan[i]:
                outputs += engine.finish(req, "error", error=NONFINITE_LOGITS_ERROR)
            else:
                outputs += engine.emit(
                    req,
                    [tokens[i]],
                    inflight.fwd.logits,
                    i,
                    advance_grammar=errors is None,
                    grammar_error=None if errors is None else errors.get(i),
                )
        return outputs


def _advancing(previous: InFlight):
    """What a mask job runs before its masks: `previous`'s tokens read once the device has them, and the matchers
    of its rows with a grammar (requests not finished when the job starts; a row whose logits were not finite is
    left, it fails) moved over them; returns {row: error message or None}."""
    rows = [
        (i, req.grammar) for i, req in enumerate(previous.windows) if not req.is_finished and req.grammar is not None
    ]
    if not rows:
        return lambda: {}

    def advance() -> dict[int, str | None]:
        tokens, has_nan = previous.read()
        rows_now = [(i, g) for i, g in rows if not has_nan[i]]
        return dict(zip((i for i, _ in rows_now), grammar.advance_many([(g, tokens[i]) for i, g in rows_now])))

    return advance


def _tokens_of(previous: InFlight, rows: list[ScheduledRow]) -> torch.Tensor | None:
    """The decode rows' input tokens on the device: a request that sampled in `previous` takes that token (still
    on the device), any other row its last token known to the host (a prompt's last token fed as a window). None
    when every row's token is on the host."""
    position = {id(req): i for i, req in enumerate(previous.windows)}
    index = [position.get(id(row.req), -1) for row in rows]
    if all(i < 0 for i in index):
        return None
    if index == list(range(len(previous.windows))):
        return previous.tokens
    source = previous.tokens
    if any(i < 0 for i in index):
        known = [row.req.last_token_id for row in rows]
        source = torch.cat([source, to_device(np.asarray(known, dtype=np.int64), source.device)])
        index = [i if i >= 0 else len(previous.windows) + j for j, i in enumerate(index)]
    return source[to_device(np.asarray(index, dtype=np.int64), source.device)]
