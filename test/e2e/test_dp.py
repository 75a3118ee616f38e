"""Data parallelism over real processes on 127.0.0.1: `--dp 2` gives `--dp 1`'s greedy tokens for multi-turn
conversations in every state mode (with MTP and n-gram drafts), a conversation's turns stay on one replica
(cache-aware routing: its later turns hit that replica's prefix cache), and a replica that dies fails only its own
requests while the other keeps serving and /health says the server is degraded (restarts off; test_dp_restart.py
has them)."""

from __future__ import annotations

import threading

import httpx
import pytest

from lightllm.tools.make_tiny_model import tiny_model_dir
from unit_tests.server.conftest import scrape, wait_for
from unit_tests.server.live_server import LiveServer, fake_checkpoint

REAL_RUNNER = "lightllm.server.runner_factory:create_runner"
CONFIGS = [
    ("qwen3_5", {"ssm_state_mode": "replay", "mtp_step": 2}),
    ("qwen3_next", {"ssm_state_mode": "compact", "spec_ngram": 3}),
    ("qwen3_5", {"ssm_state_mode": "native"}),
]
TURNS = 3


def _server(arch: str, dp: int, flags: dict) -> LiveServer:
    return LiveServer(
        REAL_RUNNER,
        model_dir=str(tiny_model_dir(arch)),
        device="cpu",
        dp=dp,
        max_running_requests=4,
        max_total_token_num=1024,
        chunked_prefill_size=32,
        prefix_cache_checkpoint_interval=16,
        # room for every conversation's checkpoints: the later turns must find theirs
        prefix_cache_state_bytes=4 << 20,
        **flags,
    )


def _conversations(server: LiveServer, num: int) -> list[list[list[int]]]:
    """`num` conversations of TURNS turns each, run one turn of every conversation at a time (turns of different
    conversations concurrently); returns each conversation's greedy text per turn."""
    prompts = [[7 + c, 11, 13 + c] * 7 for c in range(num)]
    tokens: list[list[list[int]]] = [[] for _ in range(num)]
    for _ in range(TURNS):
        threads, out = [], [None] * num

        def run(c: int, out: list = out) -> None:
            body = {"model": server.model, "prompt": prompts[c], "max_tokens": 6, "temperature": 0}
            r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
            r.raise_for_status()
            out[c] = r.json()

        for c in range(num):
            threads.append(threading.Thread(target=run, args=(c,)))
            threads[-1].start()
        for t in threads:
            t.join()
        for c in range(num):
            text = out[c]["choices"][0]["text"]
            tokens[c].append(text)
            # the next turn sends the whole conversation so far plus a new user part
            prompts[c] = prompts[c] + server.tokenizer.encode(text) + [17, 19 + c]
    return tokens


@pytest.mark.parametrize(("arch", "flags"), CONFIGS, ids=["-".join([a, *map(str, f.values())]) for a, f in CONFIGS])
def test_two_replicas_give_one_replicas_tokens(arch, flags):
    single = _server(arch, 1, flags)
    try:
        expected = _conversations(single, 3)
    finally:
        single.close()
    double = _server(arch, 2, flags)
    try:
        got = _conversations(double, 3)
        health = httpx.get(f"{double.base_url}/health", timeout=10).json()
        # the later turns resumed prefixes their replica had cached: routing followed the conversations
        wait_for(lambda: scrape(double.base_url, "lightllm_prefix_cache_hit_tokens_total") > 0, what="cache hits")
    finally:
        double.close()
    assert got == expected
    assert health == {"status": "ok", "replicas": 2, "replicas_alive": 2, "replicas_restarting": 0}


def test_a_dead_replica_fails_only_its_requests(tmp_path):
    """Without restarts (test_dp_restart.py has them) the dead replica stays down."""
    server = LiveServer(
        model_dir=fake_checkpoint(tmp_path, fake_step_delay_s=0.05),
        device="cpu",
        dp=2,
        dp_balancer="round_robin",
        dp_restart_attempts=0,
        max_running_requests=4,
        max_total_token_num=512,
    )
    try:
        results: dict[int, httpx.Response] = {}

        def run(i: int) -> None:
            body = {"model": server.model, "prompt": [5 + i, 6, 7], "max_tokens": 200, "temperature": 0}
            results[i] = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)

        # round robin: request 0 on replica 0, request 1 on replica 1
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
            wait_for(lambda: scrape(server.base_url, "lightllm_num_requests_running") >= 1, what="a running request")
        server.engine.handles[0].process.kill()
        for t in threads:
            t.join(60)
        assert results[0].status_code == 500 and "replica 0 exited" in results[0].json()["error"]["message"]
        assert results[1].status_code == 200 and results[1].json()["choices"][0]["finish_reason"] in ("length", "stop")
        assert httpx.get(f"{server.base_url}/health", timeout=10).json() == {
            "status": "degraded",
            "replicas": 2,
            "replicas_alive": 1,
            "replicas_restarting": 0,
        }
        # new requests go to the replica left
        body = {"model": server.model, "prompt": [9, 9, 9], "max_tokens": 3, "temperature": 0}
        for _ in range(3):
            assert httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).status_code == 200
        assert [row["alive"] for row in httpx.get(f"{server.base_url}/dp/replicas").json()["replicas"]] == [False, True]
    finally:
        server.close()
