"""Kimi-Linear decode steps through the fixed buffers of `DecodeGraphs` (the path CUDA graphs replay; eager on the
CPU), with MLA attending in latent space over a context bound of the cache's whole row and HOLD rows padding the
buckets: transformers' greedy text in every state mode, plain and with scripted n-gram drafts accepted as scripted.
MLA's forward needs no host value mid-step (the MoE routing of these tiny layers syncs on the CPU, which is
harmless there; on CUDA it is the fused MoE)."""

from __future__ import annotations

import pytest

from lightllm.engine.messages import NewRequest, TokenChunk
from lightllm.engine.sampling_params import SamplingParams
from lightllm.models.layers.mla import LatentAttention
from lightllm.server.args import load_server_args
from lightllm.server.engine_process import build_engine
from lightllm.tools.make_tiny_model import tiny_model_dir
from lightllm.worker.graphs.decode import DecodeGraphs
from unit_tests.helpers.scripted_drafts import ScriptedDrafts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# six requests admitted together, finishing two tokens apart: buckets 6, 4, 2, 1 with HOLD rows in between
PROMPTS = ([5, 6, 7, 8, 9], list(range(30, 53)), [11, 12], list(range(60, 71)), [3, 1, 4, 1, 5], [99] * 7)
NUM_TOKENS = 14
MAX_TOKENS = [4 + 2 * i for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def expected(hf_oracle):
    model_dir = str(tiny_model_dir("kimi_linear"))
    oracle = hf_oracle(model_dir)
    return model_dir, [oracle.greedy(p, NUM_TOKENS) for p in PROMPTS]


def _engine(model_dir: str, num_drafts: int, mode: str = "native"):
    flags = {"spec_ngram": num_drafts} if num_drafts else {}
    args, info = load_server_args(
        [],
        model_dir=model_dir,
        device="cpu",
        ssm_state_mode=mode,
        max_running_requests=6,
        chunked_prefill_size=64,
        max_total_token_num=512,
        **flags,
    )
    engine = build_engine(args, info, "lightllm.server.runner_factory:create_runner")
    assert engine.runner.init_decode_graphs(use_graphs=False)
    return engine


def _run(engine) -> list[list[int]]:
    """Every prompt's greedy tokens, all admitted at once."""
    for i, p in enumerate(PROMPTS):
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i], ignore_eos=True)
        assert engine.add_request(NewRequest(f"r{i}", p, params)) == []
    out = {f"r{i}": [] for i in range(len(PROMPTS))}
    while engine.has_work():
        for o in engine.step():
            if isinstance(o, TokenChunk):
                out[o.req_id] += o.token_ids
    return [out[f"r{i}"] for i in range(len(PROMPTS))]


# compact differs from native only under speculation (the server refuses it without)
@pytest.mark.parametrize(
    "mode, num_drafts",
    [("native", 0), ("replay", 0), ("native", 2), ("compact", 2), ("replay", 2)],
    ids=lambda v: v if isinstance(v, str) else f"ngram{v}",
)
def test_kimi_fixed_buffer_decode_matches_transformers(expected, num_drafts, mode, monkeypatch):
    model_dir, greedy = expected
    engine = _engine(model_dir, num_drafts, mode)
    latent_groups: list[int] = []
    attend_latent = LatentAttention._attend_latent

    def counted(self, q, g, ctx, o):
        # the fixed buffers' decode group: bounded by the cache's row length, not the batch's contexts
        if g.context_len == ctx.kv.max_req_len:
            latent_groups.append(g.token_index.shape[0])
        return attend_latent(self, q, g, ctx, o)

    monkeypatch.setattr(LatentAttention, "_attend_latent", counted)
    calls: list[tuple[int, int]] = []
    run = DecodeGraphs.run

    def counted_run(self, input_ids, q_lens, *rest):
        calls.append((len(q_lens), self.bucket(len(q_lens))))
        return run(self, input_ids, q_lens, *rest)

    monkeypatch.setattr(DecodeGraphs, "run", counted_run)
    if num_drafts:
        drafts = ScriptedDrafts({tuple(p): e for p, e in zip(PROMPTS, greedy)}, num_drafts, engine.runner.vocab_size)
        engine.speculator = drafts
    assert _run(engine) == [g[:n] for g, n in zip(greedy, MAX_TOKENS)]
    # decode-only steps went through the buffers, some padded with HOLD rows, and MLA attended them in latent space
    assert len(calls) >= 3 and any(n < bucket for n, bucket in calls), str(calls)
    assert latent_groups and set(latent_groups) <= {bucket for _, bucket in calls}, str(latent_groups)
    assert engine.runner.num_free_requests() == 6 and engine.runner.num_free_kv_tokens() == 512


def test_latent_attention_over_the_wrong_rows_breaks_the_text(expected, monkeypatch):
    """Teeth: the same plain run with the fixed-buffer decode group reading its rows' latents through rotated table
    rows must not give the reference text."""
    import dataclasses

    import torch

    model_dir, greedy = expected
    engine = _engine(model_dir, 0)
    attend_latent = LatentAttention._attend_latent

    def rotated(self, q, g, ctx, o):
        if g.context_len == ctx.kv.max_req_len:
            g = dataclasses.replace(g, table_rows=torch.roll(g.table_rows, 1))
        return attend_latent(self, q, g, ctx, o)

    monkeypatch.setattr(LatentAttention, "_attend_latent", rotated)
    assert _run(engine) != [g[:n] for g, n in zip(greedy, MAX_TOKENS)]
