"""`SimulatedAcceptance` (benchmarks' controlled acceptance): each draft position is kept with the given probability
(a statistical bound per position), independent of the model, and what the engine emits stays consistent: accepted
positions emit their drafts, the next token is the model's own at the first rejected position."""

from __future__ import annotations

import math

import pytest
import torch

from lightllm.engine.engine import Engine
from lightllm.engine.request import Request
from lightllm.engine.sampling_params import SamplingParams
from lightllm.engine.speculative.acceptance import SimulatedAcceptance
from unit_tests.engine.fake_runner import FakeRunner
from unit_tests.engine.helpers import run

NUM_WINDOWS = 20_000
NUM_DRAFTS = 3
# a per-position rate is within this many standard deviations of p (a seeded run: the bound is for the reader)
SIGMAS = 5.0


def _position_rates(kept: list[int], num_drafts: int) -> list[tuple[float, int]]:
    """Per draft position j: the fraction of windows that kept it among those that reached it, and that count."""
    rates = []
    for j in range(1, num_drafts + 1):
        reached = sum(1 for n in kept if n >= j - 1)
        rates.append((sum(1 for n in kept if n >= j) / reached, reached))
    return rates


def _within_bound(kept: list[int], num_drafts: int, p: float) -> bool:
    return all(
        abs(rate - p) <= SIGMAS * math.sqrt(p * (1 - p) / reached)
        for rate, reached in _position_rates(kept, num_drafts)
    )


