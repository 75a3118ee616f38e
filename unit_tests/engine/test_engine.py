"""Engine.step end to end against the fake runner: batching, chunking, speculation, stops, aborts, failures."""

from __future__ import annotations

import random

import pytest

from lightllm.engine.messages import NewRequest
from lightllm.engine.sampling_params import SamplingParams
from unit_tests.engine.fake_runner import FakeRunner
from unit_tests.engine.helpers import make_engine, run

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _prompts(num: int, seed: int = 1, vocab: int = 64) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for i in range(num)}


def test_engine_greedy_single_request_matches_reference():
    runner = FakeRunner()
    tokens, finished = run(make_engine(runner), {"a": [3, 1, 4, 1, 5]}, GREEDY)
    assert tokens["a"] == FakeRunner().greedy([3, 1, 4, 1, 5], 24)
    assert finished["a"].reason == "length" and finished["a"].num_output_tokens == 24


@pytest.mark.parametrize(
    "spec", [{}, {"spec_ngram": 3}, {"mtp_step": 2}, {"mtp_step": 4}], ids=["plain", "ngram3", "mtp2", "mtp4"]
)
@pytest.mark.parametrize("budget", [7, 64], ids=["chunk7", "chunk64"])
def test_engine_batched_equals_one_by_one(spec, budget):
    prompts = _prompts(12)
    ref = FakeRunner()
    expected = {rid: ref.greedy(ids, 24) for rid, ids in prompts.items()}
    width = max(spec.values(), default=0) + 1
    runner = FakeRunner(max_requests=5, kv_tokens=600, max_width=width)
    engine = make_engine(runner, chunked_prefill_size=budget, **spec)
    tokens, finished = run(engine, prompts, GREEDY)
    assert tokens == expected
    assert all(f.reason == "length" for f in finished.values())
    assert runner.num_free_requests() == 5 and runner.num_free_kv_tokens() == 600
    if spec:
        assert engine.stats.num_accepted_draft_tokens > 0
        assert engine.stats.num_accepted_draft_tokens < engine.stats.num_draft_tokens


def test_engine_speculation_reduces_steps():
    # the fake model falls into a 7-token cycle right away from this prompt, so n-gram drafts hit
    prompts = {"a": [5, 6, 7]}
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    plain = make_engine(FakeRunner())
    run(plain, prompts, params)
    spec = make_engine(FakeRunner(max_width=5), spec_ngram=4)
    tokens, _ = run(spec, prompts, params)
    assert tokens["a"] == FakeRunner().greedy(prompts["a"], 60)
    assert plain.stats.num_steps == 60
    assert spec.stats.num_steps < 30


def test_engine_preemption_recomputes_exactly():
    prompts = _prompts(6, seed=3)
    expected = {rid: FakeRunner().greedy(ids, 40) for rid, ids in prompts.items()}
    # 6 requests of up to 80 tokens in 200 KV tokens: decode growth forces preemption
    runner = FakeRunner(max_requests=6, kv_tokens=200, max_width=3)
    engine = make_engine(runner, max_req_total_len=100, spec_ngram=2)
    tokens, _ = run(engine, prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert engine.scheduler.num_preemptions > 0
    assert tokens == expected
    assert runner.num_free_kv_tokens() == 200


def test_engine_stop_token_and_eos():
    prompt = [5, 6, 7]
    ref = FakeRunner().greedy(prompt, 24)
    stop = ref[5]
    first = ref.index(stop)
    engine = make_engine(FakeRunner())
    tokens, finished = run(engine, {"a": prompt}, SamplingParams(temperature=0, max_tokens=24), eos=[stop])
    assert tokens["a"] == ref[: first + 1]
    assert finished["a"].reason == "stop" and finished["a"].stop_token_id == stop
    tokens, finished = run(
        engine, {"b": prompt}, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), eos=[stop]
    )
    assert tokens["b"] == ref and finished["b"].reason == "length"
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop])
    tokens, finished = run(engine, {"c": prompt}, params)
    assert tokens["c"] == ref[: first + 1] and finished["c"].reason == "stop"


