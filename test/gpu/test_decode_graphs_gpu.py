"""CUDA-graph decode == eager decode on the GPU: every state mode, with scripted drafts accepted exactly as
scripted, over replay fold cycles and slot reuse (a second round of requests in the same slots)."""

from __future__ import annotations

import pytest
import torch

from lightllm.engine.messages import NewRequest, TokenChunk
from lightllm.engine.sampling_params import SamplingParams
from lightllm.server.args import load_server_args
from lightllm.server.engine_process import build_engine
from lightllm.tools.make_tiny_model import tiny_model_dir
from unit_tests.helpers.scripted_drafts import ScriptedDrafts

pytestmark = pytest.mark.gpu

PROMPTS = ([5, 6, 7, 8, 9], list(range(30, 53)), [11, 12], list(range(60, 71)), [3, 1, 4, 1, 5], [99] * 7)
MAX_TOKENS = [6 + 3 * i for i in range(len(PROMPTS))]
COMBOS = [("native", 0), ("replay", 0), ("native", 3), ("compact", 2), ("compact", 3), ("replay", 1), ("replay", 3)]


def _engine(mode: str, num_drafts: int, graphs: bool):
    flags = {"spec_ngram": num_drafts} if num_drafts else {}
    if mode == "replay":
        flags["replay_capacity"] = 4
    args, info = load_server_args(
        [],
        model_dir=str(tiny_model_dir("qwen3_5")),
        device="cuda",
        data_type="float32",
        ssm_state_mode=mode,
        max_running_requests=6,
        chunked_prefill_size=64,
        max_total_token_num=1024,
        disable_cudagraph=not graphs,
        **flags,
    )
    engine = build_engine(args, info, "lightllm.server.runner_factory:create_runner")
    assert (engine.runner.decode_graphs is not None) == graphs
    if graphs:
        assert engine.runner.decode_graphs.use_graphs, "capture failed (see the log)"
    return engine


def _run(engine, drafts) -> tuple[list[list[int]], list[list[float]]]:
    if drafts is not None:
        engine.speculator = drafts
    for i, p in enumerate(PROMPTS):
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i], ignore_eos=True, logprobs=0)
        assert engine.add_request(NewRequest(f"r{i}", p, params)) == []
    tokens = {f"r{i}": [] for i in range(len(PROMPTS))}
    logprobs = {k: [] for k in tokens}
    while engine.has_work():
        for o in engine.step():
            if isinstance(o, TokenChunk):
                tokens[o.req_id] += o.token_ids
                logprobs[o.req_id] += o.logprobs
    keys = [f"r{i}" for i in range(len(PROMPTS))]
    return [tokens[k] for k in keys], [logprobs[k] for k in keys]


@pytest.mark.parametrize("mode, num_drafts", COMBOS, ids=lambda v: str(v))
def test_cuda_graph_decode_equals_eager(mode, num_drafts):
    eager = _engine(mode, num_drafts, graphs=False)
    graph = _engine(mode, num_drafts, graphs=True)
    continuations = None
    if num_drafts:
        # drafts follow a plain eager run's greedy text, corrupted where the script says
        plain = _run(_engine("native", 0, graphs=False), None)[0]
        continuations = {tuple(p): t for p, t in zip(PROMPTS, plain)}
    # the second round reuses every slot right after the first round's tenants
    for round_ in range(2):
        (tok_e, lp_e), (tok_g, lp_g) = (
            _run(e, ScriptedDrafts(continuations, num_drafts, 512) if num_drafts else None) for e in (eager, graph)
        )
        assert tok_g == tok_e, f"round {round_}"
        if continuations is not None:
            assert tok_g == [continuations[tuple(p)][: len(t)] for p, t in zip(PROMPTS, tok_g)]
        for a, b in zip(lp_e, lp_g):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4), f"round {round_}"
    assert graph.runner.num_free_requests() == 6 and graph.runner.num_free_kv_tokens() == 1024
