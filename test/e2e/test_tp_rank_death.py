"""A `--tp 2` server whose follower rank dies: the request in flight fails with the reason within seconds, /health
turns 503 and the server refuses new requests; the same server answers normally while both ranks live."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from lightllm.server.runner_factory import DEFAULT_RUNNER_FACTORY
from lightllm.tools.make_tiny_model import tiny_model_dir
from unit_tests.server.conftest import wait_for
from unit_tests.server.live_server import LiveServer

# from the kill to the failed stream: the rank-0 watchdog polls every 0.2 s, the HTTP watcher about as often
MAX_FAILURE_DELAY_S = 10.0


def follower_pids(parent: int) -> list[int]:
    """Processes started by `parent` running the tensor-parallel follower."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if ppid == parent and b"lightllm.server.tp_follower" in cmdline:
            pids.append(int(entry))
    return pids


@pytest.fixture
def server():
    s = LiveServer(
        DEFAULT_RUNNER_FACTORY,
        model_dir=str(tiny_model_dir("qwen3_5")),
        device="cpu",
        tp=2,
        max_running_requests=4,
        max_total_token_num=4096,
    )
    yield s
    s.close()


def _stream(server, max_tokens: int):
    body = {"model": server.model, "prompt": "in flight", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    return httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60)


def test_dead_follower_fails_requests_and_health(server):
    (follower,) = follower_pids(server.engine.process.pid)
    # twin: with both ranks alive a request runs to its length
    with _stream(server, 8) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    with _stream(server, 3000) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")
        os.kill(follower, signal.SIGKILL)
        killed = time.monotonic()
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert time.monotonic() - killed < MAX_FAILURE_DELAY_S
    assert "error" in events[-1], events[-1]
    wait_for(lambda: httpx.get(f"{server.base_url}/health").status_code == 503, what="health to report the dead rank")
    body = {"model": server.model, "prompt": "anyone there?", "max_tokens": 4}
    assert httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30).status_code == 503
