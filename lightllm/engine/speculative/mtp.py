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
        """`rows` pairs each request that just got a token with the index of its hidden state in `hidden`."""
        live = [(req, idx) for req, idx in rows if not req.is_finished]
        for req, _ in rows:
            req.draft_ids = []
        if not live or hidden is None:
            return
        index = torch.tensor([idx for _, idx in live], device=hidden.device)
        next_tokens = torch.tensor([req.output_ids[-1] for req, _ in live], dtype=torch.long, device=hidden.device)
        # position of the newest token (0-based), the token the MTP head embeds next to the hidden state
        positions = torch.tensor([req.num_tokens - 1 for req, _ in live], dtype=torch.long, device=hidden.device)
        drafts = runner.draft(hidden[index], next_tokens, positions, self.num_drafts)
        for (req, _), row in zip(live, drafts.tolist()):
            req.draft_ids = row