@pytest.mark.parametrize("p", [0.5, 0.7, 0.9], ids=lambda p: f"p{p}")
def test_num_kept_drafts_accepts_each_position_at_the_given_rate(p):
    # half the windows from distinct requests, half as successive windows of a few (both must be fair coins)
    ids = [f"r{i}" for i in range(NUM_WINDOWS // 2)] + [f"s{i % 10}" for i in range(NUM_WINDOWS // 2)]
    kept = SimulatedAcceptance(p, seed=11).num_kept_drafts(ids, [NUM_DRAFTS] * NUM_WINDOWS)
    assert all(0 <= n <= NUM_DRAFTS for n in kept)
    assert _within_bound(kept, NUM_DRAFTS, p)
    # the mean kept count is the truncated geometric's: p + p^2 + p^3
    expected_mean = sum(p**j for j in range(1, NUM_DRAFTS + 1))
    assert abs(sum(kept) / NUM_WINDOWS - expected_mean) < 0.03
    # twin: the same counts are out of bound for a rate 0.05 away
    assert not _within_bound(kept, NUM_DRAFTS, p - 0.05)
    assert not _within_bound(kept, NUM_DRAFTS, min(p + 0.05, 0.99))


def test_num_kept_drafts_edges_seed_and_short_windows():
    assert SimulatedAcceptance(0.0).num_kept_drafts(["a", "b", "c"], [4, 2, 0]) == [0, 0, 0]
    assert SimulatedAcceptance(1.0).num_kept_drafts(["a", "b", "c"], [4, 2, 0]) == [4, 2, 0]
    assert SimulatedAcceptance(0.6).num_kept_drafts([], []) == []
    counts = [5, 1, 0, 3] * 50
    ids = [f"r{i}" for i in range(len(counts))]
    a, b, c = (SimulatedAcceptance(0.6, seed=s).num_kept_drafts(ids, counts) for s in (3, 3, 4))
    assert a == b and a != c
    assert all(n <= limit for n, limit in zip(a, counts))
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"\[0, 1\]"):
            SimulatedAcceptance(bad)


def _window(req_id: str, start: int, drafts: list[int]) -> tuple:
    req = Request(req_id, [1, 2, 3], SamplingParams(temperature=0), frozenset(), 100)
    return req, start, len(drafts) + 1, drafts


def test_verify_emits_kept_drafts_then_the_models_token_at_the_first_rejected_position():
    torch.manual_seed(0)
    vocab = 50
    drafts = [[7, 8, 9], [], [4, 4]]
    windows, start = [], 0
    for i, d in enumerate(drafts):
        windows.append(_window(f"r{i}", start, d))
        start += len(d) + 1
    logits = torch.randn(start, vocab)
    acceptance = SimulatedAcceptance(0.5, seed=5)
    kept = SimulatedAcceptance(0.5, seed=5).num_kept_drafts([f"r{i}" for i in range(3)], [len(d) for d in drafts])
    results = acceptance.verify(windows, logits, sampler=None, row_context=None)
    for (_, first, _, d), n, result in zip(windows, kept, results):
        assert result.token_ids == [*d[:n], int(logits[first + n].argmax())]
    # twin: another seed keeps other counts, and the check above tells them apart
    ids = [f"r{i}" for i in range(60)]
    other = SimulatedAcceptance(0.5, seed=6).num_kept_drafts(ids, [len(d) for d in drafts] * 20)
    assert other != SimulatedAcceptance(0.5, seed=5).num_kept_drafts(ids, [len(d) for d in drafts] * 20)


def test_a_windows_coins_depend_on_its_request_and_index_not_on_the_batch():
    """The same request's n-th window keeps the same drafts whether it is drawn alone, beside other rows, in
    another order or as a shorter window (its count capped); twin: its next window draws new coins."""
    ids = [f"q{i}" for i in range(40)]
    together = SimulatedAcceptance(0.6, seed=9)
    first = together.num_kept_drafts(ids, [3] * 40)
    second = together.num_kept_drafts(ids, [3] * 40)
    alone = SimulatedAcceptance(0.6, seed=9)
    # each request on its own, in reverse order, the first windows as short ones
    for i in reversed(range(40)):
        assert alone.num_kept_drafts([ids[i]], [1]) == [min(first[i], 1)]
    assert [alone.num_kept_drafts([r], [3])[0] for r in ids] == second
    assert first != second


def test_verify_fails_only_the_window_with_nan_logits():
    windows = [_window("a", 0, [3, 4]), _window("b", 3, [5]), _window("c", 5, [])]
    logits = torch.randn(6, 20)
    logits[4, 7] = float("nan")
    results = SimulatedAcceptance(1.0).verify(windows, logits, sampler=None, row_context=None)
    assert results[1] is None
    assert results[0].token_ids == [3, 4, int(logits[2].argmax())]
    assert results[2].token_ids == [int(logits[5].argmax())]


class RandomDrafts:
    """Drafts unrelated to the model (uniform random tokens), recorded per request and window."""

    def __init__(self, num_drafts: int, vocab_size: int, seed: int):
        self.num_drafts, self.vocab_size = num_drafts, vocab_size
        self.generator = torch.Generator().manual_seed(seed)
        self.windows: dict[str, list[list[int]]] = {}

    def propose(self, reqs: list[Request]) -> None:
        for req in reqs:
            k = max(0, min(self.num_drafts, req.num_remaining_tokens - 1))
            req.draft_ids = torch.randint(self.vocab_size, (k,), generator=self.generator).tolist()
            self.windows.setdefault(req.req_id, []).append(req.draft_ids)

    def after_step(self, runner, rows, hidden) -> None:
        pass

    def flush(self, reqs=None) -> None:
        pass


def _simulated_engine(acceptance: SimulatedAcceptance) -> tuple[FakeRunner, Engine]:
    """An n-gram engine on the fake runner whose windows keep drafts at `acceptance`'s rate."""
    runner = FakeRunner(64, max_width=4, kv_tokens=4096)
    engine = Engine(
        runner,
        max_running_requests=8,
        chunked_prefill_size=64,
        max_req_total_len=256,
        spec_ngram=3,
        acceptance=acceptance,
    )
    return runner, engine


def _run_engine(p: float, params: SamplingParams, max_tokens_per_req: int = 60):
    runner, engine = _simulated_engine(SimulatedAcceptance(p, seed=1))
    drafts = RandomDrafts(3, runner.vocab_size, seed=2)
    engine.speculator = drafts
    chunks: dict[str, list[list[int]]] = {}
    original_emit = engine.emit

    def emit(req, token_ids, logits, start):
        outputs = original_emit(req, token_ids, logits, start)
        chunks.setdefault(req.req_id, []).append(outputs[0].token_ids)
        return outputs

    engine.emit = emit
    prompts = {f"r{i}": [(5 * i + j) % 60 + 1 for j in range(3 + i)] for i in range(6)}
    tokens, finished = run(engine, prompts, params)
    return runner, engine, drafts, prompts, chunks, tokens, finished


def test_engine_with_simulated_acceptance_emits_drafts_then_the_models_greedy_token():
    params = SamplingParams(temperature=0, max_tokens=60)
    runner, engine, drafts, prompts, chunks, tokens, finished = _run_engine(0.7, params)
    kept_per_window = []
    for rid, prompt in prompts.items():
        assert finished[rid].reason == "length" and len(tokens[rid]) == 60
        history = list(prompt)
        # the first chunk is the prefill's token; each later chunk is one verify window
        assert len(chunks[rid]) == len(drafts.windows[rid]) + 1
        history.append(chunks[rid][0][0])
        for chunk, window_drafts in zip(chunks[rid][1:], drafts.windows[rid]):
            n = len(chunk) - 1
            assert chunk[:n] == window_drafts[:n]
            history += chunk[:n]
            # the scheduler never drafts past the length limit: even the last window ends with the model's token
            assert chunk[n] == int(runner.next_logits(history).argmax()), (rid, len(history))
            history.append(chunk[n])
            kept_per_window.append((n, len(window_drafts)))
    # random drafts over 64 tokens: the model itself would keep almost none
    full = [n for n, k in kept_per_window if k == 3]
    assert len(full) > 100
    assert _within_bound(full, 3, 0.7)
    # kept drafts per full window: p + p^2 + p^3 = 1.53 of 3 (the model alone keeps almost none: the twin below)
    assert engine.stats.num_accepted_draft_tokens > 0.4 * engine.stats.num_draft_tokens


def test_engine_with_simulated_acceptance_twin_model_verification_rejects_random_drafts():
    """Twin of the test above: the same random drafts verified by the model keep (almost) nothing."""
    runner = FakeRunner(64, max_width=4, kv_tokens=4096)
    engine = Engine(runner, max_running_requests=8, chunked_prefill_size=64, max_req_total_len=256, spec_ngram=3)
    engine.speculator = RandomDrafts(3, runner.vocab_size, seed=2)
    run(engine, {"a": [1, 2, 3, 4]}, SamplingParams(temperature=0, max_tokens=60))
    assert engine.stats.num_accepted_draft_tokens < 0.2 * engine.stats.num_draft_tokens


def test_engine_with_simulated_acceptance_sampled_rows_are_seeded_and_keep_drafts():
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=123, max_tokens=40)
    first = _run_engine(0.7, params)
    second = _run_engine(0.7, params)
    assert first[5] == second[5]
    for rid, rows in first[4].items():
        for chunk, window_drafts in zip(rows[1:], first[2].windows[rid]):
            assert chunk[:-1] == window_drafts[: len(chunk) - 1]


