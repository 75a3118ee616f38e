"""CUDA-graph short prefill == eager prefill on the GPU: the prefix-cache scenario (hits whose suffix runs padded to
a token bucket, chunked prompts, next turns, exact repeats) gives the eager engine's tokens and logprobs in every
state mode and speculation, and leaves every pool as it started."""

from __future__ import annotations

import random

import pytest
import torch

from unit_tests.helpers.prefix_scenario import make_engine, run_scenario, run_staggered, scenario, staggered_prompts

pytestmark = pytest.mark.gpu

COMBOS = [("native", {}), ("compact", {"spec_ngram": 3}), ("replay", {}), ("replay", {"mtp_step": 2})]


def _engine(mode: str, spec: dict, graphs: bool, chunk: int):
    engine = make_engine(
        "qwen3_5",
        mode,
        spec,
        device="cuda",
        data_type="float32",
        disable_cudagraph=not graphs,
        chunked_prefill_size=chunk,
    )
    runner = engine.runner
    assert (runner.prefill_graphs is not None) == graphs
    if graphs:
        assert runner.prefill_graphs.use_graphs, "capture failed (see the log)"
    return engine


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join([c[0], *(f"{k}{v}" for k, v in c[1].items())]))
@pytest.mark.parametrize("chunk", [8, 64])
def test_cuda_graph_prefill_equals_eager(combo, chunk):
    mode, spec = combo
    eager, graph = _engine(mode, spec, False, chunk), _engine(mode, spec, True, chunk)
    runs = graph.runner.prefill_graphs._graphs
    replays = []
    for bucket, g in list(runs._graphs.items()):
        original = g.replay

        def counted(bucket=bucket, original=original):
            replays.append(bucket)
            original()

        g.replay = counted
    expected, got = run_scenario(eager, seed=31), run_scenario(graph, seed=31)
    assert replays, "no prefill step replayed a graph"
    if chunk == 8:
        assert [r.cached for r in got] == scenario(31)[1]
    for i, (e, g) in enumerate(zip(expected, got)):
        assert g.tokens == e.tokens, f"request {i}"
        assert g.cached == e.cached, f"request {i}"
        # fla's chunk kernels take fp32 dots as tf32: the padded one-sequence launch and the varlen one round apart
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(e.logprobs), atol=1e-3), f"request {i}"
    assert graph.runner.num_free_kv_tokens() == 512 and graph.runner.num_free_requests() == 4


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join([c[0], *(f"{k}{v}" for k, v in c[1].items())]))
@pytest.mark.parametrize("group, gap", [(1, 3), (2, 3), (4, 0)], ids=["one", "pairs", "four-at-once"])
def test_mixed_steps_replay_both_graphs_like_eager(combo, group, gap):
    """Requests arriving while others decode, one, two or four at a time: a step's short prefill rows replay the
    prefill graph one after another (their outputs in one memory pool), then the decode graph; the text is the
    eager engine's."""
    mode, spec = combo
    prompts = staggered_prompts(random.Random(41))
    eager, graph = _engine(mode, spec, False, 64), _engine(mode, spec, True, 64)
    expected, got = (run_staggered(e, prompts, gap=gap, group=group) for e in (eager, graph))
    for i, (e, g) in enumerate(zip(expected, got)):
        assert g.tokens == e.tokens, f"request {i}"
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(e.logprobs), atol=1e-3), f"request {i}"
    assert graph.runner.num_free_kv_tokens() == 512 and graph.runner.num_free_requests() == 4
