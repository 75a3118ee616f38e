"""MTP drafts: after each step the model's MTP head chains `num_drafts` greedy guesses from the last hidden state."""

from __future__ import annotations

import torch

from lightllm.engine.request import Request


class MtpSpeculator:
    """Strategy object: drafts are produced by `runner.draft` right after the step that sampled a new token."""

    def __init__(self, num_drafts: int):
        self.num_drafts = num_drafts

    def propose(self, reqs: list[Request]) -> None:
        for req in reqs:
            # drafts were made after the previous step; never draft past the request's token allowance
            req.draft_ids = req.draft_ids[: max(0, req.num_remaining_tokens - 1)]

    def after_step(self, runner, rows: list[tuple[Request, int]], hidden: torch.Tensor | None) -> None:
        """Draft for every request that just got a token (after `accept`). The runner keeps the hidden states of
        accepted tokens itself, so it must see every such request each step, even if its drafts go unused."""
        live = [req for req, _ in rows if not req.is_finished]
        for req, _ in rows:
            req.draft_ids = []
        if not live:
            return
        next_tokens = torch.tensor([req.output_ids[-1] for req in live], dtype=torch.long)
        drafts = runner.draft([req.handle for req in live], next_tokens, self.num_drafts)
        for req, row in zip(live, drafts.tolist()):
            req.draft_ids = row
