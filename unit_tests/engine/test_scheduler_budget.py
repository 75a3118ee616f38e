"""The step's token budget (`max_num_batched_tokens`), the per-request chunk cap (`chunked_prefill_size`) and the
prompt tokens of a step decoding for streaming requests (`max_mixed_prefill_tokens`), with exact expected batches on the fake runner: decode rows go first, prefill chunks fill the rest of the budget, and a
running request gets a token every step while a long prompt prefills beside it."""

from __future__ import annotations

import pytest

from lightllm.engine.engine import Engine
from lightllm.engine.messages import NewRequest, TokenChunk
from lightllm.engine.sampling_params import SamplingParams
from lightllm.engine.scheduler import Scheduler
from unit_tests.engine.fake_runner import FakeRunner


def _engine(runner: FakeRunner, budget: int, chunk: int | None, **kw) -> Engine:
    return Engine(
        runner,
        max_running_requests=4,
        chunked_prefill_size=chunk if chunk is not None else budget,
        max_num_batched_tokens=budget,
        max_req_total_len=128,
        **kw,
    )


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _batches(runner: FakeRunner) -> list[tuple]:
    """Each forward as (handles, query_lens, num_cached_tokens, num_prefill_rows)."""
    return [(b.req_handles, b.query_lens, b.num_cached_tokens, b.num_prefill_rows) for b in runner.batches]


def _step_all(engine: Engine, tokens: dict[str, list[int]]) -> None:
    """Step until idle, collecting each request's tokens."""
    while engine.has_work():
        _collect(engine, tokens)


def _collect(engine: Engine, tokens: dict[str, list[int]]) -> None:
    for out in engine.step():
        if isinstance(out, TokenChunk):
            tokens[out.req_id] += out.token_ids


def decode_rows_per_step(runner: FakeRunner) -> list[set[int]]:
    """The handles with a decode row in each model step (forward)."""
    return [set(b.req_handles[b.num_prefill_rows :]) for b in runner.batches]


def max_gap_in_steps(steps: list[set[int]], handle: int) -> int:
    """Most model steps between two consecutive decode rows of `handle` (1 = a row every step)."""
    mine = [i for i, rows in enumerate(steps) if handle in rows]
    return max((b - a for a, b in zip(mine, mine[1:])), default=0)


def test_prefill_chunks_fill_the_budget_capped_per_request():
    runner = FakeRunner(max_requests=4, kv_tokens=200)
    engine = _engine(runner, budget=10, chunk=4)
    prompts = {"A": [3, 1, 4, 1, 5, 9], "B": [2, 7, 1, 8, 2, 8, 1, 8, 2], "C": [1, 6, 1, 8, 0, 3, 3]}
    for rid, ids in prompts.items():
        engine.add_request(NewRequest(rid, ids, _params(3)))
    tokens = {rid: [] for rid in prompts}
    _step_all(engine, tokens)
    assert _batches(runner) == [
        # A and B take one 4-token chunk each (the cap), C the 2 tokens left of the budget of 10
        ([0, 1, 2], [4, 4, 2], [0, 0, 0], 3),
        # A's last 2 prompt tokens, B's next 4, C's next 4: 10 tokens again
        ([0, 1, 2], [2, 4, 4], [4, 4, 2], 3),
        # decode rows first (A), then B's last token and C's last one
        ([1, 2, 0], [1, 1, 1], [8, 6, 6], 2),
        ([0, 1, 2], [1, 1, 1], [7, 9, 7], 0),
        ([1, 2], [1, 1], [10, 8], 0),
    ]
    assert all(sum(b.query_lens) <= 10 for b in runner.batches)
    assert tokens == {rid: FakeRunner().greedy(ids, 3) for rid, ids in prompts.items()}


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_decode_rows_keep_their_pace_while_a_long_prompt_prefills(overlap):
    budget, chunk = 8, 8
    runner = FakeRunner(max_requests=4, kv_tokens=400)
    engine = _engine(runner, budget=budget, chunk=chunk, overlap_schedule=overlap)
    short, long_prompt = [5, 6, 7], [(7 * i + 3) % 61 + 1 for i in range(90)]
    engine.add_request(NewRequest("A", short, _params(30)))
    tokens = {"A": [], "B": []}
    # A prefills and decodes a few tokens before the long prompt arrives
    for _ in range(3):
        _collect(engine, tokens)
    engine.add_request(NewRequest("B", long_prompt, _params(2)))
    _step_all(engine, tokens)
    mixed = [b for b in runner.batches if b.num_prefill_rows and b.num_decode_rows]
    # B's 90 prompt tokens go 7 per step (the budget less A's decode row): 13 mixed steps
    assert [b.query_lens for b in mixed] == [[7, 1]] * 12 + [[6, 1]]
    assert all(sum(b.query_lens) <= budget for b in runner.batches)
    # A (handle 0) has a decode row in every model step from its first token to its last
    assert max_gap_in_steps(decode_rows_per_step(runner), 0) == 1
    assert tokens["A"] == FakeRunner().greedy(short, 30)
    assert tokens["B"] == FakeRunner().greedy(long_prompt, 2)


