"""One fake-runner server per test module (module-scoped fixtures in the test files build on this helper)."""

from __future__ import annotations

import re
import time

import httpx
import pytest


def scrape(base_url: str, name: str) -> float:
    """Value of a Prometheus sample, e.g. `lightllm_free_kv_tokens` or `lightllm_requests_total{finish_reason="abort"}`."""
    text = httpx.get(f"{base_url}/metrics").text
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def wait_for(predicate, timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def prompts_sent(monkeypatch) -> list[list[int]]:
    """The prompt token ids the HTTP front end hands the engine, one list per request."""
    from lightllm.server.http.serving import Frontend

    sent: list[list[int]] = []
    generate = Frontend.generate

    def recording(self, prompts, *args, **kwargs):
        sent.extend(list(p) for p in prompts)
        return generate(self, prompts, *args, **kwargs)

    monkeypatch.setattr(Frontend, "generate", recording)
    return sent