def test_engine_simulated_acceptance_zero_and_one():
    params = SamplingParams(temperature=0, max_tokens=30)
    _, engine, *_ = _run_engine(0.0, params)
    assert engine.stats.num_accepted_draft_tokens == 0 and engine.stats.num_draft_tokens > 0
    _, engine, *_ = _run_engine(1.0, params)
    assert engine.stats.num_accepted_draft_tokens == engine.stats.num_draft_tokens > 0


class StopDrafts(RandomDrafts):
    """Every draft is `stop`, the request's stop token."""

    def __init__(self, num_drafts: int, stop: int):
        self.num_drafts, self.stop = num_drafts, stop

    def propose(self, reqs: list[Request]) -> None:
        for req in reqs:
            req.draft_ids = [self.stop] * max(0, min(self.num_drafts, req.num_remaining_tokens - 1))


@pytest.mark.parametrize("min_tokens", [6, 0])
def test_simulated_acceptance_keeps_no_stop_draft_before_min_tokens(min_tokens):
    """Drafts that are all the stop token, every draft kept: before min_tokens no window keeps one (each gives the
    model's greedy token with the stop token banned), the first window after keeps them and the request stops
    there. min_tokens 0 is the twin: the first window keeps a stop draft and ends the request at two tokens."""
    runner, engine = _simulated_engine(SimulatedAcceptance(1.0))
    prompt = [3, 1, 4, 1, 5]
    # the free greedy's second token: the ban changes what the model itself picks there
    first, stop = runner.greedy(prompt, 2)
    assert first != stop
    engine.speculator = StopDrafts(3, stop)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop], min_tokens=min_tokens)
    tokens, finished = run(engine, {"r": prompt}, params)
    held = runner.greedy(prompt, max(min_tokens, 1), {stop: float("-inf")} if min_tokens else None)
    assert tokens["r"] == [*held, stop] and finished["r"].reason == "stop"