def test_gap_measure_sees_a_stall():
    # the twin of the pace check: a decode row skipped for two steps is a gap of three
    steps = [{0}, {0, 1}, {1}, {1}, {0}, {0}]
    assert max_gap_in_steps(steps, 0) == 3


def test_chunk_cap_defaults_to_the_budget():
    runner = FakeRunner(max_requests=2, kv_tokens=100)
    engine = Engine(runner, max_running_requests=2, chunked_prefill_size=6, max_req_total_len=64)
    assert (engine.scheduler.token_budget, engine.scheduler.chunked_prefill_size) == (6, 6)
    engine.add_request(NewRequest("A", list(range(1, 15)), _params(1)))
    while engine.has_work():
        engine.step()
    assert [b.query_lens for b in runner.batches] == [[6], [6], [2]]


@pytest.mark.parametrize(
    "budget, chunk", [(0, None), (8, 9), (8, 0)], ids=["no-budget", "chunk-over-budget", "no-chunk"]
)
def test_bad_budget_or_chunk_is_refused(budget, chunk):
    with pytest.raises(ValueError, match="token_budget|chunked_prefill_size"):
        Scheduler(FakeRunner(), 4, budget, 1, chunked_prefill_size=chunk)


def test_drafts_and_a_long_prompt_share_the_budget():
    # n-gram drafts widen A's windows; they come out of the same budget as B's chunks, and A still gets a window
    # (and at least one token) every step
    budget = 8
    runner = FakeRunner(max_requests=4, kv_tokens=400, max_width=3)
    engine = _engine(runner, budget=budget, chunk=budget, spec_ngram=2)
    cycle = [5, 6, 7, 43, 2, 4, 25, 0, 62, 4]
    engine.add_request(NewRequest("A", cycle, _params(24)))
    tokens = {"A": [], "B": []}
    while not tokens["A"]:
        _collect(engine, tokens)
    long_prompt = [(5 * i + 1) % 61 + 1 for i in range(50)]
    engine.add_request(NewRequest("B", long_prompt, _params(2)))
    _step_all(engine, tokens)
    mixed = [b for b in runner.batches if b.num_prefill_rows and b.num_decode_rows]
    assert len(mixed) >= 7 and all(sum(b.query_lens) == budget for b in mixed[:-1])
    assert all(sum(b.query_lens) <= budget for b in runner.batches)
    # some of A's windows carry drafts while B prefills
    assert any(b.query_lens[-1] > 1 for b in mixed)
    assert max_gap_in_steps(decode_rows_per_step(runner), 0) == 1
    assert tokens["A"] == FakeRunner().greedy(cycle, 24)
    assert tokens["B"] == FakeRunner().greedy(long_prompt, 2)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_a_step_decoding_for_streaming_requests_caps_its_prompt_tokens(overlap):
    # budget 12, mixed cap 4: B's 30-token prompt goes 11 tokens a step while nothing streams, 4 a step beside A's
    # decode rows once A has output
    runner = FakeRunner(max_requests=4, kv_tokens=400)
    engine = _engine(runner, budget=12, chunk=12, overlap_schedule=overlap, max_mixed_prefill_tokens=4)
    short, long_prompt = [5, 6, 7], [(7 * i + 3) % 61 + 1 for i in range(30)]
    engine.add_request(NewRequest("A", short, _params(12)))
    engine.add_request(NewRequest("B", long_prompt, _params(2)))
    tokens = {"A": [], "B": []}
    _step_all(engine, tokens)
    lens = [(b.query_lens, b.num_prefill_rows) for b in runner.batches]
    # step 1: A's prompt and 9 of B's (the whole budget: nothing streams yet); then A streams and B gets 4 a step
    assert lens[:4] == [([3, 9], 2), ([4, 1], 1), ([4, 1], 1), ([4, 1], 1)]
    assert all(sum(q[:p]) <= 4 for q, p in lens[2:] if p)
    assert max_gap_in_steps(decode_rows_per_step(runner), 0) == 1
    assert tokens["A"] == FakeRunner().greedy(short, 12)
    assert tokens["B"] == FakeRunner().greedy(long_prompt, 2)


