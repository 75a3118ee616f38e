"""The prefix cache with the real ModelRunner on tiny checkpoints: a run that resumes from cached KV + state
checkpoints gives the tokens of a cold run (cache disabled) and its logprobs within 1e-5, in every state mode
and speculation, for hits at an interval checkpoint, between checkpoints, inside the first interval (a learned
branch point), at a prefill-chunk boundary, at a finished request's end (next turn) and on exact repeats. Also:
MTP drafts resume exactly, rejected drafts and aborted tails never enter the tree, a tiny pool evicts and stays
correct, preemption resumes from its own checkpoint, and 1000 random requests leave every pool as it started."""

from __future__ import annotations

import random

import pytest
import torch

from lightllm.cache.prefix import CheckpointPool
from lightllm.engine.messages import NewRequest
from lightllm.engine.sampling_params import SamplingParams
from lightllm.engine.speculative import NoSpeculator
from lightllm.linear_att.base import Checkpoint
from lightllm.tools.make_tiny_model import tiny_model_dir
from unit_tests.helpers.prefix_scenario import (
    MAX_TOKENS,
    VOCAB,
    Result,
    assert_same,
    drain,
    fresh,
    make_engine,
    preemption_engine,
    preemption_prompts,
    run_one_by_one,
    run_preempting,
    run_scenario,
    scenario,
    submit,
)
from unit_tests.helpers.scripted_drafts import ScriptedDrafts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

COMBOS = [
    ("qwen3_5", "native", {}),
    ("qwen3_5", "native", {"spec_ngram": 2}),
    ("qwen3_5", "native", {"mtp_step": 2}),
    ("qwen3_5", "compact", {"spec_ngram": 3}),
    ("qwen3_5", "compact", {"mtp_step": 2}),
    ("qwen3_5", "replay", {}),
    ("qwen3_5", "replay", {"spec_ngram": 2}),
    ("qwen3_5", "replay", {"mtp_step": 3}),
    ("kimi_linear", "native", {}),
    ("kimi_linear", "compact", {"spec_ngram": 2}),
    ("kimi_linear", "replay", {"spec_ngram": 3}),
]


def _id(combo) -> str:
    arch, mode, spec = combo
    return "-".join([arch, mode, *(f"{k}{v}" for k, v in spec.items())] or ["nospec"])


class DraftRecorder:
    """Records each request's MTP draft logits (the runner's `draft`, wrapped)."""

    def __init__(self, engine):
        self.engine, self.logits = engine, {}
        runner = engine.runner
        inner = runner.draft_with_logits

        def draft(handles, next_tokens, num_steps):
            drafts, logits = inner(handles, next_tokens, num_steps)
            by_handle = {r.handle: r.req_id for r in engine.scheduler.running}
            for h, row in zip(handles, logits):
                self.logits.setdefault(by_handle[h], []).append(row)
            return drafts

        runner.draft = draft


@pytest.mark.parametrize("combo", COMBOS, ids=[_id(c) for c in COMBOS])
def test_hits_equal_cold_run(combo, hf_oracle):
    arch, mode, spec = combo
    cold, hot = make_engine(arch, mode, spec, cache=False), make_engine(arch, mode, spec)
    recorders = [DraftRecorder(e) for e in (cold, hot)] if "mtp_step" in spec else None
    expected_cold = run_scenario(cold, seed=11)
    got = run_scenario(hot, seed=11)
    _, expected_hits = scenario(11)
    assert [r.cached for r in got] == expected_hits
    assert all(r.cached == 0 for r in expected_cold)
    assert_same(got, expected_cold)
    # the independent reference for one resumed request: the next turn, against transformers
    oracle = hf_oracle(str(tiny_model_dir(arch)))
    prompts, _ = scenario(11)
    follow_up = prompts[0] + got[0].tokens + fresh(random.Random(12), 3)
    assert oracle.greedy(follow_up, MAX_TOKENS) == got[5].tokens
    if recorders is not None:
        # the MTP head resumed with the prefix's KV and the last hidden state: its drafts are the cold run's
        cold_logits, hot_logits = recorders[0].logits, recorders[1].logits
        assert cold_logits.keys() == hot_logits.keys()
        for rid in cold_logits:
            for c, h in zip(cold_logits[rid], hot_logits[rid], strict=True):
                torch.testing.assert_close(h, c, atol=1e-4, rtol=1e-4, msg=f"{rid}: draft logits")
    stats = hot.runner.prefix_cache_stats()
    assert stats["num_hit_tokens"] == sum(expected_hits)
    assert hot.runner.num_free_kv_tokens() == 512 and hot.runner.num_free_requests() == 4


