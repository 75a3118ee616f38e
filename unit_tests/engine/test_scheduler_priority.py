"""Priorities in the scheduler, with exact expected batches on the fake runner: the waiting queue admits by
priority then arrival, a request that cannot be admitted preempts a running one of a worse priority (which later
re-prefills and still gives the reference tokens), and KV pressure preempts the worst priority first. Twins: equal
priorities keep arrival order and preempt nobody for a newcomer."""

from __future__ import annotations

from lightllm.engine.messages import Finished, NewRequest
from lightllm.engine.sampling_params import SamplingParams
from unit_tests.engine.fake_runner import FakeRunner
from unit_tests.engine.helpers import make_engine

PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def _finish_order(engine, submits: dict[int, list[tuple[str, list[int], int]]], params=PARAMS):
    """Run to the end, submitting `submits[k]` (id, prompt, priority) before step k; the ids in finishing order and
    every request's tokens."""
    order, tokens, step = [], {}, 0
    while step in submits or engine.has_work() or any(k > step for k in submits):
        for rid, prompt, priority in submits.get(step, []):
            assert engine.add_request(NewRequest(rid, prompt, params, priority=priority)) == []
            tokens[rid] = []
        for out in engine.step():
            if isinstance(out, Finished):
                order.append(out.req_id)
            else:
                tokens[out.req_id] += out.token_ids
        step += 1
    return order, tokens


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    prompts = [("A", [1, 2], 5), ("B", [3, 4], 5), ("C", [5, 6], 0), ("D", [7, 8], 5), ("E", [9, 1], 0)]
    engine = make_engine(FakeRunner(max_requests=1, kv_tokens=100), max_req_total_len=100)
    order, tokens = _finish_order(engine, {0: prompts})
    assert order == ["C", "E", "A", "B", "D"]
    assert tokens == {rid: FakeRunner().greedy(ids, 3) for rid, ids, _ in prompts}
    # twin: the same arrivals at equal priorities run in arrival order
    engine = make_engine(FakeRunner(max_requests=1, kv_tokens=100), max_req_total_len=100)
    assert _finish_order(engine, {0: [(rid, ids, 0) for rid, ids, _ in prompts]})[0] == ["A", "B", "C", "D", "E"]


def test_a_better_priority_preempts_a_running_request_that_holds_the_only_slot():
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runner = FakeRunner(max_requests=1, kv_tokens=100)
    engine = make_engine(runner, max_req_total_len=100)
    order, tokens = _finish_order(engine, {0: [("low", [1, 2, 3], 3)], 3: [("high", [4, 5], 0)]}, params)
    assert order == ["high", "low"]
    assert engine.scheduler.num_preemptions == 1
    # the preempted request re-prefilled its prompt and output and still gives the reference tokens
    assert tokens == {"low": FakeRunner().greedy([1, 2, 3], 8), "high": FakeRunner().greedy([4, 5], 8)}
    assert runner.num_free_requests() == 1 and runner.num_free_kv_tokens() == 100
    # twin: at equal priority the newcomer waits for the slot
    engine = make_engine(FakeRunner(max_requests=1, kv_tokens=100), max_req_total_len=100)
    order, _ = _finish_order(engine, {0: [("low", [1, 2, 3], 3)], 3: [("high", [4, 5], 3)]}, params)
    assert order == ["low", "high"] and engine.scheduler.num_preemptions == 0


def test_kv_pressure_preempts_the_worst_priority_first():
    """Two requests decode until 12 KV tokens run out: the one of worse priority goes, though admitted first (in
    arrival order the later admission would)."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [("first", [1, 2, 3, 4], 7), ("second", [4, 3, 2, 1], 1)]
    for priorities, victim in (((7, 1), "first"), ((0, 0), "second")):
        runner = FakeRunner(max_requests=2, kv_tokens=12)
        engine = make_engine(runner, chunked_prefill_size=16, max_req_total_len=12)
        submits = {0: [(rid, ids, p) for (rid, ids, _), p in zip(prompts, priorities)]}
        order, tokens = _finish_order(engine, submits, params)
        assert engine.scheduler.num_preemptions == 1
        # the victim finishes last: it waited for the other one's KV
        assert order[-1] == victim
        assert tokens == {rid: FakeRunner().greedy(ids, 6) for rid, ids, _ in prompts}


def test_a_priority_out_of_int32_fails_its_request_alone():
    engine = make_engine(FakeRunner(kv_tokens=100), max_req_total_len=100)
    refused = engine.add_request(NewRequest("x", [1, 2], PARAMS, priority=2**31))
    assert len(refused) == 1 and refused[0].reason == "error" and "priority must be an integer" in refused[0].error
    assert engine.add_request(NewRequest("y", [1, 2], PARAMS, priority=-(2**31))) == []
