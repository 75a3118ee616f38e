"""MTP drafts: the model's MTP head chains `num_drafts` greedy guesses from the last hidden state of each request
that got a token. A step marks those requests; their drafts are made at the start of the next step (`propose`,
before the scheduler reads them), so the tokens of a step go out without waiting for the MTP head. The drafts stay
on the device (`device_drafts.py`): the verify window takes them from there, and the verify's read-back brings
the accepted ones to the host."""

from __future__ import annotations

import torch

from lightllm.engine.request import Request
from lightllm.engine.speculative.device_drafts import DraftBatch


class MtpSpeculator:
    """Strategy object: drafts come from `runner.draft`, one call per step for every request due one."""

    def __init__(self, num_drafts: int, keep_on_device: bool = True):
        self.num_drafts = num_drafts
        # False: read every draft batch back at once (a second wait for the device per step)
        self.keep_on_device = keep_on_device
        self._runner = None
        self._due: list[Request] = []

    def propose(self, reqs: list[Request]) -> None:
        self.flush()
        for req in reqs:
            # never draft past the request's token allowance
            req.draft_ids = req.draft_ids[: max(0, req.num_remaining_tokens - 1)]

    def after_step(self, runner, rows: list[tuple[Request, int]], hidden: torch.Tensor | None) -> None:
        """Every request that just got a token (after `accept`) is due a draft. The runner keeps the hidden states
        of accepted tokens itself, so each such request must be drafted for before its next forward, even if its
        drafts go unused (`flush`, which `propose` calls first)."""
        self._runner = runner
        for req, _ in rows:
            req.draft_ids = []
        self._due += [req for req, _ in rows if not req.is_finished]

    def flush(self, reqs: list[Request] | None = None) -> None:
        """Make the due drafts now: of every due request, or only of those in `reqs` (a request leaving the engine
        with its state, as a prefill/decode hand-off does). Requests finished meanwhile (aborted) need none."""
        due = [req for req in self._due if not req.is_finished]
        if reqs is None:
            now, self._due = due, []
        else:
            leaving = {id(req) for req in reqs}
            now = [req for req in due if id(req) in leaving]
            self._due = [req for req in due if id(req) not in leaving]
        if not now:
            return
        next_tokens = torch.tensor([req.output_ids[-1] for req in now], dtype=torch.long)
        drafts = DraftBatch(self._runner.draft([req.handle for req in now], next_tokens, self.num_drafts))
        if not self.keep_on_device:
            drafts.host()
        for i, req in enumerate(now):
            req.draft_ids = drafts.row(i, self.num_drafts)