def test_teeth_perturbed_checkpoint_breaks_equality(monkeypatch):
    """Teeth: the same run with every restored SSM state nudged by 1e-3 must not match the cold run."""
    cold, hot = make_engine("qwen3_5", "replay", {}, cache=False), make_engine("qwen3_5", "replay", {})
    read = CheckpointPool.read

    def perturbed(self, slot):
        ckpt, hidden = read(self, slot)
        return Checkpoint(conv=ckpt.conv, ssm=ckpt.ssm + 1e-3), hidden

    monkeypatch.setattr(CheckpointPool, "read", perturbed)
    expected, got = run_scenario(cold, seed=11), run_scenario(hot, seed=11)
    with pytest.raises(AssertionError):
        assert_same(got, expected)


def test_teeth_mtp_resumed_without_its_hidden_state_drafts_differently(monkeypatch):
    """Teeth: a hit that restored a wrong MTP hidden state gives the same tokens (drafts only speed decoding up)
    but different drafts."""
    from lightllm.worker.transfer.prefix import RunnerPrefixCache

    resume = RunnerPrefixCache.resume

    def zero_hidden(self, handle, req, token_ids, host_tokens=None):
        resume(self, handle, req, token_ids, host_tokens)
        req.mtp_hidden = [(torch.zeros_like(src[start : start + n]), 0, n) for src, start, n in req.mtp_hidden]

    monkeypatch.setattr(RunnerPrefixCache, "resume", zero_hidden)
    cold, hot = (
        make_engine("qwen3_5", "native", {"mtp_step": 2}, cache=False),
        make_engine("qwen3_5", "native", {"mtp_step": 2}),
    )
    recorders = [DraftRecorder(e) for e in (cold, hot)]
    assert_same(run_scenario(hot, seed=11), run_scenario(cold, seed=11))
    differs = any(
        not torch.allclose(h, c, atol=1e-4)
        for rid in recorders[0].logits
        for c, h in zip(recorders[0].logits[rid], recorders[1].logits[rid])
    )
    assert differs


def tree_paths(engine) -> list[list[int]]:
    """Every root-to-leaf token path of the runner's prefix tree."""
    tree = engine.runner.prefix_cache.cache.tree
    paths, stack = [], [(tree.root, [])]
    while stack:
        node, prefix = stack.pop()
        path = prefix + node.key.tolist()
        if not node.children and node is not tree.root:
            paths.append(path)
        stack.extend((child, path) for child in node.children.values())
    return paths


@pytest.mark.parametrize("mode", ["native", "compact", "replay"])
def test_rejected_drafts_never_enter_the_tree(mode):
    """Scripted drafts with rejections in every other window: every cached path is a prefix of some request's
    prompt + output, and the next turns (resuming at each first turn's end) equal the cold run."""
    rng = random.Random(5)
    prompts = [fresh(rng, n) for n in (12, 21, 7)]
    cold = make_engine("qwen3_5", mode, {"spec_ngram": 3}, cache=False)
    truth = {tuple(p): r.tokens for p, r in zip(prompts, run_one_by_one(cold, prompts, 14))}
    # one token past the scripted continuation so drafts exist up to the last position
    hot = make_engine("qwen3_5", mode, {"spec_ngram": 3})
    hot.speculator = ScriptedDrafts(truth, 3, VOCAB)
    first = run_one_by_one(hot, prompts, 12)
    assert [r.tokens for r in first] == [t[:12] for t in truth.values()]
    assert sum(k > 1 for sizes in hot.speculator.expected_tokens_per_window.values() for k in sizes) > 3
    sequences = [p + r.tokens for p, r in zip(prompts, first)]
    for path in tree_paths(hot):
        assert any(seq[: len(path)] == path for seq in sequences), f"cached path {path} was never committed"
    # each first turn is cached up to its last committed token (its last output token was never fed back)
    assert sorted(len(p) for p in tree_paths(hot)) == sorted(len(s) - 1 for s in sequences)
    follow = [s + fresh(rng, 4) for s in sequences]
    hot.speculator = NoSpeculator()
    hot_next = run_one_by_one(hot, follow, 5)
    assert [r.cached for r in hot_next] == [len(s) - 1 for s in sequences]
    assert_same(hot_next, run_one_by_one(make_engine("qwen3_5", mode, {"spec_ngram": 3}, cache=False), follow, 5))


