"""The host tier under tensor parallelism (CPU, gloo, real follower processes): each rank of a `--tp 2` engine
writes its heads as one section of an entry, which is READY once both have; another `--tp 2` engine of another
state mode resumes from it (rank 0 picks the entry for both ranks) with the cold run's tokens. A `--tp 1` engine
does not see entries of another shard layout."""

from __future__ import annotations

import random
import uuid

import numpy as np
import pytest

from lightllm.cache.host_tier import HostArena
from lightllm.cache.host_tier.arena import READY
from lightllm.engine.messages import NewRequest, TokenChunk
from lightllm.engine.sampling_params import SamplingParams
from lightllm.server.args import load_server_args
from lightllm.server.engine_process import engine_for_runner
from lightllm.server.runner_factory import build_rank_runner, create_tp_runner
from lightllm.tools.make_tiny_model import tiny_model_dir
from lightllm.worker.tp.group import TPGroup

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def tp2():
    group = TPGroup(2, "cpu", num_threads=1, on_rank_exit=lambda rank, code: None)
    yield group
    group.shutdown()


@pytest.fixture
def arena():
    a = HostArena.create(f"lightllm-test-{uuid.uuid4().hex}", 64 << 20, block_bytes=1 << 16, max_entries=64)
    yield a
    a.unlink()


def _args(mode: str, tp: int, **flags):
    return load_server_args(
        [],
        model_dir=str(tiny_model_dir("qwen3_5")),
        device="cpu",
        tp=tp,
        ssm_state_mode=mode,
        max_running_requests=4,
        chunked_prefill_size=8,
        max_total_token_num=512,
        prefix_cache_state_bytes=1 << 20,
        prefix_cache_checkpoint_interval=8,
        **flags,
    )


def _run(engine, req_id: str, prompt: list[int]) -> tuple[list[int], int]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert engine.add_request(NewRequest(req_id, prompt, params)) == []
    tokens, cached = [], None
    while engine.has_work():
        for o in engine.step():
            if isinstance(o, TokenChunk):
                tokens += o.token_ids
                cached = o.num_cached_tokens if o.num_cached_tokens is not None else cached
    return tokens, cached


def _with_tp2(group, mode: str, arena_name: str, prompt: list[int]) -> tuple[list[int], int]:
    args, info = _args(mode, 2, host_tier_name=arena_name)
    runner = create_tp_runner(args, info, group)
    try:
        return _run(engine_for_runner(args, runner), "r", prompt)
    finally:
        runner.close()


def test_tp2_entries_written_by_both_ranks_and_resumed(tp2, arena):
    rng = random.Random(5)
    first, new = [rng.randrange(1, 500) for _ in range(30)], [rng.randrange(1, 500) for _ in range(3)]
    args, info = _args("native", 1, disable_prefix_cache=True)
    cold = engine_for_runner(args, build_rank_runner(args, info))
    answer, _ = _run(cold, "c1", first)
    second = first + answer + new
    expected, _ = _run(cold, "c2", second)

    assert _with_tp2(tp2, "replay", arena.name, first)[0] == answer
    ready = arena.entries[arena.entries["state"] == READY]
    assert len(ready) > 0 and (ready["num_shards"] == 2).all() and (ready["shard_mask"] == 3).all()
    tokens, cached = _with_tp2(tp2, "native", arena.name, second)
    assert cached == len(first) + MAX_TOKENS - 1
    assert tokens == expected
    # twin: a --tp 1 engine's sections have another layout; it resumes nothing from the tier
    args, info = _args("native", 1, host_tier_name=arena.name)
    single = engine_for_runner(args, build_rank_runner(args, info))
    tokens, cached = _run(single, "s", second)
    assert cached == 0 and tokens == expected
    assert np.all(arena.entries["state"][arena.entries["state"] != 0] == READY)
