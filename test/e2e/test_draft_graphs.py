"""MTP drafting through the fixed buffers of `DraftGraphs` (the path CUDA graphs replay; eager on the CPU): the
drafts and their logits of every step equal the drafter's ordinary path, through prefill commits (eager), verify
windows of every accepted length, batches shrinking through buckets, and slot reuse."""

from __future__ import annotations

import pytest
import torch

from lightllm.engine.messages import NewRequest, TokenChunk
from lightllm.engine.sampling_params import SamplingParams
from lightllm.server.args import load_server_args
from lightllm.server.engine_process import build_engine
from lightllm.server.runner_factory import DEFAULT_RUNNER_FACTORY
from lightllm.tools.make_tiny_model import tiny_model_dir
from lightllm.worker.graphs.draft import DraftGraphs
from unit_tests.helpers.scripted_drafts import ScriptedDrafts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ([5, 6, 7, 8, 9], list(range(30, 53)), [11, 12], list(range(60, 71)), [3, 1, 4, 1, 5], [99] * 7)
MAX_TOKENS = [6 + 2 * i for i in range(len(PROMPTS))]


class _ScriptedWindows:
    """Real MTP drafting after every step (what is compared), scripted drafts in the verify windows (so windows
    accept 1, 2 and 3 tokens and the head commits that many pairs)."""

    def __init__(self, mtp, scripted: ScriptedDrafts):
        self.num_drafts, self.mtp, self.scripted = mtp.num_drafts, mtp, scripted

    def propose(self, reqs):
        self.mtp.flush()
        self.scripted.propose(reqs)

    def after_step(self, runner, rows, hidden):
        self.mtp.after_step(runner, rows, hidden)

    def flush(self, reqs=None):
        self.mtp.flush(reqs)


def _run(fixed_buffers: bool, mode: str, continuations=None, perturb: bool = False, device: str = "cpu"):
    """On CUDA `fixed_buffers` means captured graphs (and the reference is eager), on the CPU the same buffers run
    eagerly."""
    args, info = load_server_args(
        [],
        model_dir=str(tiny_model_dir("qwen3_5")),
        device=device,
        data_type="float32",
        ssm_state_mode=mode,
        mtp_step=2,
        max_running_requests=4,
        chunked_prefill_size=64,
        max_total_token_num=512,
        disable_cudagraph=device == "cuda" and not fixed_buffers,
    )
    engine = build_engine(args, info, DEFAULT_RUNNER_FACTORY)
    runner = engine.runner
    if fixed_buffers:
        if device == "cpu":
            assert runner.init_decode_graphs(use_graphs=False)
        graphs = runner.drafter.graphs
        assert isinstance(graphs, DraftGraphs)
        assert graphs.use_graphs == (device == "cuda"), "capture failed (see the log)"
        if perturb:
            run = graphs.run

            def perturbed(kv_rows, q_lens, cached, tokens, hidden):
                # additive: the head normalizes its hidden input, so a scale would not show
                return run(kv_rows, q_lens, cached, tokens, hidden + 0.05)

            graphs.run = perturbed
    drafted = []
    inner = runner.draft_with_logits

    def recording(handles, next_tokens, mtp_step):
        drafts, logits = inner(handles, next_tokens, mtp_step)
        drafted.append((list(handles), drafts.clone(), logits.clone()))
        return drafts, logits

    runner.draft_with_logits = recording
    if continuations is not None:
        scripted = ScriptedDrafts(continuations, 2, runner.vocab_size)
        engine.speculator = _ScriptedWindows(engine.speculator, scripted)
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i], ignore_eos=True)
        assert engine.add_request(NewRequest(f"r{i}", prompt, params)) == []
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            if isinstance(out, TokenChunk):
                tokens.setdefault(out.req_id, []).extend(out.token_ids)
    return tokens, drafted, engine.stats


def _continuations(mode: str, device: str = "cpu") -> dict[tuple[int, ...], list[int]]:
    """Each prompt's greedy continuation (what any drafts verify to)."""
    tokens, _, _ = _run(False, mode, device=device)
    return {tuple(p): tokens[f"r{i}"] + [0] * 4 for i, p in enumerate(PROMPTS)}


def _check_equal(mode: str, device: str, tol: float) -> None:
    continuations = _continuations(mode, device)
    tokens, drafted, stats = _run(False, mode, continuations, device=device)
    tokens_fixed, drafted_fixed, stats_fixed = _run(True, mode, continuations, device=device)
    assert tokens_fixed == tokens
    assert all(tokens[f"r{i}"] == continuations[tuple(p)][: MAX_TOKENS[i]] for i, p in enumerate(PROMPTS))
    assert len(drafted_fixed) == len(drafted) > 10
    for (h0, d0, l0), (h1, d1, l1) in zip(drafted, drafted_fixed):
        assert h0 == h1
        assert torch.equal(d0, d1)
        torch.testing.assert_close(l1, l0, rtol=tol, atol=tol)
    assert stats_fixed.num_accepted_draft_tokens == stats.num_accepted_draft_tokens > 0


@pytest.mark.parametrize("mode", ["native", "replay"])
def test_fixed_buffer_drafts_equal_the_ordinary_drafter(mode):
    _check_equal(mode, "cpu", 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["native", "compact", "replay"])
def test_cuda_graph_drafts_equal_eager_drafts(mode):
    _check_equal(mode, "cuda", 1e-4)


def test_a_perturbed_hidden_input_changes_the_drafts():
    """Teeth: the comparison above sees what the fixed buffers feed the MTP head."""
    continuations = _continuations("replay")
    _, drafted, _ = _run(False, "replay", continuations)
    _, drafted_bad, _ = _run(True, "replay", continuations, perturb=True)
    assert any(not torch.allclose(l0, l1, rtol=1e-5, atol=1e-5) for (_, _, l0), (_, _, l1) in zip(drafted, drafted_bad))
