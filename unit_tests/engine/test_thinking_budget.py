"""The thinking budget's count against a from-scratch reading of the rule over the whole output: random prompts,
outputs grown a few tokens at a time and drafts on top, the count kept incrementally as the engine keeps it.
Twin: a count that forgets the prompt's open block never forces."""

from __future__ import annotations

import random

from lightllm.engine.sampling_params import SamplingParams
from lightllm.engine.thinking_budget import ThinkingCount, forced_end_token

OPEN, END = 1, 2


def reference(prompt: list[int], output: list[int], budget: int) -> int | None:
    """END when the position after `output` lies inside a reasoning block (of the prompt's end, or opened by the
    output) whose first `budget` tokens are spent, and no block has ended in the output."""
    opened = max((i for i, t in enumerate(prompt) if t == OPEN), default=-1)
    ended = max((i for i, t in enumerate(prompt) if t == END), default=-1)
    start = 0 if opened > ended else None
    for i, t in enumerate(output):
        if start is not None and t == END:
            return None
        if start is None and t == OPEN:
            start = i + 1
    return END if start is not None and len(output) - start >= budget else None


def test_the_kept_count_forces_the_end_exactly_where_the_rule_does():
    rng = random.Random(5)
    forced_seen = 0
    for _ in range(400):
        budget = rng.randrange(0, 6)
        params = SamplingParams(thinking_token_budget=budget, think_open_token=OPEN, think_end_token=END)
        prompt = [rng.choice([0, 3, OPEN, END]) for _ in range(rng.randrange(1, 6))]
        count = ThinkingCount.of_prompt(params, prompt)
        output: list[int] = []
        for _ in range(rng.randrange(1, 8)):
            output += [rng.choice([0, 3, 4, OPEN, END]) for _ in range(rng.randrange(0, 3))]
            drafts = [rng.choice([0, 3, OPEN, END]) for _ in range(rng.randrange(0, 3))]
            count, forced = forced_end_token(params, count, output, drafts)
            assert count.scanned == len(output)
            assert forced == reference(prompt, output + drafts, budget), (prompt, output, drafts, budget)
            forced_seen += forced is not None
    assert forced_seen > 200


def test_teeth_a_count_without_the_prompts_open_block_never_forces():
    params = SamplingParams(thinking_token_budget=2, think_open_token=OPEN, think_end_token=END)
    prompt = [5, OPEN, 0]
    assert forced_end_token(params, ThinkingCount.of_prompt(params, prompt), [7, 7], [])[1] == END
    assert forced_end_token(params, ThinkingCount(), [7, 7], [])[1] is None
    # a closed block in the prompt leaves the output outside any block
    closed = ThinkingCount.of_prompt(params, [OPEN, 0, END])
    assert forced_end_token(params, closed, [7, 7, 7], [])[1] is None
