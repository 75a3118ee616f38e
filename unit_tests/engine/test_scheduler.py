"""Scheduler decisions with exact expected batches: chunked prefill, admission by slots and KV, preemption."""

from __future__ import annotations

from lightllm.engine.messages import NewRequest
from lightllm.engine.sampling_params import SamplingParams
from unit_tests.engine.fake_runner import FakeRunner
from unit_tests.engine.helpers import make_engine


def _batches(runner: FakeRunner) -> list[tuple]:
    """Each forward as (handles, query_lens, num_cached_tokens, num_prefill_rows, prefill_is_last_chunk)."""
    return [
        (b.req_handles, b.query_lens, b.num_cached_tokens, b.num_prefill_rows, b.prefill_is_last_chunk)
        for b in runner.batches
    ]


def _drain(engine, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for rid, ids in prompts.items():
        engine.add_request(NewRequest(rid, ids, params))
    tokens = {rid: [] for rid in prompts}
    while engine.has_work():
        for out in engine.step():
            tokens[out.req_id] += getattr(out, "token_ids", [])
    return tokens


def test_schedule_chunked_prefill_and_slot_admission():
    runner = FakeRunner(max_requests=2, kv_tokens=100)
    engine = make_engine(runner, max_running_requests=4, chunked_prefill_size=8, max_req_total_len=100)
    _drain(engine, {"A": list(range(1, 13)), "B": [1, 2, 3, 4, 5], "C": [7, 8, 9]}, max_tokens=2)
    assert _batches(runner) == [
        # A's 12-token prompt is split 8 + 4 by the token budget
        ([0], [8], [0], 1, [False]),
        # the rest of A, then B admitted with the remaining budget
        ([0, 1], [4, 4], [8, 0], 2, [True, False]),
        # prefill rows first (end of B), then A's decode row; C waits: both state slots are taken
        ([1, 0], [1, 1], [4, 12], 1, [True]),
        # A finished and returned slot 0, which C now takes
        ([0, 1], [3, 1], [0, 5], 1, [True]),
        ([0], [1], [3], 0, []),
    ]
    assert runner.num_free_requests() == 2 and runner.num_free_kv_tokens() == 100


def test_schedule_admission_waits_for_kv():
    runner = FakeRunner(max_requests=4, kv_tokens=30)
    engine = make_engine(runner, chunked_prefill_size=64, max_req_total_len=30)
    _drain(engine, {"A": [1] * 20, "B": [2] * 20}, max_tokens=2)
    # B's 20 prompt tokens do not fit beside A's 20 (+ one decode window of headroom) in 30 KV tokens
    assert _batches(runner) == [
        ([0], [20], [0], 1, [True]),
        ([0], [1], [20], 0, []),
        ([0], [20], [0], 1, [True]),
        ([0], [1], [20], 0, []),
    ]


def test_schedule_preemption_by_recompute():
    runner = FakeRunner(max_requests=2, kv_tokens=12)
    engine = make_engine(runner, chunked_prefill_size=16, max_req_total_len=12)
    prompts = {"A": [1, 2, 3, 4], "B": [4, 3, 2, 1]}
    tokens = _drain(engine, prompts, max_tokens=6)
    assert _batches(runner) == [
        ([0, 1], [4, 4], [0, 0], 2, [True, True]),
        ([0, 1], [1, 1], [4, 4], 0, []),
        ([0, 1], [1, 1], [5, 5], 0, []),
        # 12 KV tokens held, two decode rows need 2 more: B (admitted last) is preempted
        ([0], [1], [6], 0, []),
        ([0], [1], [7], 0, []),
        ([0], [1], [8], 0, []),
        # B comes back in slot 0 and re-prefills its prompt plus its 3 generated tokens
        ([0], [7], [0], 1, [True]),
        ([0], [1], [7], 0, []),
        ([0], [1], [8], 0, []),
    ]
    assert engine.scheduler.num_preemptions == 1
    assert tokens == {rid: FakeRunner().greedy(ids, 6) for rid, ids in prompts.items()}


def test_schedule_drafts_limited_by_remaining_tokens_and_width():
    runner = FakeRunner(max_width=3, kv_tokens=100)
    engine = make_engine(runner, spec_ngram=4, max_req_total_len=100)
    assert engine.scheduler.max_width == 3
    # the fake model loops through a 7-token cycle from this prompt, so drafts are always available
    _drain(engine, {"A": [5, 6, 7, 43, 2, 4, 25, 0, 62, 4]}, max_tokens=7)
    widths = [b.query_lens[0] for b in runner.batches[1:]]
    # no earlier match for the first tail; then width ≤ runner.max_width, and no drafts past max_tokens
    assert widths == [1, 3, 2]


def test_capacity_report_names_the_binding_limit():
    engine = make_engine(FakeRunner(max_requests=6, kv_tokens=1000), max_running_requests=8, max_req_total_len=250)
    report = engine.capacity_report()
    assert report.startswith("up to 6 concurrent requests")
    assert "4 full-length requests fit at once, limited by KV tokens (1000) / max_req_total_len (250)" in report


def test_held_requests_get_no_row_and_cost_no_preemption():
    """A running request whose token in flight is its last (`held`) gets no row while the others are scheduled as
    usual; a plan left empty by held requests preempts nobody. Twin: without `held` the same request gets its
    decode row."""
    from lightllm.engine.request import Request
    from lightllm.engine.scheduler import Scheduler

    runner = FakeRunner(max_requests=4, kv_tokens=100)
    sched = Scheduler(runner, max_running_requests=4, token_budget=16, max_width=1)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    a, b, c = (Request(rid, [1, 2, 3], params, frozenset(), 4) for rid in "ABC")
    for req in (a, b):
        sched.add(req)
    plan = sched.schedule()
    assert [row.req for row in plan.prefill] == [a, b]
    for req in (a, b):
        req.num_computed_tokens = req.num_prefill_tokens
        req.output_ids.append(7)
    sched.add(c)
    plan = sched.schedule(held=[a])
    assert [row.req for row in plan.decode] == [b] and [row.req for row in plan.prefill] == [c]
    twin = Scheduler(runner, max_running_requests=4, token_budget=16, max_width=1)
    twin.running = [a, b]
    assert [row.req for row in twin.schedule().decode] == [a, b]
    # a request starved of KV, planned while a step is in flight: an empty plan, nobody sent back to the queue;
    # planned after the read-back (preemption allowed) it is preempted so that something can progress
    for may_preempt in (False, True):
        starved = FakeRunner(max_requests=4, kv_tokens=4)
        lone = Scheduler(starved, max_running_requests=4, token_budget=16, max_width=1)
        d = Request("D", [1] * 10, params, frozenset(), 4)
        d.handle = starved.add_request()
        starved.cache[d.handle] = [1] * 4
        d.num_computed_tokens, d.num_prefill_tokens = 4, 10
        lone.running = [d]
        plan = lone.schedule(may_preempt=may_preempt)
        assert plan.is_empty and (plan.preempted == [d]) == may_preempt, may_preempt
