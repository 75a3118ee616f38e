"""Speculative decoding strategies, chosen once at start-up: none, n-gram prompt lookup, or MTP.

A strategy has `num_drafts` (largest draft count per window), `propose(reqs)` (set `req.draft_ids` before a
step), `after_step(runner, rows, hidden)` (see something produced by the step, e.g. hidden states for MTP) and
`flush(reqs)` (settle what `after_step` left for the next `propose`, for requests leaving the engine now).
Verification is shared by all of them (`verify.py`).
"""

from __future__ import annotations

from lightllm.engine.request import Request
from lightllm.engine.speculative.mtp import MtpSpeculator
from lightllm.engine.speculative.ngram import NgramSpeculator


class NoSpeculator:
    num_drafts = 0

    def propose(self, reqs: list[Request]) -> None:
        pass

    def after_step(self, runner, rows, hidden) -> None:
        pass

    def flush(self, reqs=None) -> None:
        pass


def create_speculator(mtp_step: int, spec_ngram: int) -> NoSpeculator | NgramSpeculator | MtpSpeculator:
    assert not (mtp_step and spec_ngram), "mtp_step and spec_ngram are exclusive (validated in ServerArgs)"
    if mtp_step > 0:
        return MtpSpeculator(mtp_step)
    if spec_ngram > 0:
        return NgramSpeculator(spec_ngram)
    return NoSpeculator()


__all__ = ["MtpSpeculator", "NgramSpeculator", "NoSpeculator", "create_speculator"]
