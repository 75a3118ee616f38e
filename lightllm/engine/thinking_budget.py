"""vLLM's `thinking_token_budget`: at most that many output tokens inside a reasoning block, then its end token is
forced. The block is open at the output's start when the prompt's last open token comes after its last end token
(the chat template turned thinking on), and opens wherever the output writes the open token; the budget counts the
tokens after the opening, and a block that has ended is never forced again.

The count over a request's committed output is kept on the request and advanced over the tokens added since the
last position (a step's cost does not grow with the output); a window's drafts before the position are walked on
top of it without being kept, since they may still be rejected."""

from __future__ import annotations

from dataclasses import dataclass

from lightllm.engine.sampling_params import SamplingParams


@dataclass
class ThinkingCount:
    """Where a request's reasoning block stands after its first `scanned` output tokens."""

    scanned: int = 0
    # tokens inside the open block so far; None while no block is open
    inside: int | None = None
    ended: bool = False

    @classmethod
    def of_prompt(cls, params: SamplingParams, prompt_ids: list[int]) -> ThinkingCount:
        opens = _last(prompt_ids, params.think_open_token)
        ends = _last(prompt_ids, params.think_end_token)
        return cls(inside=0 if opens > ends else None)

    def walk(self, tokens: list[int], params: SamplingParams) -> ThinkingCount:
        """This count advanced over `tokens` (self is left as it is)."""
        inside, ended = self.inside, self.ended
        for token in tokens:
            if ended:
                break
            if inside is not None:
                if token == params.think_end_token:
                    inside, ended = None, True
                else:
                    inside += 1
            elif token == params.think_open_token:
                inside = 0
        return ThinkingCount(self.scanned + len(tokens), inside, ended)

    def forces_end(self, params: SamplingParams) -> bool:
        return self.inside is not None and self.inside >= params.thinking_token_budget


def _last(ids: list[int], token: int | None) -> int:
    """The index of the last `token` in `ids`, -1 without one."""
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == token:
            return i
    return -1


def forced_end_token(
    params: SamplingParams, count: ThinkingCount, output_ids: list[int], drafts: list[int]
) -> tuple[ThinkingCount, int | None]:
    """The request's count advanced over its committed output (to keep), and the token this position must take:
    the block's end once the budget is spent inside it (the drafts before the position included), else None."""
    count = count.walk(output_ids[count.scanned :], params)
    here = count.walk(drafts, params) if drafts else count
    return count, params.think_end_token if here.forces_end(params) else None
