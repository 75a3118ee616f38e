"""`min_tokens` through the engine with the real runner on a tiny Qwen3.5 against transformers: a greedy request
whose stop tokens are the third token of its free continuation and a token it reaches later decodes, with
min_tokens 6, to transformers' greedy with those tokens banned from its first six positions, and stops at the
first of them after; beside an unconstrained request in the same steps, in every state mode, plain (overlap on) and
with MTP drafts (each window position bans by its own output count). Twin: without min_tokens the request stops
at its third token."""

from __future__ import annotations

import pytest

from lightllm.engine.messages import Finished, NewRequest, TokenChunk
from lightllm.engine.sampling_params import SamplingParams
from unit_tests.models.conftest import case_oracle
from unit_tests.models.test_device_drafts_engine import _engine

CASE = "qwen3_5-hv2"
HELD, FREE = [5, 6, 7, 8, 9], [3, 1, 4, 1, 5, 9, 2, 6]
MAX_TOKENS, MIN_TOKENS = 14, 6


def held_greedy(oracle, prompt: list[int], stops: set[int], min_tokens: int, max_tokens: int) -> list[int]:
    """transformers' greedy continuation with `stops` banned before `min_tokens` tokens, ending on one after."""
    ids = list(prompt)
    while len(ids) - len(prompt) < max_tokens:
        logits = oracle.prefill_logits(ids)[0, -1].clone()
        if len(ids) - len(prompt) < min_tokens:
            logits[list(stops)] = float("-inf")
        ids.append(int(logits.argmax()))
        if ids[-1] in stops:
            break
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def reference():
    oracle = case_oracle(CASE)
    free = oracle.greedy(HELD, MAX_TOKENS)
    first = free[2]
    assert first not in free[:2], "the stop token must first occur at the third position"
    held = held_greedy(oracle, HELD, {first}, MIN_TOKENS, MAX_TOKENS)
    # a second stop token the held continuation reaches after min_tokens, so the request ends by a stop
    for later in held[MIN_TOKENS + 1 :]:
        stops = {first, later}
        expected = held_greedy(oracle, HELD, stops, MIN_TOKENS, MAX_TOKENS)
        if expected[-1] in stops and len(expected) > MIN_TOKENS:
            return sorted(stops), expected, free[:3], oracle.greedy(FREE, MAX_TOKENS)
    raise AssertionError(f"no second stop token ends {held}")


def run(mode: str, mtp_step: int, stops: list[int], min_tokens: int, device: str = "cpu", graphs: bool = True):
    """The two requests' tokens and finish reasons; `graphs`: decode steps through the fixed buffers (CUDA graphs
    on CUDA) with overlap scheduling, else eager synchronous steps."""
    engine = _engine(mode, mtp_step, fixed_buffers=graphs, device=device)
    engine.overlap_schedule = graphs
    held = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop_token_ids=stops, min_tokens=min_tokens
    )
    free = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert engine.add_request(NewRequest("held", HELD, held)) == []
    assert engine.add_request(NewRequest("free", FREE, free)) == []
    out, finished = {"held": [], "free": []}, {}
    while engine.has_work():
        for o in engine.step():
            if isinstance(o, TokenChunk):
                out[o.req_id] += o.token_ids
            elif isinstance(o, Finished):
                finished[o.req_id] = o.reason
    return out, finished


# compact differs from native only under speculation (the server refuses it without)
@pytest.mark.parametrize("mode, mtp_step", [("native", 0), ("replay", 0), ("native", 2), ("compact", 2), ("replay", 2)])
def test_min_tokens_holds_the_stop_token_back_as_transformers_does(mode, mtp_step, reference):
    stops, expected, _, free = reference
    out, finished = run(mode, mtp_step, stops, MIN_TOKENS)
    assert out["held"] == expected and finished["held"] == "stop"
    assert out["free"] == free and finished["free"] == "length"


def test_teeth_without_min_tokens_the_request_stops_at_its_third_token(reference):
    stops, expected, first_three, _ = reference
    out, finished = run("replay", 0, stops, 0)
    assert out["held"] == first_three != expected and finished["held"] == "stop"
