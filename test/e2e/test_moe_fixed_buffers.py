"""A MoE model (tiny Qwen3.5-MoE) through the fixed-buffer decode path that CUDA graphs replay (eager on the CPU):
MoE routing needs no host value mid-step (on CUDA it runs in `lightllm.kernels.fused_moe` with fixed shapes).
Batches padded to buckets with HOLD rows, whose tokens are routed to experts too, give transformers' greedy text in
every state mode, plain and with scripted drafts;
overlapped MTP steps (the verify, acceptance, accept and drafts of one step as one graph function) give the
synchronous steps' tokens (twin: other acceptance coins give other tokens)."""

from __future__ import annotations

import pytest

from lightllm.engine.messages import NewRequest, TokenChunk
from lightllm.engine.sampling_params import SamplingParams
from lightllm.engine.speculative.acceptance import SimulatedAcceptance
from lightllm.server.args import load_server_args
from lightllm.server.engine_process import build_engine
from lightllm.tools.make_tiny_model import tiny_model_dir
from lightllm.worker.graphs.decode import DecodeGraphs
from unit_tests.helpers.scripted_drafts import ScriptedDrafts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ([5, 6, 7, 8, 9], list(range(30, 53)), [11, 12], [99] * 7, [3, 1, 4, 1, 5])
MAX_TOKENS = [4 + 2 * i for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def expected(hf_oracle):
    model_dir = str(tiny_model_dir("qwen3_5_moe"))
    oracle = hf_oracle(model_dir)
    return model_dir, [oracle.greedy(p, max(MAX_TOKENS)) for p in PROMPTS]


def _engine(model_dir: str, mode: str, max_running_requests: int, acceptance=None, **flags):
    """A MoE engine on the CPU with its decode (and draft) buffers run eagerly."""
    args, info = load_server_args(
        [],
        model_dir=model_dir,
        device="cpu",
        ssm_state_mode=mode,
        max_running_requests=max_running_requests,
        chunked_prefill_size=64,
        max_total_token_num=512,
        **flags,
    )
    engine = build_engine(args, info, "lightllm.server.runner_factory:create_runner", acceptance)
    assert engine.runner.init_decode_graphs(use_graphs=False)
    return engine


def _generate(engine, max_tokens: list[int]) -> dict[str, list[int]]:
    """PROMPTS greedily, request i up to `max_tokens[i]` tokens; each request's tokens."""
    for i, p in enumerate(PROMPTS):
        params = SamplingParams(temperature=0, max_tokens=max_tokens[i], ignore_eos=True)
        assert engine.add_request(NewRequest(f"r{i}", p, params)) == []
    out = {f"r{i}": [] for i in range(len(PROMPTS))}
    while engine.has_work():
        for o in engine.step():
            if isinstance(o, TokenChunk):
                out[o.req_id] += o.token_ids
    return out


# compact differs from native only under speculation (the server refuses it without)
@pytest.mark.parametrize(
    "mode, num_drafts",
    [("native", 0), ("replay", 0), ("native", 3), ("compact", 3), ("replay", 3)],
    ids=lambda v: v if isinstance(v, str) else f"ngram{v}",
)
def test_moe_decode_through_fixed_buffers_matches_transformers(expected, mode, num_drafts, monkeypatch):
    model_dir, greedy = expected
    engine = _engine(model_dir, mode, 5, **({"spec_ngram": num_drafts} if num_drafts else {}))
    if num_drafts:
        # drafts from transformers' text with one corrupted in every other window: windows keep 0 .. 3 of them
        scripts = {tuple(p): g for p, g in zip(PROMPTS, greedy)}
        engine.speculator = ScriptedDrafts(scripts, num_drafts, engine.runner.vocab_size)
    calls: list[tuple[int, int]] = []
    run = DecodeGraphs.run

    def counted(self, input_ids, q_lens, *rest):
        calls.append((len(q_lens), self.bucket(len(q_lens))))
        return run(self, input_ids, q_lens, *rest)

    monkeypatch.setattr(DecodeGraphs, "run", counted)
    out = _generate(engine, MAX_TOKENS)
    assert [out[f"r{i}"] for i in range(len(PROMPTS))] == [g[:n] for g, n in zip(greedy, MAX_TOKENS)]
    assert len(calls) >= 3 and any(n < bucket for n, bucket in calls), str(calls)


def _mtp_run(model_dir: str, mode: str, overlap: bool, seed: int) -> tuple[dict, list[bool]]:
    """PROMPTS through a MoE engine with MTP 2 at simulated acceptance 0.6 (`seed`: the coins); the tokens and, per
    launch of an overlapped verify, whether it chained from the step in flight."""
    engine = _engine(model_dir, mode, 3, SimulatedAcceptance(0.6, seed), mtp_step=2)
    assert engine.runner.spec_step_graphs is not None
    engine.overlap_schedule = overlap
    launches: list[bool] = []
    launch = engine.overlap.spec.launch
    engine.overlap.spec.launch = lambda plan, previous: launches.append(previous is not None) or launch(plan, previous)
    return _generate(engine, [n + 8 for n in MAX_TOKENS]), launches


@pytest.mark.parametrize("mode", ["native", "replay"])
def test_moe_overlapped_mtp_steps_equal_synchronous(expected, mode):
    model_dir, _ = expected
    on, launches = _mtp_run(model_dir, mode, True, seed=5)
    off, off_launches = _mtp_run(model_dir, mode, False, seed=5)
    # three rows in a bucket of four (a HOLD row) chained from the step in flight, the synchronous run none
    assert sum(launches) >= 4 and not off_launches
    assert on == off
    assert [len(t) for t in on.values()] == [n + 8 for n in MAX_TOKENS]
    twin, _ = _mtp_run(model_dir, mode, True, seed=6)
    assert twin != on


def test_moe_decode_with_misrouted_tokens_breaks_the_text(expected, monkeypatch):
    """Teeth: the same plain run with every token sent to the next expert must not give transformers' text."""
    from lightllm.models.layers import moe as moe_module

    model_dir, greedy = expected
    route = moe_module.route_softmax

    def misrouted(logits, cfg):
        weights, ids = route(logits, cfg)
        return weights, (ids + 1) % logits.shape[-1]

    monkeypatch.setattr(moe_module, "route_softmax", misrouted)
    out = _generate(_engine(model_dir, "native", 5), MAX_TOKENS)
    assert [out[f"r{i}"] for i in range(len(PROMPTS))] != [g[:n] for g, n in zip(greedy, MAX_TOKENS)]