def test_engine_stop_token_inside_accepted_window():
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    ref = FakeRunner().greedy(prompt, 24)
    stop = ref[10]
    engine = make_engine(FakeRunner(max_width=5), spec_ngram=4)
    tokens, finished = run(engine, {"a": prompt}, SamplingParams(temperature=0, max_tokens=24), eos=[stop])
    assert tokens["a"] == ref[: ref.index(stop) + 1]
    assert finished["a"].reason == "stop"


def test_engine_max_req_total_len_caps_output():
    engine = make_engine(FakeRunner(), max_req_total_len=20)
    tokens, finished = run(engine, {"a": list(range(15))}, SamplingParams(temperature=0, max_tokens=100))
    assert len(tokens["a"]) == 5 and finished["a"].reason == "length"


def test_engine_abort_returns_every_slot():
    runner = FakeRunner(max_requests=4, kv_tokens=300, max_width=3)
    engine = make_engine(runner, spec_ngram=2)
    for i in range(6):
        engine.add_request(NewRequest(f"r{i}", [i + 1] * 10, SamplingParams(temperature=0, max_tokens=50)))
    for _ in range(5):
        engine.step()
    assert runner.num_free_requests() == 0
    finished = [out for rid in ["r0", "r1", "r2", "r3", "r4", "r5"] for out in engine.abort(rid)]
    assert [f.reason for f in finished] == ["abort"] * 6
    assert not engine.has_work()
    assert runner.num_free_requests() == 4 and runner.num_free_kv_tokens() == 300
    assert engine.abort("r0") == []


def test_engine_forward_failure_finishes_batch_with_error_and_continues():
    expected = FakeRunner().greedy([1, 2], 24)
    fail_token = min(set(range(64)) - set(expected) - {1, 2})
    runner = FakeRunner(fail_token=fail_token)
    engine = make_engine(runner)
    tokens, finished = run(engine, {"bad": [fail_token, 1, 2]}, GREEDY)
    # the client gets a message, not the exception's text (that goes to the engine log)
    assert finished["bad"].reason == "error" and finished["bad"].error == "the model step failed (see the engine log)"
    assert runner.num_free_requests() == 8
    tokens, finished = run(engine, {"good": [1, 2]}, GREEDY)
    assert tokens["good"] == expected


def test_engine_nan_logits_fail_only_that_request():
    expected = FakeRunner().greedy([1, 2, 1, 2], 24)
    nan_token = min(set(range(64)) - set(expected) - {1, 2})
    runner = FakeRunner(nan_token=nan_token, max_width=3)
    engine = make_engine(runner, spec_ngram=2)
    tokens, finished = run(engine, {"bad": [nan_token, 1], "good": [1, 2, 1, 2]}, GREEDY)
    assert finished["bad"].reason == "error" and "NaN" in finished["bad"].error
    assert tokens["good"] == expected
    assert runner.num_free_requests() == 8


def test_engine_rejects_invalid_requests():
    engine = make_engine(FakeRunner(), max_req_total_len=10)
    bad = {"empty": [], "long": list(range(10)), "vocab": [64]}
    _, finished = run(engine, bad, GREEDY)
    assert {rid: f.reason for rid, f in finished.items()} == {"empty": "error", "long": "error", "vocab": "error"}
    out = engine.add_request(NewRequest("dup", [1], GREEDY)) + engine.add_request(NewRequest("dup", [1], GREEDY))
    assert len(out) == 1 and "duplicate" in out[0].error


def test_engine_refuses_max_req_total_len_beyond_kv():
    with pytest.raises(ValueError, match="max_req_total_len"):
        make_engine(FakeRunner(kv_tokens=100), max_req_total_len=200)


