"""The progress watchdog (`lightllm.server.http.watchdog`): with sequences in flight and no token for
--progress_timeout_s, /health answers 503 with the reason, the log names the waiting requests and the engine's
last step, and lightllm_progress_stalls_total counts the stall once; the next token clears it. Checked on its own
with a scripted clock and against the real app and engine process whose steps are slowed past the bound."""

from __future__ import annotations

import logging
import threading

import httpx
import pytest
from prometheus_client import CollectorRegistry

from lightllm.engine.messages import EngineStats, TokenChunk
from lightllm.server.http.watchdog import ProgressWatchdog
from unit_tests.server.conftest import scrape, wait_for
from unit_tests.server.live_server import LiveServer, fake_checkpoint


def test_a_stall_is_reported_once_and_cleared_by_a_token(caplog):
    now = [100.0]
    pending: dict[str, float] = {}
    dog = ProgressWatchdog(
        5.0,
        lambda: pending,
        lambda: EngineStats(num_steps=41, num_running=1),
        CollectorRegistry(),
        clock=lambda: now[0],
    )
    assert dog.problem() is None
    now[0] += 100.0
    # idle for long, then a request: its wait counts from its submission
    pending["r1"] = now[0]
    now[0] += 4.0
    assert dog.problem() is None
    now[0] += 2.0
    with caplog.at_level(logging.ERROR):
        assert dog.problem() == "no token produced for 6 s with 1 sequences in flight"
        assert dog.problem() is not None
    assert dog.stalls._value.get() == 1
    assert "r1 (6 s)" in caplog.text and "step 41" in caplog.text
    dog.observe(TokenChunk("r1", [3]))
    assert dog.problem() is None
    # teeth: turned off, nothing is ever reported
    off = ProgressWatchdog(0.0, lambda: pending, EngineStats, CollectorRegistry(), clock=lambda: now[0] + 1e6)
    assert off.problem() is None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # each engine step takes longer than the bound: a request in flight sees no token for that long
    model_dir = fake_checkpoint(tmp_path_factory.mktemp("stalled"), fake_step_delay_s=2.5)
    s = LiveServer(
        model_dir=model_dir, device="cpu", max_running_requests=2, max_total_token_num=1024, progress_timeout_s=1.0
    )
    yield s
    s.close()


def test_health_turns_503_while_no_token_comes_and_recovers(server, caplog):
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    body = {"model": server.model, "prompt": [1, 2, 3], "max_tokens": 1}
    replies = []
    request = threading.Thread(
        target=lambda: replies.append(httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30))
    )
    with caplog.at_level(logging.ERROR, logger="lightllm.server.http.watchdog"):
        request.start()
        wait_for(lambda: httpx.get(f"{server.base_url}/health").status_code == 503, 5, "/health 503")
        health = httpx.get(f"{server.base_url}/health").json()
        request.join(30)
    assert health["status"].startswith("no token produced for") and "1 sequences in flight" in health["status"]
    assert replies[0].status_code == 200
    assert "no progress for" in caplog.text and "running" in caplog.text
    assert scrape(server.base_url, "lightllm_progress_stalls_total") == 1
    assert httpx.get(f"{server.base_url}/health").status_code == 200