def test_a_prompt_awaiting_its_first_token_does_not_cap_the_step():
    # with a prefix cache a prompt's last token runs as a decode row: A's, in step 2, has no output before it, so B
    # keeps the budget (8: its chunk ends at the checkpoint interval); once A streams, B gets 4 a step
    runner = FakeRunner(max_requests=4, kv_tokens=400)
    engine = _engine(runner, budget=12, chunk=12, max_mixed_prefill_tokens=4, prefix_cache_checkpoint_interval=8)
    engine.add_request(NewRequest("A", [5, 6, 7], _params(12)))
    engine.add_request(NewRequest("B", [(7 * i + 3) % 61 + 1 for i in range(30)], _params(2)))
    _step_all(engine, {"A": [], "B": []})
    assert [(b.query_lens, b.num_prefill_rows) for b in runner.batches[:4]] == [
        ([2, 8], 2),
        ([8, 1], 1),
        ([4, 1], 1),
        ([4, 1], 1),
    ]


@pytest.mark.parametrize(("chunk", "expected"), [(3, [3, 3, 1]), (None, [8, 1])], ids=["chunked", "twin-unchunked"])
def test_a_capped_step_cuts_each_prompt_to_the_mixed_chunk(chunk, expected):
    # budget 12, mixed cap 8, mixed chunk 3: once A streams, B and C prefill 3 tokens each a step (two chunks that
    # fit a prefill graph) instead of B taking the whole cap in one chunk; before that, nothing streams and B takes
    # the budget left
    runner = FakeRunner(max_requests=4, kv_tokens=400)
    engine = _engine(runner, budget=12, chunk=12, max_mixed_prefill_tokens=8, mixed_prefill_chunk=chunk)
    prompts = {
        "A": [5, 6, 7],
        "B": [(7 * i + 3) % 61 + 1 for i in range(30)],
        "C": [(5 * i + 2) % 59 + 1 for i in range(30)],
    }
    for req_id, prompt in prompts.items():
        engine.add_request(NewRequest(req_id, prompt, _params(4)))
    tokens = {req_id: [] for req_id in prompts}
    _step_all(engine, tokens)
    assert runner.batches[0].query_lens == [3, 9]
    assert runner.batches[2].query_lens == expected
    for req_id, prompt in prompts.items():
        assert tokens[req_id] == FakeRunner().greedy(prompt, 4)


def test_without_a_mixed_cap_the_same_prompt_takes_the_budget_left():
    # the twin: no cap, B takes what A's decode row leaves (11 of 12) in every step
    runner = FakeRunner(max_requests=4, kv_tokens=400)
    engine = _engine(runner, budget=12, chunk=12)
    engine.add_request(NewRequest("A", [5, 6, 7], _params(12)))
    engine.add_request(NewRequest("B", [(7 * i + 3) % 61 + 1 for i in range(30)], _params(2)))
    _step_all(engine, {"A": [], "B": []})
    assert [b.query_lens for b in runner.batches[:3]] == [[3, 9], [11, 1], [10, 1]]


@pytest.mark.parametrize("cap", [0, 13])
def test_a_mixed_cap_outside_the_budget_is_refused(cap):
    with pytest.raises(ValueError, match="mixed_prefill_tokens"):
        Scheduler(FakeRunner(), 4, 12, 1, mixed_prefill_tokens=cap)
