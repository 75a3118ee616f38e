"""Short prefill steps through the fixed buffers of `PrefillGraphs` (the path CUDA graphs replay; eager on the CPU):
one request's chunk padded to a token bucket gives the tokens and logprobs of an ordinary engine (cold, no fixed
buffers) in every state mode and speculation, on prefix-cache hits (the suffix after a checkpoint), chunked
prompts (each chunk starting from the state the previous one wrote), next turns and exact repeats; and matches
transformers on its own."""

from __future__ import annotations

import random

import pytest
import torch

from lightllm.models.layers.mla import LATENT_MAX_QUERY_LEN
from lightllm.tools.make_tiny_model import tiny_model_dir
from lightllm.worker.graphs.prefill import PrefillGraphs, prefill_buckets
from unit_tests.helpers.prefix_scenario import (
    MAX_TOKENS,
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
    run_staggered,
    scenario,
    staggered_prompts,
    submit,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# every state mode and speculation on the dense layout; MoE and MLA models below
COMBOS = [("native", {}), ("compact", {"spec_ngram": 3}), ("replay", {"mtp_step": 2}), ("replay", {"spec_ngram": 2})]


def _with_fixed_buffers(engine, calls: list[tuple[int, int]] | None = None):
    """The engine with decode and short-prefill steps through fixed buffers (no graphs on the CPU); `calls`
    records each prefill run as (tokens, bucket)."""
    runner = engine.runner
    assert runner.init_decode_graphs(use_graphs=False)
    assert runner.init_prefill_graphs(use_graphs=False)
    if calls is not None:
        graphs = runner.prefill_graphs
        run = graphs.run

        def counted(input_ids, *rest):
            calls.append((len(input_ids), graphs.bucket(len(input_ids))))
            return run(input_ids, *rest)

        graphs.run = counted
    return engine


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join([c[0], *(f"{k}{v}" for k, v in c[1].items())]))
@pytest.mark.parametrize("chunk", [8, 64])
def test_padded_prefill_steps_equal_the_eager_engine(combo, chunk):
    mode, spec = combo
    calls: list[tuple[int, int]] = []
    cold = make_engine("qwen3_5", mode, spec, cache=False, chunked_prefill_size=chunk)
    hot = _with_fixed_buffers(make_engine("qwen3_5", mode, spec, chunked_prefill_size=chunk), calls)
    expected = run_scenario(cold, seed=23)
    got = run_scenario(hot, seed=23)
    if chunk == 8:
        assert [r.cached for r in got] == scenario(23)[1]
    else:
        # one chunk per prompt: checkpoints only at prefill ends and request ends, still hit by the later requests
        assert sum(r.cached for r in got) > 0
    assert_same(got, expected)
    # every prefill ran through the buffers, padded up to its bucket
    assert calls and all(bucket is not None for _, bucket in calls)
    assert any(n < bucket for n, bucket in calls), calls
    assert hot.runner.num_free_kv_tokens() == 512 and hot.runner.num_free_requests() == 4


def test_padded_prefill_matches_transformers(hf_oracle):
    """A cold prompt of 37 tokens in chunks of 16, 16 and 5 (buckets 16, 16, 16) and a 3-token next turn."""
    model_dir = str(tiny_model_dir("qwen3_5"))
    calls: list[tuple[int, int]] = []
    engine = _with_fixed_buffers(make_engine("qwen3_5", "replay", {}, chunked_prefill_size=16), calls)
    rng = random.Random(5)
    prompt = fresh(rng, 37)
    first = run_one_by_one(engine, [prompt], MAX_TOKENS)[0]
    oracle = hf_oracle(model_dir)
    assert first.tokens == oracle.greedy(prompt, MAX_TOKENS)
    turn = prompt + first.tokens + fresh(rng, 3)
    second = run_one_by_one(engine, [turn], MAX_TOKENS)[0]
    assert second.cached > 0
    assert second.tokens == oracle.greedy(turn, MAX_TOKENS)
    assert [n for n, _ in calls][:3] == [16, 16, 4]


def test_padding_that_updates_the_state_breaks_the_text(monkeypatch):
    """Teeth: the same run with the padding tokens marked real (they decay and update the linear state and write
    KV past the row's end) must not give the eager engine's text."""
    upload = PrefillGraphs._upload

    def padding_is_real(self, tokens):
        self._host64[4, :tokens] = 1  # the "real" field
        upload(self, tokens)

    monkeypatch.setattr(PrefillGraphs, "_upload", padding_is_real)
    cold = make_engine("qwen3_5", "native", {}, cache=False)
    hot = _with_fixed_buffers(make_engine("qwen3_5", "native", {}))
    with pytest.raises(AssertionError):
        assert_same(run_scenario(hot, seed=23), run_scenario(cold, seed=23))


