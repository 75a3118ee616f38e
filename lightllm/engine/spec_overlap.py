"""Overlapped speculative steps: greedy MTP verify t + 1 launched before the host reads verify t back.

A launched step is one runner call, `verify_on_device` (on CUDA one graph replay): the verify forward of full
windows (W = mtp_step + 1 tokens per row), acceptance on the device (counts, next tokens, and the pair tokens the
MTP head commits), the state's accept with those device counts and the MTP head's drafts for the next windows.
Its successor takes its windows (next token, drafts) from that step's device figures; the runner shifts the
successor's positions, cached lengths and KV write slots by the unread counts on the device, KV having been
allocated for the worst case (W more tokens a row), and releases the rejected KV when the host reads the counts
(`runner.settle`), one step later. Emitting tokens, stop checks, finishes and their publishes follow one step
late, as for plain overlap; a row that finished at step t rides along in t + 1 and its tokens are dropped, and
t + 2 chains on without it. A row near its length limit keeps full windows: the runner's slot tables have room for
the two windows in flight past a request's limit, and emitting stops at the limit.

Only greedy MTP decode chains this way: every row greedy without penalties or a grammar with a full window of
drafts, nothing to admit, the runner's step buffers holding the batch. Anything else (prefill chunks, sampled
rows, n-gram drafts, runners without the buffers) runs synchronously, as with overlap off. A row asking for
log-probabilities keeps the step's logits (a copy per step); the others never read them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from lightllm.cache.device_copy import to_device
from lightllm.engine.batch import ForwardBatch
from lightllm.engine.logits_check import NONFINITE_LOGITS_ERROR
from lightllm.engine.messages import EngineOutput
from lightllm.engine.scheduler import ScheduledRow, SchedulePlan
from lightllm.engine.speculative.device_drafts import DraftBatch, write_window_drafts
from lightllm.engine.speculative.mtp import MtpSpeculator
from lightllm.engine.speculative.verify import VerifyFigures, WindowResult

if TYPE_CHECKING:
    from lightllm.engine.engine import Engine

logger = logging.getLogger(__name__)


@dataclass
class SpecInFlight:
    """A launched overlapped verify step whose accepted counts the host has not read yet."""

    plan: SchedulePlan
    # the rows' runner handles at launch (a request finished meanwhile has given its handle back)
    handles: list[int]
    width: int
    # [rows, 2 W + 2] on the device (the runner's `verify_on_device`; `VerifyFigures` says which column is which)
    figures: torch.Tensor
    # a host copy of `figures`, valid once `ready` has completed
    host: torch.Tensor
    ready: torch.cuda.Event | None
    # [rows * W, V] the logits of every window position, kept only when a row asks for log-probabilities
    logits: torch.Tensor | None

    def read(self) -> list[tuple[int, bool, list[int]]]:
        """Per row: (kept count, non-finite flag, the W pair tokens)."""
        if self.ready is not None:
            self.ready.synchronize()
        layout = VerifyFigures(self.width)
        return [layout.read(row) for row in self.host.tolist()]

    @property
    def windows(self) -> torch.Tensor:
        """[rows, W] on the device: each row's next window (its next token, then the head's drafts)."""
        return VerifyFigures(self.width).window(self.figures)


def chained_spec_plan(inflight: SpecInFlight) -> SchedulePlan:
    """The in-flight step's rows whose requests are still running, a full window each."""
    return SchedulePlan(
        decode=[ScheduledRow(row.req, inflight.width) for row in inflight.plan.decode if not row.req.is_finished]
    )


