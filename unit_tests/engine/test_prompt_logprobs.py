"""Prompt log-probabilities (`SamplingParams.prompt_logprobs`) through Engine.step against the fake runner: scored
over prefill chunks, sent once with the first token, never again after a preemption's recompute."""

from __future__ import annotations

import random

import torch

from lightllm.engine.messages import Finished, NewRequest, TokenChunk
from lightllm.engine.sampling_params import SamplingParams
from lightllm.engine.scheduler import SchedulePlan
from unit_tests.engine.fake_runner import FakeRunner
from unit_tests.engine.helpers import make_engine

NUM_TOP = 3


def _reference(prompt: list[int], shift: int = 0) -> list[tuple[float, list[int], int] | None]:
    """Per prompt position p >= 1: log_softmax of the fake model's logits after prompt[:p] at prompt[p], the top
    NUM_TOP ids there and prompt[p]'s place in the descending sort (1-based); `shift` scores token p with the logits
    after prompt[:p + shift] instead."""
    ref = FakeRunner()
    entries: list[tuple[float, list[int], int] | None] = [None]
    for p in range(1, len(prompt)):
        logp = torch.log_softmax(ref.next_logits(prompt[: min(p + shift, len(prompt))]), dim=-1)
        rank = torch.argsort(logp, descending=True).tolist().index(prompt[p]) + 1
        entries.append((float(logp[prompt[p]]), torch.topk(logp, NUM_TOP).indices.tolist(), rank))
    return entries


def _max_error(chunk: TokenChunk, prompt: list[int], shift: int = 0) -> float:
    """Largest gap between the chunk's prompt log-probabilities and the reference; inf if the top ids or a rank
    differ."""
    worst = 0.0
    scored = zip(chunk.prompt_logprobs, chunk.prompt_top_logprobs, chunk.prompt_ranks, _reference(prompt, shift))
    for lp, top, rank, expected in scored:
        if expected is None:
            assert lp is None and top is None and rank is None
            continue
        if [t for t, _ in top] != expected[1] or rank != expected[2]:
            return float("inf")
        worst = max(worst, abs(lp - expected[0]))
    return worst


def _drive(engine, prompts: dict[str, list[int]], params: dict[str, SamplingParams], before_step=None):
    """Submit every prompt and step until idle; returns every TokenChunk per request and the Finished messages."""
    chunks: dict[str, list[TokenChunk]] = {rid: [] for rid in prompts}
    finished: dict[str, Finished] = {}
    for rid, ids in prompts.items():
        assert engine.add_request(NewRequest(rid, ids, params[rid])) == []
    for step in range(10_000):
        if not engine.has_work():
            break
        if before_step is not None:
            before_step(step)
        for out in engine.step():
            if isinstance(out, TokenChunk):
                chunks[out.req_id].append(out)
            elif isinstance(out, Finished):
                finished[out.req_id] = out
    assert not engine.has_work()
    return chunks, finished


def test_prompt_logprobs_sent_once_and_exact_under_chunking_and_preemption():
    rng = random.Random(5)
    prompts = {f"r{i}": [rng.randrange(64) for _ in range(rng.randint(1, 40))] for i in range(8)}
    asks = {rid: i % 2 == 0 for i, rid in enumerate(prompts)}
    params = {
        rid: SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=NUM_TOP if a else None)
        for rid, a in asks.items()
    }
    runner = FakeRunner(max_requests=6, kv_tokens=160, max_width=3)
    engine = make_engine(runner, chunked_prefill_size=7, max_req_total_len=80, spec_ngram=2)
    chunks, finished = _drive(engine, prompts, params)
    assert engine.scheduler.num_preemptions > 0
    for rid, prompt in prompts.items():
        tokens = [t for c in chunks[rid] for t in c.token_ids]
        # scoring the prompt changes nothing about the generated tokens
        assert tokens == FakeRunner().greedy(prompt, 30) and finished[rid].reason == "length"
        scored = [c for c in chunks[rid] if c.prompt_logprobs is not None]
        if not asks[rid]:
            assert scored == []
            continue
        assert scored == [chunks[rid][0]], "prompt log-probabilities must come once, with the first tokens"
        assert len(scored[0].prompt_logprobs) == len(prompt) and scored[0].prompt_logprobs[0] is None
        assert _max_error(scored[0], prompt) < 1e-5
        if len(prompt) > 2:
            # twin: scoring each token with the logits one position later must not pass
            assert _max_error(scored[0], prompt, shift=1) > 1e-2
    # steps whose prefill rows do not ask carry no prompt-logits request at all
    assert any(b.num_prefill_rows and b.prefill_prompt_logits == [] for b in runner.batches)
    assert runner.num_free_kv_tokens() == 160


def test_prompt_logprobs_survive_a_preemption_inside_the_prefill():
    prompt = [random.Random(9).randrange(64) for _ in range(20)]
    runner = FakeRunner()
    engine = make_engine(runner, chunked_prefill_size=6)
    plan = SchedulePlan()

    def preempt_after_two_chunks(step: int) -> None:
        if step == 2:
            (req,) = engine.scheduler.running
            assert req.is_prefilling and len(req.prompt_logprobs) == 12
            engine.scheduler._preempt(req, plan)

    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=NUM_TOP)
    chunks, _ = _drive(engine, {"a": prompt}, {"a": params}, preempt_after_two_chunks)
    assert plan.preempted and [t for c in chunks["a"] for t in c.token_ids] == FakeRunner().greedy(prompt, 5)
    assert [c.prompt_logprobs is not None for c in chunks["a"]] == [True] + [False] * (len(chunks["a"]) - 1)
    assert _max_error(chunks["a"][0], prompt) < 1e-5
    assert _max_error(chunks["a"][0], prompt, shift=1) > 1e-2
    # the recompute asked the runner only for the positions not scored before the preemption
    asked = [b.query_lens[0] for b in runner.batches if b.prefill_prompt_logits == [True]]
    assert asked == [6, 6, 6, 2]
    # a single-token prompt has nothing to score: one null entry, and the runner is asked for nothing
    num_batches = len(runner.batches)
    chunks, _ = _drive(engine, {"b": [7]}, {"b": params})
    assert chunks["b"][0].prompt_logprobs == [None] and chunks["b"][0].prompt_top_logprobs == [None]
    assert not any(b.prefill_prompt_logits for b in runner.batches[num_batches:])


def test_prompt_logprobs_rows_per_step_are_bounded():
    """Requests asking for prompt log-probabilities prefill within the step's allowance of such rows (each costs a
    vocabulary-wide logits row), and their scores stay exact; without the bound one chunk would exceed it."""
    rng = random.Random(11)
    prompts = {rid: [rng.randrange(64) for _ in range(37)] for rid in ("a", "b")}
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=NUM_TOP)

    def run(limit: int | None):
        runner = FakeRunner()
        engine = make_engine(runner, chunked_prefill_size=32)
        if limit is not None:
            engine.scheduler.max_prompt_logit_rows = limit
        chunks, _ = _drive(engine, prompts, {rid: params for rid in prompts})
        asked = [sum(q for q, a in zip(b.query_lens, b.prefill_prompt_logits) if a) for b in runner.batches]
        return chunks, asked

    chunks, asked = run(10)
    assert max(asked) == 10 and sum(asked) == 2 * 37
    for rid, prompt in prompts.items():
        assert _max_error(chunks[rid][0], prompt) < 1e-5
        assert [t for c in chunks[rid] for t in c.token_ids] == FakeRunner().greedy(prompt, 4)
    _, unbounded = run(None)
    assert max(unbounded) > 10
