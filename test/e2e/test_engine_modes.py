"""The engine with the real ModelRunner on tiny checkpoints: greedy text equals transformers' greedy for every
architecture × state mode × speculation, with chunked prefill and several requests batched together."""

from __future__ import annotations

import pytest

from lightllm.engine.messages import NewRequest, TokenChunk
from lightllm.engine.sampling_params import SamplingParams
from lightllm.server.args import load_server_args
from lightllm.server.engine_process import build_engine
from lightllm.tools.make_tiny_model import tiny_model_dir

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "kimi_linear")
PROMPTS = ([5, 6, 7, 8, 9], list(range(30, 53)))
NUM_TOKENS = 10
COMBOS = [
    ("native", {}),
    ("native", {"spec_ngram": 2}),
    ("native", {"mtp_step": 2}),
    ("compact", {"spec_ngram": 2}),
    ("compact", {"mtp_step": 2}),
    ("replay", {}),
    ("replay", {"spec_ngram": 2}),
    ("replay", {"mtp_step": 3}),
]


def _ids(combo) -> str:
    mode, spec = combo
    return "-".join([mode, *(f"{k}{v}" for k, v in spec.items())]) if spec else f"{mode}-nospec"


@pytest.fixture(scope="module")
def reference(hf_oracle):
    cache = {}

    def get(arch: str) -> tuple[str, list[list[int]]]:
        if arch not in cache:
            # the per-user checkpoint cache: built once per machine, shared with the server tests
            model_dir = str(tiny_model_dir(arch))
            oracle = hf_oracle(model_dir)
            cache[arch] = (model_dir, [oracle.greedy(p, NUM_TOKENS) for p in PROMPTS])
        return cache[arch]

    return get


def _engine(model_dir: str, mode: str, spec: dict, **flags):
    args, info = load_server_args(
        [],
        model_dir=model_dir,
        device="cpu",
        ssm_state_mode=mode,
        max_running_requests=4,
        chunked_prefill_size=8,
        max_total_token_num=512,
        **spec,
        **flags,
    )
    return build_engine(args, info, "lightllm.server.runner_factory:create_runner")


def _run(engine, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts):
        assert engine.add_request(NewRequest(f"r{i}", p, params)) == []
    out = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_work():
        for o in engine.step():
            if isinstance(o, TokenChunk):
                out[o.req_id] += o.token_ids
            else:
                assert getattr(o, "reason", "length") == "length", o
    return [out[f"r{i}"] for i in range(len(prompts))]


def _matrix():
    for arch in ARCHS:
        for combo in COMBOS:
            if arch == "kimi_linear" and "mtp_step" in combo[1]:
                # Kimi-Linear has no MTP head (the server refuses --mtp_step for it)
                continue
            if arch == "qwen3_5_moe" and combo not in (("native", {}), ("replay", {"mtp_step": 3})):
                # same linear-attention layers as qwen3_5; only the FFN differs
                continue
            yield pytest.param(arch, combo, id=f"{arch}-{_ids(combo)}")


@pytest.mark.parametrize("arch, combo", list(_matrix()))
def test_engine_greedy_matches_transformers(reference, arch, combo):
    mode, spec = combo
    model_dir, expected = reference(arch)
    engine = _engine(model_dir, mode, spec)
    assert _run(engine, PROMPTS) == expected
    assert engine.runner.num_free_requests() == 4 and engine.runner.num_free_kv_tokens() == 512


class OracleDrafts:
    """Drafts from the known greedy continuation; every other window has one wrong draft, at a rotating
    position, so windows accept 0..K drafts."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], num_drafts: int):
        self.continuations, self.num_drafts = continuations, num_drafts
        self.windows: dict[str, int] = {}

    def propose(self, reqs) -> None:
        for req in reqs:
            truth = self.continuations[tuple(req.prompt_ids)][len(req.output_ids) :]
            drafts = truth[: min(self.num_drafts, req.num_remaining_tokens - 1)]
            n = self.windows[req.req_id] = self.windows.get(req.req_id, -1) + 1
            if drafts and n % 2 == 1:
                i = (n // 2) % len(drafts)
                drafts[i] = (drafts[i] + 1) % 512
            req.draft_ids = drafts

    def after_step(self, runner, rows, hidden) -> None:
        pass

    def flush(self, reqs=None) -> None:
        pass


@pytest.mark.parametrize("mode", ["native", "compact", "replay"])
@pytest.mark.parametrize("arch", ["qwen3_5", "kimi_linear"])
def test_engine_partial_acceptance_keeps_greedy_exact(reference, arch, mode):
    """Real verify windows with 0..3 accepted drafts roll the state back correctly in every mode."""
    model_dir, expected = reference(arch)
    engine = _engine(model_dir, mode, {"spec_ngram": 3})
    # the reference continuation plus one extra token so drafts exist up to the last position
    engine.speculator = OracleDrafts({tuple(p): e for p, e in zip(PROMPTS, expected)}, 3)
    assert _run(engine, PROMPTS) == expected
    s = engine.stats
    assert 0 < s.num_accepted_draft_tokens < s.num_draft_tokens
    assert s.accepted_length_counts[-1] > 0 and s.accepted_length_counts[0] + s.accepted_length_counts[1] > 0
