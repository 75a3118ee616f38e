"""A speculation strategy for tests whose drafts, and so whose accepted counts, are known in advance.

It drafts the request's known greedy continuation (from a cold run or transformers) and corrupts one draft of
some windows at a scripted position, so every window's outcome is fixed: a greedy verify keeps the drafts before
the first wrong one plus one token. Random-weight models accept almost no real drafts; this drives the accept,
rollback and fold paths through the engine with exactly known acceptance.
"""

from __future__ import annotations

from collections.abc import Callable

from lightllm.engine.request import Request

# (window number of the request, number of drafts) -> index of the draft to corrupt, or None
Script = Callable[[int, int], "int | None"]


def rotating_script(window: int, num_drafts: int) -> int | None:
    """Every other window has one wrong draft, at a rotating position: windows keep 0 .. K drafts."""
    if num_drafts == 0 or window % 2 == 0:
        return None
    return (window // 2) % num_drafts


class ScriptedDrafts:
    def __init__(
        self,
        continuations: dict[tuple[int, ...], list[int]],
        num_drafts: int,
        vocab_size: int,
        script: Script = rotating_script,
    ):
        self.continuations, self.num_drafts, self.vocab_size, self.script = (
            continuations,
            num_drafts,
            vocab_size,
            script,
        )
        self._windows: dict[str, int] = {}
        # per request: tokens each of its decode windows must emit (accepted drafts + 1), in order
        self.expected_tokens_per_window: dict[str, list[int]] = {}

    def propose(self, reqs: list[Request]) -> None:
        for req in reqs:
            truth = self.continuations[tuple(req.prompt_ids)][len(req.output_ids) :]
            drafts = truth[: max(0, min(self.num_drafts, req.num_remaining_tokens - 1))]
            window = self._windows[req.req_id] = self._windows.get(req.req_id, -1) + 1
            wrong = self.script(window, len(drafts))
            if wrong is not None:
                drafts[wrong] = (drafts[wrong] + 1) % self.vocab_size
            kept = len(drafts) if wrong is None else wrong
            self.expected_tokens_per_window.setdefault(req.req_id, []).append(kept + 1)
            req.draft_ids = drafts

    def after_step(self, runner, rows, hidden) -> None:
        pass

    def flush(self, reqs=None) -> None:
        pass
