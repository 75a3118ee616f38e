"""A logits row holding +inf or NaN, or nothing finite (`lightllm.engine.logits_check`), ends its request alone
with reason `error`: checked on crafted rows and through the engine's overlapped decode steps, where a request's
row turns +inf mid-stream while another request keeps its exact tokens, and through a greedy drafted window
verified on the device (`verify.window_nan_counts`)."""

from __future__ import annotations

import torch

from lightllm.engine.engine import Engine
from lightllm.engine.logits_check import NONFINITE_LOGITS_ERROR, nonfinite_rows
from lightllm.engine.sampling_params import SamplingParams
from unit_tests.engine.fake_runner import FakeRunner
from unit_tests.engine.helpers import run

# a request whose prompt starts with MARK gets a +inf logit once its history reaches BAD_LEN tokens
MARK, BAD_LEN = 63, 7


class InfRunner(FakeRunner):
    def next_logits(self, history: list[int]) -> torch.Tensor:
        logits = super().next_logits(history)
        if history[0] == MARK and len(history) >= BAD_LEN:
            logits[5] = float("inf")
        return logits


def test_nonfinite_rows_flags_nan_posinf_and_rows_with_nothing_finite():
    torch.manual_seed(0)
    rows = torch.randn(5, 11)
    rows[1, [2, 7]] = float("-inf")
    rows[2, 4] = float("nan")
    rows[3, 9] = float("inf")
    rows[4] = float("-inf")
    assert nonfinite_rows(rows).tolist() == [False, False, True, True, True]
    # in half precision too, and a NaN beside a +inf or after the maximum
    more = rows.clone()
    more[0, 3], more[0, 8] = float("nan"), float("inf")
    more[1, 10] = float("nan")
    assert nonfinite_rows(more.bfloat16()).tolist() == [True, True, True, True, True]
    # the check it replaces saw only NaN: a +inf row went on to a NaN softmax
    assert torch.isnan(rows).any(dim=-1).tolist() == [False, False, True, False, False]
    assert torch.isnan(torch.softmax(rows[3], dim=-1)).any()


def test_an_infinite_row_ends_only_its_request_under_overlap():
    good_prompt, bad_prompt = [1, 2, 1, 2], [MARK, 3, 4]
    expected = FakeRunner().greedy(good_prompt, 16)
    runner = InfRunner()
    engine = Engine(
        runner, max_running_requests=8, chunked_prefill_size=64, max_req_total_len=256, overlap_schedule=True
    )
    launches = []
    launch = engine.overlap.launch
    engine.overlap.launch = lambda *a, **kw: launches.append(1) or launch(*a, **kw)
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=16, ignore_eos=True)
    tokens, finished = run(engine, {"bad": bad_prompt, "good": good_prompt}, params)
    assert launches, "no step was overlapped: the test proved nothing"
    assert finished["bad"].reason == "error" and finished["bad"].error == NONFINITE_LOGITS_ERROR
    # it got the tokens before its row turned infinite, none after
    assert len(bad_prompt) + len(tokens["bad"]) == BAD_LEN
    assert finished["good"].reason == "length"
    greedy, _ = run(
        Engine(
            FakeRunner(), max_running_requests=8, chunked_prefill_size=64, max_req_total_len=256, overlap_schedule=True
        ),
        {"good": good_prompt},
        params,
    )
    assert tokens["good"] == greedy["good"]
    assert runner.num_free_requests() == 8
    # teeth: the marked prompt's row is infinite indeed, the good prompt's never
    assert nonfinite_rows(InfRunner().next_logits([MARK, 3, 4, 5, 6, 7, 8])[None]).item()
    assert expected and not nonfinite_rows(InfRunner().next_logits(good_prompt + expected)[None]).item()


def test_an_infinite_row_in_a_drafted_window_ends_only_its_request():
    good_prompt, bad_prompt = [1, 2, 1, 2, 1, 2], [MARK, 3, 4]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    make = lambda runner: Engine(
        runner,
        max_running_requests=8,
        chunked_prefill_size=64,  # noqa: E731
        max_req_total_len=256,
        spec_ngram=2,
    )
    tokens, finished = run(make(InfRunner(max_width=3)), {"bad": bad_prompt, "good": good_prompt}, params)
    assert finished["bad"].reason == "error"
    assert len(bad_prompt) + len(tokens["bad"]) < BAD_LEN + 3
    cold, _ = run(make(FakeRunner(max_width=3)), {"good": good_prompt}, params)
    assert finished["good"].reason == "length" and tokens["good"] == cold["good"]
