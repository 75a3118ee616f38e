"""`thinking_token_budget` through the engine with the real runner on a tiny Qwen3.5 against transformers: a greedy
request whose prompt ends inside a reasoning block decodes transformers' greedy with the block's end forced once the
budget's tokens are out, beside a request whose prompt closed its block (never forced) in the same steps, in every
state mode, plain and with MTP drafts (a draft past the budget is rejected). Twin: a sampler that ignores the force
gives the unforced text."""

from __future__ import annotations

import pytest

from lightllm.engine import sampler
from lightllm.engine.messages import NewRequest
from lightllm.engine.sampling_params import SamplingParams
from unit_tests.models.conftest import case_oracle
from unit_tests.models.test_device_drafts_engine import _engine, engine_tokens

CASE = "qwen3_5-hv2"
OPEN = 11
NUM_TOKENS, BUDGET = 10, 4


@pytest.fixture(scope="module")
def reference():
    oracle = case_oracle(CASE)
    thinking, closed = [5, 6, 7, OPEN], [5, OPEN, 6, 0, 9]
    plain = oracle.greedy(thinking, NUM_TOKENS)
    # an end token the unforced continuation does not write before or at the budget's end
    end = next(t for t in range(20, 200) if t not in plain[: BUDGET + 1] and t != OPEN)
    closed = closed[:3] + [end] + closed[3:]
    forced = plain[:BUDGET] + [end]
    forced += oracle.greedy(thinking + forced, NUM_TOKENS - len(forced))
    assert forced != plain
    expected = {"thinking": forced, "closed": oracle.greedy(closed, NUM_TOKENS)}
    prompts = {"thinking": thinking, "closed": closed}
    return prompts, end, expected, {"thinking": plain, "closed": expected["closed"]}


def run(mode: str, mtp_step: int, prompts, end: int, graphs: bool = True, device: str = "cpu"):
    engine = _engine(mode, mtp_step, fixed_buffers=graphs, device=device)
    engine.overlap_schedule = graphs
    params = SamplingParams(
        temperature=0,
        max_tokens=NUM_TOKENS,
        ignore_eos=True,
        thinking_token_budget=BUDGET,
        think_open_token=OPEN,
        think_end_token=end,
    )
    return engine_tokens(engine, {rid: (prompt, params) for rid, prompt in prompts.items()})


@pytest.mark.parametrize("mode, mtp_step", [("native", 0), ("replay", 0), ("native", 2), ("compact", 2), ("replay", 2)])
def test_the_budget_forces_the_end_as_transformers_greedy_with_it(mode, mtp_step, reference):
    prompts, end, expected, _ = reference
    assert run(mode, mtp_step, prompts, end) == expected


def test_teeth_a_sampler_that_ignores_the_force_gives_the_unforced_text(reference, monkeypatch):
    prompts, end, _, unforced = reference
    monkeypatch.setattr(sampler, "apply_forced", lambda logits, rows: logits)
    assert run("replay", 0, prompts, end) == unforced


def test_a_budget_without_an_end_token_fails_its_request_alone():
    engine = _engine("replay", 0)
    params = SamplingParams(max_tokens=4, thinking_token_budget=2)
    refused = engine.add_request(NewRequest("x", [1, 2, OPEN], params))
    assert len(refused) == 1 and refused[0].reason == "error" and "think_end_token" in refused[0].error