@pytest.mark.parametrize("spec", [{}, {"spec_ngram": 3}], ids=["plain", "ngram3"])
def test_engine_seeded_sampling_independent_of_batching(spec):
    width = max(spec.values(), default=0) + 1
    params = SamplingParams(temperature=0.8, top_k=20, seed=1234, max_tokens=20, ignore_eos=True)
    alone, _ = run(make_engine(FakeRunner(max_width=width), **spec), {"a": [1, 2, 3]}, params)
    crowd = {"a": [1, 2, 3], **{f"x{i}": [i + 4, i] for i in range(5)}}
    unseeded = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    engine = make_engine(FakeRunner(max_width=width), **spec)
    for rid, ids in crowd.items():
        engine.add_request(NewRequest(rid, ids, params if rid == "a" else unseeded))
    tokens = []
    while engine.has_work():
        tokens += [t for out in engine.step() if out.req_id == "a" for t in getattr(out, "token_ids", [])]
    assert tokens == alone["a"]


def test_engine_logprobs_are_raw_model_logprobs():
    import torch

    runner = FakeRunner()
    engine = make_engine(runner)
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=2, ignore_eos=True)
    engine.add_request(NewRequest("a", [1, 2], params))
    chunks = []
    while engine.has_work():
        chunks += [o for o in engine.step() if hasattr(o, "logprobs")]
    history = [1, 2]
    for chunk in chunks:
        for token, lp, top in zip(chunk.token_ids, chunk.logprobs, chunk.top_logprobs):
            expected = torch.log_softmax(runner.next_logits(history), -1)
            assert lp == pytest.approx(float(expected[token]), abs=1e-5)
            assert [t for t, _ in top] == torch.topk(expected, 2).indices.tolist()
            history.append(token)


def test_engine_failure_between_forward_and_accept_leaves_runner_usable(monkeypatch):
    runner = FakeRunner(max_width=3)
    engine = make_engine(runner, spec_ngram=2)
    engine.add_request(NewRequest("a", [5, 6, 7], GREEDY))
    engine.step()
    calls = {"n": 0}
    real_verify = engine._verify

    def failing_verify(windows, logits):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("sampler blew up")
        return real_verify(windows, logits)

    monkeypatch.setattr(engine, "_verify", failing_verify)
    outputs = engine.step()
    assert [o.reason for o in outputs if hasattr(o, "reason")] == ["error"]
    tokens, finished = run(engine, {"b": [5, 6, 7]}, GREEDY)
    assert tokens["b"] == FakeRunner().greedy([5, 6, 7], 24)
    assert runner.num_free_requests() == 8


def _drain(engine) -> None:
    while engine.has_work():
        engine.step()


def _drafting_engine(runner: FakeRunner):
    """An MTP engine whose runner logs every draft call (handles) next to the engine's steps."""
    log: list[tuple[str, list[int]]] = []
    inner = runner.draft

    def draft(handles, next_tokens, mtp_step):
        log.append(("draft", list(handles)))
        return inner(handles, next_tokens, mtp_step)

    runner.draft = draft
    return make_engine(runner, mtp_step=2), log


def test_mtp_drafts_after_the_step_that_emits_the_token():
    """A step returns its tokens before the MTP head runs: the drafts for them are made at the start of the next
    step, before that step's forward, so a request's first token does not wait for its drafts."""
    runner = FakeRunner(max_width=3)
    engine, log = _drafting_engine(runner)
    forward = runner.forward

    def logged_forward(batch):
        log.append(("forward", list(batch.req_handles)))
        return forward(batch)

    runner.forward = logged_forward
    engine.add_request(NewRequest("a", [3, 1, 4, 1, 5], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)))
    first = engine.step()
    assert [o.token_ids for o in first if hasattr(o, "token_ids")] == [FakeRunner().greedy([3, 1, 4, 1, 5], 1)]
    assert [kind for kind, _ in log] == ["forward"], "the step drafted before returning its token"
    engine.step()
    assert [kind for kind, _ in log] == ["forward", "draft", "forward"]
    _drain(engine)
    assert log[-1][0] == "forward", "a finished request was drafted for"