@pytest.mark.parametrize("mode, spec", [("native", {}), ("replay", {}), ("compact", {"spec_ngram": 2})])
@pytest.mark.parametrize("arch", ["qwen3_next", "kimi_linear"])
def test_moe_and_mla_models_prefill_through_the_buffers_as_the_eager_engine(arch, mode, spec):
    """MoE routing and MLA's latent attention take no host value mid-step: their short prefills run through the
    fixed buffers too, with the eager engine's tokens, in every state mode."""
    calls: list[tuple[int, int]] = []
    cold = make_engine(arch, mode, spec, cache=False, chunked_prefill_size=8)
    hot = _with_fixed_buffers(make_engine(arch, mode, spec, chunked_prefill_size=8), calls)
    assert_same(run_scenario(hot, seed=29), run_scenario(cold, seed=29))
    assert calls and all(bucket is not None for _, bucket in calls)


def test_mla_models_run_long_chunks_eagerly():
    """Through fixed buffers MLA attends in latent space, where a long chunk costs several times its expanded form:
    Kimi-Linear's prefill buckets stop at `latent_max_query_len`, a longer chunk runs an eager step (expanded
    attention), a short one the buffers, both with the eager engine's tokens. Twin: a model without MLA keeps the
    flag's buckets, and its long chunk goes through the buffers."""
    rng = random.Random(41)
    prompts = [fresh(rng, LATENT_MAX_QUERY_LEN + 37), fresh(rng, 20)]
    calls: list[tuple[int, int]] = []
    cold = make_engine("kimi_linear", "replay", {}, cache=False, chunked_prefill_size=128)
    hot = _with_fixed_buffers(make_engine("kimi_linear", "replay", {}, cache=False, chunked_prefill_size=128), calls)
    assert hot.runner.prefill_graphs.buckets[-1] == LATENT_MAX_QUERY_LEN
    assert_same(run_one_by_one(hot, prompts, MAX_TOKENS), run_one_by_one(cold, prompts, MAX_TOKENS))
    assert [n for n, _ in calls] == [20]
    dense_calls: list[tuple[int, int]] = []
    dense = _with_fixed_buffers(
        make_engine("qwen3_next", "replay", {}, cache=False, chunked_prefill_size=128), dense_calls
    )
    assert dense.runner.prefill_graphs.buckets[-1] > LATENT_MAX_QUERY_LEN
    run_one_by_one(dense, prompts, MAX_TOKENS)
    assert [n for n, _ in dense_calls] == [LATENT_MAX_QUERY_LEN + 37, 20]


def test_prefill_buckets():
    assert prefill_buckets(512) == [16, 32, 64, 128, 256, 512]
    assert prefill_buckets(100) == [16, 32, 64, 100]
    assert prefill_buckets(16) == [16]
    assert prefill_buckets(0) == []


def test_preempted_and_aborted_requests_through_the_buffers_equal_the_cold_run():
    """KV for fewer tokens than three requests need (preemption; re-admissions resume from their own checkpoints)
    and one more request aborted after its first tokens: the survivors' text is the cold run's, some prefills ran
    through the buffers, and every pool is back to its start once idle."""
    rng = random.Random(33)
    prompts = preemption_prompts(rng)
    outputs, calls = [], []
    for cache in (False, True):
        engine = preemption_engine(cache)
        if cache:
            _with_fixed_buffers(engine, calls)
        outputs.append(run_preempting(engine, prompts))
        aborted = {"x": Result()}
        submit(engine, "x", prompts[0][:20] + fresh(rng, 9), 10)
        drain(engine, aborted, abort_after={"x": 2})
        assert aborted["x"].reason == "abort"
    assert_same(outputs[1], outputs[0])
    assert calls, "no prefill step went through the buffers"
    runner = engine.runner
    assert runner.num_free_requests() == 4 and runner.num_free_kv_tokens() == 128