class SpecOverlap:
    """When an MTP verify step may stay in flight, launching it, and reading it back."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def enabled(self) -> bool:
        e = self.engine
        return e.overlap_schedule and isinstance(e.speculator, MtpSpeculator) and e.speculator.num_drafts > 0

    def _rows_fit(self, reqs) -> bool:
        e = self.engine
        if not all(r.params.takes_raw_argmax and not r.grammar for r in reqs):
            return False
        can = getattr(e.runner, "can_verify_on_device", None)
        return can is not None and can([r.handle for r in reqs], e.speculator.num_drafts + 1)

    def can_launch(self, plan: SchedulePlan) -> bool:
        """Decode rows only, each a full window of drafts (see the module docstring)."""
        if not self.enabled() or plan.prefill or not plan.decode:
            return False
        k = self.engine.speculator.num_drafts
        if any(row.num_tokens != k + 1 or len(row.draft_ids) != k for row in plan.decode):
            return False
        return self._rows_fit([row.req for row in plan.decode])

    def can_chain(self, inflight: SpecInFlight) -> bool:
        """Whether the next step is the in-flight step's running rows again (those that finished are left out),
        full windows, whatever they accept."""
        e = self.engine
        sched, runner = e.scheduler, e.runner
        reqs = [row.req for row in inflight.plan.decode if not row.req.is_finished]
        if not reqs or len(reqs) != len(sched.running):
            return False
        if sched.waiting_would_join():
            return False
        need = inflight.width * len(reqs)
        if sched.token_budget < need or runner.num_free_kv_tokens() < need:
            return False
        return self._rows_fit(reqs)

    def launch(self, plan: SchedulePlan, previous: SpecInFlight | None) -> SpecInFlight | None:
        """Launch `plan`'s verify and leave it in flight; `previous`: the in-flight step whose device tokens and
        drafts feed it (None: the rows' tokens and drafts are the host's, as a synchronous step takes them)."""
        e = self.engine
        runner = e.runner
        e.stats.num_steps += 1
        e.awaiting_accept = False
        k = e.speculator.num_drafts
        width = k + 1
        rows = plan.decode
        handles = [row.req.handle for row in rows]
        try:
            if previous is None:
                windows = _host_windows(e.build_batch(plan), len(rows), width, runner.device)
            else:
                windows = _rows_of(previous, rows)
                # rows that may reach their length limit in the step in flight: their state as it leaves them,
                # before this step moves it on (the prefix cache publishes it if they did)
                runner.hold_checkpoints([row.req.handle for row in rows if row.req.num_remaining_tokens <= width])
            # a window never keeps drafts past the request's limit (the runner counts the tokens still in flight)
            room = np.asarray([row.req.num_remaining_tokens - 1 for row in rows], dtype=np.int64)
            kept = None
            if e.acceptance is not None:
                # each request's coins for its next window, as the synchronous verify draws them
                kept = np.asarray(e.acceptance.num_kept_drafts([row.req.req_id for row in rows], [k] * len(rows)))
            keep_logits = any(row.req.params.logprobs is not None for row in rows)
            figures, logits = runner.verify_on_device(handles, windows, room, kept, keep_logits)
            ready = None
            if figures.is_cuda:
                host = torch.empty(figures.shape, dtype=figures.dtype, pin_memory=True)
                host.copy_(figures, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record()
            else:
                host = figures
        except Exception:
            logger.exception("engine step failed; finishing %d requests with an error", len(rows))
            e.overlap.add_failed(e.fail_rows(plan))
            return None
        return SpecInFlight(plan, handles, width, figures, host, ready, logits)

    def complete(self, inflight: SpecInFlight) -> list[EngineOutput]:
        """Read an overlapped verify back: settle the runner, emit each row's accepted tokens (rows whose request
        finished meanwhile drop theirs) and leave the head's drafts as the rows' next drafts."""
        e = self.engine
        rows = inflight.plan.decode
        try:
            host = inflight.read()
            e.runner.settle(inflight.handles, [count for count, _, _ in host])
        except Exception:
            logger.exception("engine step failed; finishing %d requests with an error", len(rows))
            outputs = e.fail_rows(inflight.plan)
            try:
                e.runner.settle(inflight.handles, [1] * len(rows))
            except Exception:
                logger.exception("could not settle the runner after a failed step")
            return outputs
        k = inflight.width - 1
        drafts = DraftBatch(inflight.windows[:, 1:])
        outputs: list[EngineOutput] = []
        for i, (row, (count, bad, pairs)) in enumerate(zip(rows, host, strict=True)):
            req = row.req
            if req.is_finished:
                continue
            req.num_computed_tokens += count
            if bad:
                outputs += e.finish(req, "error", error=NONFINITE_LOGITS_ERROR)
                continue
            # a window near the request's limit counts as the synchronous scheduler would have cut it
            room = max(req.num_remaining_tokens, 1)
            tokens = pairs[:count]
            e._record_window(min(k, room - 1), WindowResult(tokens[:room]))
            req.draft_ids = drafts.row(i, k)
            outputs += e.emit(req, tokens, inflight.logits, i * inflight.width)
        return outputs


def _rows_of(previous: SpecInFlight, rows: list[ScheduledRow]) -> torch.Tensor:
    """`previous`'s next windows for `rows`, a subset of its rows in its order (rows that finished meanwhile are
    left out)."""
    ids = [id(row.req) for row in previous.plan.decode]
    if len(rows) == len(ids):
        return previous.windows
    position = {rid: i for i, rid in enumerate(ids)}
    index = to_device(np.asarray([position[id(row.req)] for row in rows], dtype=np.int64), previous.figures.device)
    return previous.windows[index]


def _host_windows(batch: ForwardBatch, num_rows: int, width: int, device: torch.device) -> torch.Tensor:
    """The windows `[rows, W]` of a step whose rows' last tokens the host knows, on the device: the batch's ids,
    with the drafts still unread on the device written over their places."""
    windows = to_device(batch.input_ids.view(num_rows, width), device)
    if batch.decode_draft_ids is not None:
        write_window_drafts(windows, batch.decode_draft_ids)
    return windows