def test_mtp_draft_due_for_an_aborted_request_is_dropped():
    runner = FakeRunner(max_width=3, max_requests=2)
    engine, log = _drafting_engine(runner)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request(NewRequest("a", [3, 1, 4], params))
    engine.add_request(NewRequest("b", [2, 7, 1, 8], params))
    engine.step()  # both prefill and get a token: both due a draft
    handle_b = engine.requests["b"].handle
    assert [o.reason for o in engine.abort("a")] == ["abort"]
    engine.step()
    assert log[0] == ("draft", [handle_b]), "the aborted request's freed handle was drafted for"
    _drain(engine)
    assert runner.num_free_requests() == 2


def test_mtp_draft_failure_finishes_its_requests_and_the_engine_goes_on():
    runner = FakeRunner(max_width=3)
    engine, _ = _drafting_engine(runner)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    real = runner.draft
    runner.draft = lambda *a: (_ for _ in ()).throw(RuntimeError("head failed"))
    engine.add_request(NewRequest("a", [3, 1, 4], params))
    engine.step()
    outputs = engine.step()
    assert [(o.req_id, o.reason, o.error) for o in outputs if hasattr(o, "reason")] == [
        ("a", "error", "the model step failed (see the engine log)")
    ]
    runner.draft = real
    tokens, finished = run(engine, {"b": [1, 2]}, GREEDY)
    assert tokens["b"] == FakeRunner().greedy([1, 2], 24) and runner.num_free_requests() == 8


def _held_greedy(prompt: list[int], stop: int, min_tokens: int, max_tokens: int) -> list[int]:
    """The fake model's greedy continuation with `stop` banned at its first `min_tokens` positions, ending on it."""
    ref, ids = FakeRunner(), list(prompt)
    while len(ids) - len(prompt) < max_tokens and (len(ids) == len(prompt) or ids[-1] != stop):
        logits = ref.next_logits(ids)
        if len(ids) - len(prompt) < min_tokens:
            logits[stop] = float("-inf")
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("min_tokens", [30, 0])
def test_min_tokens_counts_the_output_across_preemption(min_tokens, monkeypatch):
    """A request preempted before its min_tokens-th token resumes with its output count: the stop token stays
    banned until min_tokens tokens in all, then ends it, as the unbatched reference does (twin: the reference
    without the ban, where every request stops at its first stop token, differs; min_tokens 0 gives that one)."""
    prompts = _prompts(6, seed=3)
    free = {rid: FakeRunner().greedy(ids, 40) for rid, ids in prompts.items()}
    # the token most of the free continuations reach early: banning it changes them
    stop = max(range(64), key=lambda t: sum(t in f[:12] for f in free.values()))
    expected = {rid: _held_greedy(ids, stop, min_tokens, 40) for rid, ids in prompts.items()}
    runner = FakeRunner(max_requests=6, kv_tokens=200, max_width=3)
    engine = make_engine(runner, max_req_total_len=100, spec_ngram=2)
    preempted, preempt = [], engine.scheduler._preempt
    monkeypatch.setattr(
        engine.scheduler, "_preempt", lambda req, plan: preempted.append(len(req.output_ids)) or preempt(req, plan)
    )
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop], min_tokens=min_tokens)
    tokens, finished = run(engine, prompts, params)
    assert tokens == expected and all(f.reason == "stop" for f in finished.values())
    assert all(len(t) > min_tokens for t in tokens.values())
    if min_tokens:
        assert any(0 < n < min_tokens for n in preempted), preempted
        assert tokens != {rid: _held_greedy(ids, stop, 0, 40) for rid, ids in prompts.items()}
