"""Prompt-lookup drafts: find the latest earlier occurrence of the sequence's tail and propose what followed."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from lightllm.engine.request import Request


def propose_ngram(token_ids: list[int], num_drafts: int, max_match: int = 4, min_match: int = 2) -> list[int]:
    """Up to `num_drafts` tokens that followed the most recent earlier match of the last n tokens.

    Longer matches are tried first (n = max_match down to min_match); an empty list when nothing matches.
    """
    n_total = len(token_ids)
    if num_drafts <= 0 or n_total <= min_match:
        return []
    ids = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_match, n_total - 1), min_match - 1, -1):
        tail = ids[n_total - n :]
        # candidate starts 0 .. n_total - n - 1: the match must end before the tail does
        windows = sliding_window_view(ids[: n_total - 1], n)
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return ids[start : start + num_drafts].tolist()
    return []


class NgramSpeculator:
    """Strategy object: drafts come from the request's own history before each step."""

    def __init__(self, num_drafts: int):
        self.num_drafts = num_drafts

    def propose(self, reqs: list[Request]) -> None:
        for req in reqs:
            req.draft_ids = propose_ngram(req.all_ids, min(self.num_drafts, req.num_remaining_tokens - 1))

    def after_step(self, runner, rows, hidden) -> None:
        pass

    def flush(self, reqs=None) -> None:
        pass