def _recorded_step_shapes(engine) -> list[tuple[int, int, bool]]:
    """A list the engine's runner fills with each step's (prefill rows, decode rows, ran through fixed buffers)."""
    shapes = []
    run = engine.runner._forward_fixed_buffers

    def recorded(batch, *rest):
        out = run(batch, *rest)
        shapes.append((batch.num_prefill_rows, len(batch.query_lens) - batch.num_prefill_rows, out is not None))
        return out

    engine.runner._forward_fixed_buffers = recorded
    return shapes


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join([c[0], *(f"{k}{v}" for k, v in c[1].items())]))
def test_a_short_prefill_beside_decode_rows_replays_both_graphs(combo):
    """Requests arriving while others decode: a step with one short prefill row (a cache hit's suffix, a new
    prompt's chunk) and decode rows runs the prefill graph's buffers, then the decode graph's; tokens and
    logprobs equal an eager engine's (no cache), every pool is back at its start."""
    mode, spec = combo
    prompts = staggered_prompts(random.Random(41))
    cold = make_engine("qwen3_5", mode, spec, cache=False)
    hot = _with_fixed_buffers(make_engine("qwen3_5", mode, spec))
    shapes = _recorded_step_shapes(hot)
    expected, got = (run_staggered(e, prompts) for e in (cold, hot))
    assert_same(got, expected)
    assert sum(r.cached for r in got) > 0
    # mixed steps (one prefill row, decode rows) went through the buffers
    assert any(np_ == 1 and nd > 0 and fixed for np_, nd, fixed in shapes), shapes
    assert hot.runner.num_free_kv_tokens() == 512 and hot.runner.num_free_requests() == 4


def test_a_mixed_step_with_misplaced_prefill_rows_breaks_the_text(monkeypatch):
    """Teeth of the mixed-step test: the same arrivals with the prefill graph's hidden states one row off in the
    step's token layout must not give the eager engine's text."""
    run = PrefillGraphs.run

    def shifted(self, *args):
        return run(self, *args).roll(1, 0)

    prompts = staggered_prompts(random.Random(41))
    expected = run_staggered(make_engine("qwen3_5", "native", {}, cache=False), prompts)
    monkeypatch.setattr(PrefillGraphs, "run", shifted)
    hot = _with_fixed_buffers(make_engine("qwen3_5", "native", {}))
    with pytest.raises(AssertionError):
        assert_same(run_staggered(hot, prompts), expected)


def _pooled_prefill_outputs(monkeypatch) -> None:
    """Every prefill run's hidden states returned as a view of one shared buffer, as the graphs' outputs live in
    one memory pool on CUDA (the next replay overwrites them)."""
    run, pool = PrefillGraphs.run, {}

    def pooled(self, *args):
        out = run(self, *args)
        buf = pool.setdefault("buf", torch.full((self.max_tokens, out.shape[1]), float("nan"), dtype=out.dtype))
        buf[: out.shape[0]] = out
        return buf[: out.shape[0]]

    monkeypatch.setattr(PrefillGraphs, "run", pooled)


@pytest.mark.parametrize("combo", COMBOS[:3], ids=lambda c: "-".join([c[0], *(f"{k}{v}" for k, v in c[1].items())]))
def test_several_prefill_rows_replay_the_prefill_graph_one_after_another(combo, monkeypatch):
    """Prompts arriving together (four at once, then two at a time while others decode): a step's prefill rows
    replay the prefill graph one row after another (beside the decode graph where rows decode), their outputs
    in one shared pool; tokens and logprobs equal an eager engine's, every pool back at its start."""
    mode, spec = combo
    _pooled_prefill_outputs(monkeypatch)
    prompts = staggered_prompts(random.Random(43))
    cold = make_engine("qwen3_5", mode, spec, cache=False)
    hot = _with_fixed_buffers(make_engine("qwen3_5", mode, spec))
    shapes = _recorded_step_shapes(hot)
    for group, gap in ((4, 0), (2, 3)):
        expected, got = (run_staggered(e, prompts, gap=gap, group=group) for e in (cold, hot))
        assert_same(got, expected)
    assert any(np_ >= 2 and nd == 0 and fixed for np_, nd, fixed in shapes), shapes
    assert any(np_ >= 2 and nd > 0 and fixed for np_, nd, fixed in shapes), shapes
    assert hot.runner.num_free_kv_tokens() == 512 and hot.runner.num_free_requests() == 4


def test_several_prefill_rows_with_swapped_outputs_break_the_text(monkeypatch):
    """Teeth: the same arrivals with each replay's hidden states one token off must not give the eager text."""
    _pooled_prefill_outputs(monkeypatch)
    run = PrefillGraphs.run
    monkeypatch.setattr(PrefillGraphs, "run", lambda self, *args: run(self, *args).roll(1, 0))
    prompts = staggered_prompts(random.Random(43))
    expected = run_staggered(make_engine("qwen3_5", "native", {}, cache=False), prompts, gap=0, group=4)
    hot = _with_fixed_buffers(make_engine("qwen3_5", "native", {}))
    with pytest.raises(AssertionError):
        assert_same(run_staggered(hot, prompts, gap=0, group=4), expected)
