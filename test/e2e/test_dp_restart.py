"""A data-parallel replica whose engine process dies rejoins: over real processes on 127.0.0.1 (`--dp 2`, round
robin, a slowed demo checkpoint), the dead replica's in-flight request fails naming it, the other replica serves
throughout, /health says degraded while the replica is down and ok once a fresh engine (another process) took its
place, and the rejoined replica takes requests again with the same tokens as the other replica. With every replica
down and restarting, /health and new requests answer 503 until they are back."""

from __future__ import annotations

import threading

import httpx

from unit_tests.server.conftest import scrape, wait_for
from unit_tests.server.live_server import LiveServer, fake_checkpoint


def _complete(server: LiveServer, prompt: list[int], max_tokens: int) -> httpx.Response:
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)


def _health(server: LiveServer) -> dict:
    return httpx.get(f"{server.base_url}/health", timeout=10).json()


def _replicas(server: LiveServer) -> list[dict]:
    return httpx.get(f"{server.base_url}/dp/replicas", timeout=10).json()["replicas"]


def test_a_dead_replica_restarts_and_rejoins(tmp_path):
    server = LiveServer(
        model_dir=fake_checkpoint(tmp_path, fake_step_delay_s=0.05),
        device="cpu",
        dp=2,
        dp_balancer="round_robin",
        dp_restart_backoff_s=0.2,
        max_running_requests=4,
        max_total_token_num=512,
    )
    try:
        assert _health(server) == {"status": "ok", "replicas": 2, "replicas_alive": 2, "replicas_restarting": 0}
        old_pid = _replicas(server)[0]["pid"]
        results: dict[int, httpx.Response] = {}

        def run(i: int) -> None:
            results[i] = _complete(server, [5 + i, 6, 7], 150)

        # round robin: request 0 on replica 0, request 1 on replica 1
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
            wait_for(lambda: scrape(server.base_url, "lightllm_num_requests_running") >= 1, what="a running request")
        server.engine.handles[0].process.kill()
        wait_for(lambda: _health(server)["status"] == "degraded", what="degraded health")
        down = _health(server)
        assert (down["replicas_alive"], down["replicas"]) == (1, 2)
        # the other replica serves while replica 0 is down (round robin skips the dead one)
        served_meanwhile = [_complete(server, [9, 9, 9], 3) for _ in range(2)]
        for t in threads:
            t.join(60)
        assert results[0].status_code == 500
        assert "data-parallel replica 0 exited" in results[0].json()["error"]["message"]
        assert results[1].status_code == 200 and results[1].json()["choices"][0]["finish_reason"] in ("length", "stop")
        assert [r.status_code for r in served_meanwhile] == [200, 200]

        wait_for(lambda: _health(server)["status"] == "ok", timeout_s=120, what="the replica to rejoin")
        assert _health(server) == {"status": "ok", "replicas": 2, "replicas_alive": 2, "replicas_restarting": 0}
        rows = _replicas(server)
        assert rows[0]["alive"] and rows[0]["num_restarts"] == 1 and rows[0]["pid"] != old_pid
        assert rows[1]["num_restarts"] == 0
        assert scrape(server.base_url, 'lightllm_dp_replica_restarts_total{replica="0"}') == 1

        # the rejoined replica takes its turn again and answers as the other replica does
        routed = [row["num_routed"] for row in rows]
        answers = [_complete(server, [3, 1, 4, 1, 5], 8) for _ in range(2)]
        assert [r.status_code for r in answers] == [200, 200]
        assert [row["num_routed"] - before for row, before in zip(_replicas(server), routed)] == [1, 1]
        texts = [r.json()["choices"][0]["text"] for r in answers]
        assert texts[0] == texts[1] and texts[0]

        # every replica down, both restarting: 503 (retry), then both serve again
        for handle in server.engine.handles:
            handle.process.kill()
        wait_for(lambda: httpx.get(f"{server.base_url}/health").status_code == 503, what="503 with no replica")
        assert "no data-parallel replica is running" in _health(server)["status"]
        refused = _complete(server, [3, 1, 4, 1, 5], 8)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        wait_for(lambda: _health(server)["status"] == "ok", timeout_s=120, what="both replicas to rejoin")
        assert [row["num_restarts"] for row in _replicas(server)] == [2, 1]
        assert _complete(server, [3, 1, 4, 1, 5], 8).json()["choices"][0]["text"] == texts[0]
    finally:
        server.close()
