"""The host tier across data-parallel replicas over real processes: with `--dp 2` and round-robin routing, a
conversation's second turn lands on the other replica than its first, resumes from the entry the first replica
wrote to the shared host tier (cached tokens > 0, counted as host hits on that replica) and gives the cold run's
greedy tokens, in every state mode, with and without MTP (compact with MTP and with n-gram drafts)."""

from __future__ import annotations

import random

import httpx
import pytest

from lightllm.engine.messages import NewRequest
from lightllm.engine.sampling_params import SamplingParams
from lightllm.server.args import load_server_args
from lightllm.server.engine_process import build_engine
from lightllm.tools.make_tiny_model import tiny_model_dir
from unit_tests.helpers.prefix_scenario import Result, drain
from unit_tests.server.live_server import LiveServer

REAL_RUNNER = "lightllm.server.runner_factory:create_runner"
CONFIGS = [
    {"ssm_state_mode": "native"},
    {"ssm_state_mode": "replay"},
    {"ssm_state_mode": "native", "mtp_step": 2},
    {"ssm_state_mode": "replay", "mtp_step": 2},
    {"ssm_state_mode": "compact", "mtp_step": 2},
    {"ssm_state_mode": "compact", "spec_ngram": 3},
]
FLAGS = dict(
    device="cpu",
    max_running_requests=4,
    max_total_token_num=1024,
    chunked_prefill_size=32,
    prefix_cache_checkpoint_interval=16,
    prefix_cache_state_bytes=4 << 20,
)
MAX_TOKENS = 6


def _id(flags: dict) -> str:
    return "-".join(map(str, flags.values()))


def _cold_tokens(flags: dict, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of each prompt on an engine without the prefix cache (in this process)."""
    args, info = load_server_args(
        [], model_dir=str(tiny_model_dir("qwen3_5")), **{**FLAGS, **flags, "disable_prefix_cache": True}
    )
    engine = build_engine(args, info, REAL_RUNNER)
    out = []
    for i, prompt in enumerate(prompts):
        res = {f"c{i}": Result()}
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
        assert engine.add_request(NewRequest(f"c{i}", prompt, params)) == []
        drain(engine, res)
        out.append(res[f"c{i}"].tokens)
    return out


def _complete(server: LiveServer, prompt: list[int]) -> dict:
    body = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.json()


def _text(out: dict) -> str:
    return out["choices"][0]["text"]


@pytest.mark.parametrize("flags", CONFIGS, ids=[_id(f) for f in CONFIGS])
def test_other_replica_resumes_from_the_host_tier(flags, one_torch_thread):
    rng = random.Random(7)
    first = [rng.randrange(1, 500) for _ in range(40)]
    new = [rng.randrange(1, 500) for _ in range(3)]
    server = LiveServer(
        REAL_RUNNER, model_dir=str(tiny_model_dir("qwen3_5")), dp=2, dp_balancer="round_robin", **FLAGS, **flags
    )
    try:
        # round robin: turn one on replica 0, turn two on replica 1
        one = _complete(server, first)
        second = first + server.tokenizer.encode(_text(one)) + new
        two = _complete(server, second)
        replicas = httpx.get(f"{server.base_url}/dp/replicas", timeout=10).json()
    finally:
        server.close()
    rows = replicas["replicas"] if isinstance(replicas, dict) else replicas
    assert [row["num_routed"] for row in rows] == [1, 1]
    cached = two["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    assert rows[1]["prefix_cache_hit_tokens"] == {"device": 0, "host": cached}
    expected = _cold_tokens(flags, [first, second])
    assert _text(one) == server.tokenizer.decode(expected[0])
    assert _text(two) == server.tokenizer.decode(expected[1])
