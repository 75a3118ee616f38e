"""A speculation strategy for tests whose drafts, and so whose accepted counts, are known in advance.

It drafts the request's known greedy continuation (from a cold run or transformers) and corrupts one draft of
some windows at a scripted position, so every window's outcome is fixed: a greedy verify keeps the drafts before
the first wrong one plus one token. Random-weight models accept almost no real drafts; this drives the accept,
rollback and fold paths through the engine with exactly known acceptance.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from lightllm.engine.request import Request

# (window number of the request, number of drafts) -> index of the draft to corrupt, or None
Script = Callable[[int, int], "int | None"]


def rotating_script(window: int, num_drafts: int) -> int | None:
    """Every other window has one wrong draft, at a rotating position: windows keep 0 .. K drafts."""
    if num_drafts == 0 or window % 2 == 0:
        return None
    return (window // 2) % num_drafts


def seeded_script(window: int, num_drafts: int) -> int | None:
    """A fixed pseudo-random count of kept drafts per window number: for windows numbered by position, where a
    rotation can lock into one count (a window keeping c drafts puts the next c + 1 positions on), every run of a
    few windows still keeps each count 0 .. K."""
    kept = random.Random(window).randrange(num_drafts + 1)
    return None if kept == num_drafts else kept


class ScriptedDrafts:
    def __init__(
        self,
        continuations: dict[tuple[int, ...], list[int]],
        num_drafts: int,
        vocab_size: int,
        script: Script = rotating_script,
        by_position: bool = False,
    ):
        self.continuations, self.num_drafts, self.vocab_size, self.script = (
            continuations,
            num_drafts,
            vocab_size,
            script,
        )
        # `by_position`: a window's number is the output position of its first draft, not the count of windows
        # before it, and a window cut short is scripted as the full one: two runs whose windows were drafted by
        # different paths (the host, or the device for an overlapped step's successor, which proposes full windows
        # capped at the request's room) keep the same drafts
        self.by_position = by_position
        self._windows: dict[str, int] = {}
        # per request: tokens each of its decode windows must emit (accepted drafts + 1), in order
        self.expected_tokens_per_window: dict[str, list[int]] = {}

    def propose(self, reqs: list[Request]) -> None:
        for req in reqs:
            truth = self.continuations[tuple(req.prompt_ids)][len(req.output_ids) :]
            drafts = truth[: max(0, min(self.num_drafts, req.num_remaining_tokens - 1))]
            window = self.next_window(req.req_id, len(req.output_ids))
            if self.by_position:
                # a window cut short near the request's limit keeps what its full window would, up to its length
                # (as the device caps a full window's kept drafts at the request's room)
                wrong = self.script(window, self.num_drafts)
                wrong = None if wrong is None or wrong >= len(drafts) else wrong
            else:
                wrong = self.script(window, len(drafts))
            if wrong is not None:
                drafts[wrong] = (drafts[wrong] + 1) % self.vocab_size
            kept = len(drafts) if wrong is None else wrong
            self.expected_tokens_per_window.setdefault(req.req_id, []).append(kept + 1)
            req.draft_ids = drafts

    def next_window(self, req_id: str, position: int) -> int:
        """The number the script gets for `req_id`'s next window, whose first draft is output token `position`."""
        count = self._windows[req_id] = self._windows.get(req_id, -1) + 1
        return position if self.by_position else count

    def after_step(self, runner, rows, hidden) -> None:
        pass

    def flush(self, reqs=None) -> None:
        pass