def test_publish_between_forward_and_accept_is_refused():
    engine = make_engine("qwen3_5", "native", {"spec_ngram": 2})
    submit(engine, "a", list(range(30, 45)), 4)
    req = engine.requests["a"]
    while not req.output_ids:
        engine.step()
    req.draft_ids = [1, 2]
    plan = engine.scheduler.schedule()
    assert plan.decode and plan.decode[0].num_tokens == 3
    engine.runner.forward(engine.build_batch(plan))
    with pytest.raises(RuntimeError, match="between forward and accept"):
        engine.runner.publish(req.handle, req.all_ids[: req.num_computed_tokens])


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_next_turn_resumes_at_the_finished_request_end(overlap):
    """A request that stops on a stop token, then the next turn (its prompt + answer + new tokens). With the overlap
    schedule the step launched before the stop was read fed the answer's last token: the next turn resumes at the
    exact end of the previous one. Synchronous (the twin), the last answer token was never fed: it resumes one
    short and prefills it. Both equal the cold run."""
    rng = random.Random(17)
    prompt = fresh(rng, 23)
    cold = make_engine("qwen3_5", "native", {}, cache=False)
    greedy = run_one_by_one(cold, [prompt], 12)[0].tokens
    stop = next(t for i, t in enumerate(greedy) if i >= 4 and t not in greedy[:i])
    answer = greedy[: greedy.index(stop) + 1]
    hot = make_engine("qwen3_5", "native", {}, disable_overlap_schedule=not overlap)
    first = {"a": Result()}
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=0, stop_token_ids=[stop])
    assert hot.add_request(NewRequest("a", prompt, params)) == []
    drain(hot, first)
    assert first["a"].tokens == answer and first["a"].reason == "stop"
    follow = prompt + answer + fresh(rng, 4)
    got = run_one_by_one(hot, [follow], 5)
    assert got[0].cached == len(prompt) + len(answer) - (0 if overlap else 1)
    assert_same(got, run_one_by_one(make_engine("qwen3_5", "native", {}, cache=False), [follow], 5))


def test_cache_salt_shares_prefixes_only_within_a_salt():
    """A prompt cached under one cache salt is computed again under another salt and without one (nothing cached),
    and resumed under its own salt as far as an unsalted server resumes it; every run gives the cold run's tokens
    and logprobs. Evicting everything leaves the tree one namespace."""
    rng = random.Random(23)
    first = fresh(rng, 30)
    follow = first + fresh(rng, 5)
    prompts, salts = [first, follow, follow, follow], ["tenant-a", "tenant-b", None, "tenant-a"]
    hot = make_engine("qwen3_5", "replay", {"spec_ngram": 2})
    got = run_one_by_one(hot, prompts, 6, salts)
    plain = run_one_by_one(make_engine("qwen3_5", "replay", {"spec_ngram": 2}), [first, follow], 6)
    assert plain[1].cached > 0
    assert [r.cached for r in got] == [0, 0, 0, plain[1].cached]
    assert_same(got, run_one_by_one(make_engine("qwen3_5", "replay", {"spec_ngram": 2}, cache=False), prompts, 6))
    tree = hot.runner.prefix_cache.cache.tree
    assert tree.num_namespaces() == 3
    hot.runner.evict_prefix_cache()
    assert tree.num_namespaces() == 1 and tree.num_tokens == 0


@pytest.mark.parametrize("abort_after", [1, 3], ids=["mid-prefill", "mid-decode"])
def test_abort_leaves_only_the_committed_prefix(abort_after):
    rng = random.Random(9)
    prompt = fresh(rng, 30)
    hot = make_engine("qwen3_5", "replay", {"mtp_step": 2}, chunked_prefill_size=12)
    res = {"a": Result()}
    submit(hot, "a", prompt, 8)
    # mid-prefill: abort after the first 12-token chunk (before any output)
    if abort_after == 1:
        hot.step()
        hot.abort("a")
        committed = prompt[:12]
    else:
        drain(hot, res, abort_after={"a": abort_after})
        assert res["a"].reason == "abort" and len(res["a"].tokens) >= abort_after
        committed = (prompt + res["a"].tokens)[: len(prompt) + len(res["a"].tokens) - 1]
    paths = tree_paths(hot)
    assert max(len(p) for p in paths) == len(committed)
    assert any(p == committed for p in paths)
    follow = committed + fresh(rng, 5)
    hot_res = run_one_by_one(hot, [follow], 6)
    assert hot_res[0].cached == len(committed)
    assert_same(hot_res, run_one_by_one(make_engine("qwen3_5", "replay", {"mtp_step": 2}, cache=False), [follow], 6))


