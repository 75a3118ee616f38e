"""Decode steps through the fixed buffers of `DecodeGraphs` (the path CUDA graphs replay; eager on the CPU):
batches padded to buckets with HOLD rows give transformers' greedy text, with scripted drafts accepted exactly as
scripted, over replay fold cycles and slot reuse, in every state mode."""

from __future__ import annotations

import pytest

from lightllm.engine.messages import NewRequest, TokenChunk
from lightllm.engine.sampling_params import SamplingParams
from lightllm.server.args import load_server_args
from lightllm.server.engine_process import build_engine
from lightllm.tools.make_tiny_model import tiny_model_dir
from lightllm.worker.graphs.buckets import batch_buckets
from lightllm.worker.graphs.decode import DecodeGraphs
from unit_tests.helpers.scripted_drafts import ScriptedDrafts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# six requests admitted together, finishing two tokens apart: buckets 6, 4, 2, 1 with HOLD rows in between
PROMPTS = ([5, 6, 7, 8, 9], list(range(30, 53)), [11, 12], list(range(60, 71)), [3, 1, 4, 1, 5], [99] * 7)
NUM_TOKENS = 14
# staggered lengths: the batch shrinks one request at a time, so odd row counts pad up to a bucket
MAX_TOKENS = [4 + 2 * i for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def expected(hf_oracle):
    model_dir = str(tiny_model_dir("qwen3_5"))
    oracle = hf_oracle(model_dir)
    return model_dir, [oracle.greedy(p, NUM_TOKENS) for p in PROMPTS]


def _engine(model_dir: str, mode: str, num_drafts: int):
    flags = {"spec_ngram": num_drafts} if num_drafts else {}
    if mode == "replay":
        # the smallest history: folds every step or two
        flags["replay_capacity"] = 4
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


def _run(engine) -> tuple[list[list[int]], dict[str, list[int]]]:
    for i, p in enumerate(PROMPTS):
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i], ignore_eos=True)
        assert engine.add_request(NewRequest(f"r{i}", p, params)) == []
    out = {f"r{i}": [] for i in range(len(PROMPTS))}
    chunks: dict[str, list[int]] = {k: [] for k in out}
    while engine.has_work():
        for o in engine.step():
            if isinstance(o, TokenChunk):
                out[o.req_id] += o.token_ids
                chunks[o.req_id].append(len(o.token_ids))
    return [out[f"r{i}"] for i in range(len(PROMPTS))], chunks


@pytest.mark.parametrize(
    "mode, num_drafts",
    [("native", 0), ("replay", 0), ("native", 3), ("compact", 2), ("compact", 3), ("replay", 1), ("replay", 3)],
    ids=lambda v: str(v),
)
def test_fixed_buffer_decode_matches_transformers_with_scripted_acceptance(expected, mode, num_drafts, monkeypatch):
    model_dir, greedy = expected
    engine = _engine(model_dir, mode, num_drafts)
    calls: list[tuple[int, int]] = []
    run = DecodeGraphs.run

    def counted(self, input_ids, q_lens, *rest):
        calls.append((len(q_lens), self.bucket(len(q_lens))))
        return run(self, input_ids, q_lens, *rest)

    monkeypatch.setattr(DecodeGraphs, "run", counted)
    drafts = None
    if num_drafts:
        drafts = ScriptedDrafts({tuple(p): e for p, e in zip(PROMPTS, greedy)}, num_drafts, engine.runner.vocab_size)
        engine.speculator = drafts
    tokens, chunks = _run(engine)
    assert tokens == [g[:n] for g, n in zip(greedy, MAX_TOKENS)]
    if drafts is None:
        # a second round reuses every slot right after tenants that left replay history / native slot offsets
        assert _run(engine)[0] == tokens
    # decode-only steps went through the buffers, some of them padded with HOLD rows
    assert len(calls) >= 3 and any(n < bucket for n, bucket in calls), str(calls)
    if drafts is not None:
        # the first chunk is the prefill's token; then one chunk per decode window, of exactly the scripted size
        for req_id, sizes in chunks.items():
            scripted = drafts.expected_tokens_per_window[req_id][: len(sizes) - 1]
            assert sizes[1:] == scripted, req_id
        assert any(k > 1 for sizes in chunks.values() for k in sizes[1:]), "no window accepted a draft"
    assert engine.runner.num_free_requests() == 6 and engine.runner.num_free_kv_tokens() == 512


def test_shifted_positions_break_the_text(expected, monkeypatch):
    """Teeth: the same run with the buffers' positions off by one must not give the reference text."""
    model_dir, greedy = expected
    engine = _engine(model_dir, "replay", 0)
    upload = DecodeGraphs._upload

    def shifted(self, rows):
        self._host64[1, : rows * self.width] += 1
        upload(self, rows)

    monkeypatch.setattr(DecodeGraphs, "_upload", shifted)
    tokens, _ = _run(engine)
    assert tokens != [g[:n] for g, n in zip(greedy, MAX_TOKENS)]


def test_batch_buckets():
    assert batch_buckets(4) == [1, 2, 4]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(256) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 128, 160, 192, 224, 256]
