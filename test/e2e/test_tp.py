"""Tensor parallelism on CPU (gloo, real follower processes): a `--tp 2` engine's greedy tokens equal a `--tp 1`
engine's for every architecture × state mode × speculation, with chunked prefill, batching and prefix-cache
resumes; `--tp 4` where the tiny heads divide; checkpoints leave a TP-2 engine laid out by global head.

One 2-rank group serves every engine of the module: each engine builds its runners on the same processes."""

from __future__ import annotations

import pytest
import torch

from lightllm.engine.messages import NewRequest, TokenChunk
from lightllm.engine.sampling_params import SamplingParams
from lightllm.models.tp_group import Plan, TPGroup
from lightllm.models.tp_runner import LockstepRunner
from lightllm.server.args import load_server_args
from lightllm.server.engine_process import engine_for_runner
from lightllm.server.runner_factory import build_rank_runner, create_tp_runner
from lightllm.tools.make_tiny_model import tiny_model_dir

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NUM_TOKENS = 8
# the third prompt extends the second: it resumes from the prefix cache the second one filled
FIRST = ([5, 6, 7, 8, 9], list(range(30, 53)))
SECOND = (list(range(30, 53)) + [7, 7, 9, 11, 13, 15, 17, 19, 21],)
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
ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "kimi_linear")


def _combo_id(combo) -> str:
    mode, spec = combo
    return "-".join([mode, *(f"{k}{v}" for k, v in spec.items())]) if spec else f"{mode}-nospec"


def _cases():
    for arch in ARCHS:
        for combo in COMBOS:
            # the tiny Kimi checkpoint has no MTP head
            if arch == "kimi_linear" and "mtp_step" in combo[1]:
                continue
            yield pytest.param(arch, combo, id=f"{arch}-{_combo_id(combo)}")


@pytest.fixture(scope="module")
def tp2():
    group = TPGroup(2, "cpu", num_threads=1)
    yield group
    group.shutdown()


def _args(model_dir: str, mode: str, spec: dict, tp: int):
    args, info = load_server_args(
        [],
        model_dir=model_dir,
        device="cpu",
        tp=tp,
        ssm_state_mode=mode,
        max_running_requests=4,
        chunked_prefill_size=8,
        max_total_token_num=512,
        prefix_cache_state_bytes=1 << 20,
        prefix_cache_checkpoint_interval=8,
        **spec,
    )
    return args, info


def _run(engine, prompts, tag: str) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts):
        assert engine.add_request(NewRequest(f"{tag}{i}", p, params)) == []
    out = {f"{tag}{i}": [] for i in range(len(prompts))}
    while engine.has_work():
        for o in engine.step():
            if isinstance(o, TokenChunk):
                out[o.req_id] += o.token_ids
            else:
                assert getattr(o, "reason", "length") == "length", o
    return [out[f"{tag}{i}"] for i in range(len(prompts))]


def _generate(engine) -> list[list[int]]:
    tokens = _run(engine, FIRST, "a") + _run(engine, SECOND, "b")
    stats = engine.runner.prefix_cache_stats()
    assert stats is not None and stats["num_hit_tokens"] > 0, f"the second round did not resume from the cache: {stats}"
    return tokens


def _single(model_dir: str, mode: str, spec: dict) -> list[list[int]]:
    args, info = _args(model_dir, mode, spec, 1)
    return _generate(engine_for_runner(args, build_rank_runner(args, info)))


def _sharded(group: TPGroup, model_dir: str, mode: str, spec: dict) -> list[list[int]]:
    args, info = _args(model_dir, mode, spec, group.size)
    runner = create_tp_runner(args, info, group)
    try:
        return _generate(engine_for_runner(args, runner))
    finally:
        runner.close()


@pytest.mark.parametrize("arch, combo", list(_cases()))
def test_tp2_greedy_equals_tp1(tp2, arch, combo):
    model_dir = str(tiny_model_dir(arch))
    mode, spec = combo
    expected = _single(model_dir, mode, spec)
    assert _sharded(tp2, model_dir, mode, spec) == expected


def test_tp2_with_a_wrong_shard_differs(tp2):
    """Teeth: the follower loads another seed's weights (same shapes) while rank 0 loads the served ones."""
    model_dir, other = str(tiny_model_dir("qwen3_5")), str(tiny_model_dir("qwen3_5", seed=1))
    expected = _single(model_dir, "native", {})
    args, info = _args(model_dir, "native", {}, 2)
    tp2.send(Plan("build", (_args(other, "native", {}, 2)[0], info)))
    runner = LockstepRunner(build_rank_runner(args, info, 0, 2), tp2)
    try:
        assert _generate(engine_for_runner(args, runner)) != expected
    finally:
        runner.close()