def test_tiny_pool_evicts_lru_and_stays_correct():
    """Three checkpoints and a KV cache that cannot keep every prefix: checkpoints and paths are evicted (LRU) and
    every request still matches the cold run, some of them resuming from what survived."""
    rng = random.Random(21)
    stems = [fresh(rng, 20) for _ in range(3)]
    prompts = [stems[i // 3] + fresh(rng, 3) for i in range(9)]
    kwargs = dict(max_total_token_num=96, max_req_total_len=32)
    hot = make_engine("qwen3_5", "compact", {"mtp_step": 2}, prefix_cache_state_bytes=3 * 20_000, **kwargs)
    assert hot.runner.prefix_cache.pool.num_slots == 3
    got = run_one_by_one(hot, prompts, 2)
    cold = make_engine("qwen3_5", "compact", {"mtp_step": 2}, cache=False, **kwargs)
    assert_same(got, run_one_by_one(cold, prompts, 2))
    stats = hot.runner.prefix_cache_stats()
    assert stats["num_checkpoints_evicted"] > 10 and stats["num_checkpoints"] == 3
    assert sum(r.cached > 0 for r in got) >= 4
    hot.runner.evict_prefix_cache()
    assert hot.runner.kv.num_free_tokens() == 96 and hot.runner.prefix_cache.pool.num_free() == 3


def test_preempted_requests_resume_from_their_own_checkpoint():
    """KV for fewer tokens than the requests need: the latest admission is preempted, its committed tokens stay
    cached (interval checkpoints, and one at its end) and its re-admission resumes from what survived the KV
    pressure; the text equals the cold run's."""
    prompts = preemption_prompts(random.Random(33))
    # the checkpoints at 16 and 32 along each prompt survive when KV pressure evicts the victim's tail
    outputs, engines = [], []
    for cache in (False, True):
        engine = preemption_engine(cache)
        outputs.append(run_preempting(engine, prompts))
        engines.append(engine)
    assert_same(outputs[1], outputs[0])
    assert engines[1].runner.prefix_cache_stats()["num_hit_tokens"] >= 16, "re-admissions should resume"


def test_thousand_random_requests_with_aborts_leave_the_pools_as_they_started():
    """Random shared prefixes, random lengths, random aborts, MTP, a small KV cache (preemption, eviction): once
    idle, every KV slot is free or reclaimable, and after a full eviction every pool is back to its start."""
    rng = random.Random(2024)
    engine = make_engine(
        "qwen3_5",
        "native",
        {"mtp_step": 1},
        max_running_requests=8,
        chunked_prefill_size=24,
        max_total_token_num=192,
        max_req_total_len=48,
        prefix_cache_state_bytes=12 * 20_000,
    )
    runner = engine.runner
    stems = [fresh(rng, rng.randrange(3, 20)) for _ in range(6)]
    num_requests, next_id, live = 1000, 0, []
    aborted = 0
    while next_id < num_requests or engine.has_work():
        while next_id < num_requests and len(live) < 12:
            stem = rng.choice(stems)
            prompt = stem[: rng.randrange(1, len(stem) + 1)] + fresh(rng, rng.randrange(0, 6))
            submit(engine, f"f{next_id}", prompt, rng.randrange(1, 4))
            live.append(f"f{next_id}")
            next_id += 1
        finished = {getattr(o, "req_id", None) for o in engine.step() if hasattr(o, "reason")}
        live = [r for r in live if r not in finished]
        if live and rng.random() < 0.15:
            victim = rng.choice(live)
            engine.abort(victim)
            live.remove(victim)
            aborted += 1
    stats = runner.prefix_cache_stats()
    assert aborted > 50 and stats["num_hit_tokens"] > 500 and stats["num_checkpoints_evicted"] > 100
    pc = runner.prefix_cache.cache
    assert pc.tree.num_locked_tokens == 0 and runner.num_free_requests() == 8
    assert runner.num_free_kv_tokens() == 192
    runner.evict_prefix_cache()
    assert pc.tree.num_tokens == 0 and pc.pool.num_free() == pc.pool.num_slots
    assert runner.kv.num_free_tokens() == 192
    assert runner.drafter.kv.num_free_tokens() == runner.drafter.kv.capacity
    assert not runner.kv.shared_cpu.any() and not runner.drafter.kv.shared_cpu.any()
