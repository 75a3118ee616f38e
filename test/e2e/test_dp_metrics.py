"""Per-replica metrics over real processes on 127.0.0.1 (`--dp 2`, round robin), against scripted workloads:
queue and running counts of each replica while requests wait for a state slot (a slowed demo checkpoint), and
each replica's prefix-cache lookups and device hits (tiny Qwen3.5) equal to what its requests' `usage` reported,
in /dp/replicas and as /metrics samples labelled by replica."""

from __future__ import annotations

import re
import threading

import httpx

from lightllm.server.demo_checkpoint import demo_model_dir
from lightllm.tools.make_tiny_model import tiny_model_dir
from unit_tests.server.conftest import scrape, wait_for
from unit_tests.server.live_server import LiveServer, fake_checkpoint

REAL_RUNNER = "lightllm.server.runner_factory:create_runner"


def _complete(server: LiveServer, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.json()


def _rows(server: LiveServer) -> list[dict]:
    return httpx.get(f"{server.base_url}/dp/replicas", timeout=10).json()["replicas"]


def test_queue_and_running_per_replica(tmp_path):
    """Three long requests over two replicas with one slot each: replica 0 runs one and queues one."""
    server = LiveServer(
        model_dir=fake_checkpoint(tmp_path, fake_step_delay_s=0.05),
        device="cpu",
        dp=2,
        dp_balancer="round_robin",
        max_running_requests=1,
        max_total_token_num=512,
    )
    try:
        threads = [threading.Thread(target=_complete, args=(server, [4 + i, 5, 6], 60)) for i in range(3)]
        for t in threads:
            t.start()
        busy = lambda: [(r["num_running"], r["num_waiting"], r["num_in_flight"]) for r in _rows(server)]  # noqa: E731
        wait_for(lambda: busy() == [(1, 1, 2), (1, 0, 1)], what="one queued request on replica 0")
        samples = {
            (name, i): scrape(server.base_url, f'lightllm_dp_replica_{name}{{replica="{i}"}}')
            for name in ("requests_running", "requests_waiting", "requests_in_flight", "up")
            for i in range(2)
        }
        summed = (
            scrape(server.base_url, "lightllm_num_requests_running"),
            scrape(server.base_url, "lightllm_num_requests_waiting"),
        )
        for t in threads:
            t.join(60)
        idle = [(r["num_running"], r["num_waiting"], r["num_in_flight"], r["num_routed"]) for r in _rows(server)]
    finally:
        server.close()
    assert samples == {
        ("requests_running", 0): 1,
        ("requests_running", 1): 1,
        ("requests_waiting", 0): 1,
        ("requests_waiting", 1): 0,
        ("requests_in_flight", 0): 2,
        ("requests_in_flight", 1): 1,
        ("up", 0): 1,
        ("up", 1): 1,
    }
    assert summed == (2, 1)
    assert idle == [(0, 0, 0, 2), (0, 0, 0, 1)]


def test_prefix_hits_per_replica_equal_the_requests_cached_tokens():
    server = LiveServer(
        REAL_RUNNER,
        model_dir=str(tiny_model_dir("qwen3_5")),
        device="cpu",
        dp=2,
        dp_balancer="round_robin",
        max_running_requests=4,
        max_total_token_num=1024,
        chunked_prefill_size=32,
        prefix_cache_checkpoint_interval=16,
        # room for the checkpoints of both prompts
        prefix_cache_state_bytes=4 << 20,
    )
    try:
        shared = [(7 * k + 3) % 97 + 5 for k in range(41)]
        other = [(11 * k + 1) % 89 + 5 for k in range(20)]
        # round robin: replicas 0, 1, 0, 1, 0
        prompts = [shared, shared, shared, shared, other]
        usages = [_complete(server, p, 4)["usage"] for p in prompts]
        cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
        want_queried = [len(shared) * 2 + len(other), len(shared) * 2]
        want_hits = [cached[0] + cached[2] + cached[4], cached[1] + cached[3]]
        wait_for(lambda: [r["prefix_cache_queried_tokens"] for r in _rows(server)] == want_queried, what="lookups")
        rows = _rows(server)
        samples = _labelled_samples(server.base_url, "lightllm_dp_replica_prefix_cache_hit_tokens_total")
        queried = [
            scrape(server.base_url, f'lightllm_dp_replica_prefix_cache_queried_tokens_total{{replica="{i}"}}')
            for i in range(2)
        ]
        total = scrape(server.base_url, "lightllm_prefix_cache_hit_tokens_total")
    finally:
        server.close()
    # each replica's second turn of the shared prompt resumed it; a prompt nobody sent before resumed nothing
    assert cached[0] == cached[4] == 0 and cached[2] > 0 and cached[3] > 0
    # every tier together accounts for the tokens each replica's requests were told were cached
    assert [sum(r["prefix_cache_hit_tokens"].values()) for r in rows] == want_hits
    for row, q in zip(rows, want_queried):
        assert row["prefix_cache_hit_rate"] == {t: n / q for t, n in row["prefix_cache_hit_tokens"].items()}
    assert {(int(labels["replica"]), labels["tier"]): v for labels, v in samples} == {
        (r["replica"], tier): n for r in rows for tier, n in r["prefix_cache_hit_tokens"].items()
    }
    assert queried == want_queried
    # the server-wide counter is the device tier's, summed over the replicas
    assert total == sum(r["prefix_cache_hit_tokens"]["device"] for r in rows)


def _labelled_samples(base_url: str, name: str) -> list[tuple[dict, float]]:
    """Every sample of a labelled Prometheus family: (labels, value)."""
    text = httpx.get(f"{base_url}/metrics").text
    found = []
    for labels, value in re.findall(rf"^{re.escape(name)}\{{([^}}]*)\}} ([0-9.e+-]+)$", text, re.M):
        found.append((dict(re.findall(r'(\w+)="([^"]*)"', labels)), float(value)))
    assert found, f"{name} not in /metrics"
    return found


def test_the_replica_view_needs_the_api_key():
    server = LiveServer(model_dir=demo_model_dir(), device="cpu", dp=2, api_key="replica-key")
    try:
        assert httpx.get(f"{server.base_url}/dp/replicas").status_code == 401
        r = httpx.get(f"{server.base_url}/dp/replicas", headers={"Authorization": "Bearer replica-key"})
        assert r.status_code == 200 and [row["replica"] for row in r.json()["replicas"]] == [0, 1]
        # /metrics stays open, as for a single engine
        assert scrape(server.base_url, 'lightllm_dp_replica_up{replica="1"}') == 1
    finally:
        server.close()
