"""Faults over HTTP, against a fake runner that fails on chosen tokens and sleeps a little every step: a runner
failure finishes the affected requests with an error and the server keeps serving; a client that disconnects
mid-request gives every slot back; a dead engine process turns /health to 503 and fails requests fast."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from lightllm.engine.logits_check import NONFINITE_LOGITS_ERROR
from unit_tests.engine.fake_runner import FakeRunner
from unit_tests.server.conftest import scrape, wait_for
from unit_tests.server.live_server import LiveServer, fake_checkpoint

VOCAB = 512


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # a copy of the demo checkpoint whose config tells the fake runner which prompt tokens fail
    model_dir = fake_checkpoint(
        tmp_path_factory.mktemp("failing"), fake_fail_token=VOCAB - 1, fake_nan_token=VOCAB - 2, fake_step_delay_s=0.01
    )
    s = LiveServer(model_dir=model_dir, device="cpu", max_running_requests=4, max_total_token_num=512)
    yield s
    s.close()


def _good_prompt(server, num_tokens: int = 8) -> list[int]:
    # a prompt whose greedy continuation never touches the failure tokens
    for start in range(1, 100):
        prompt = [start, start + 1]
        if not {VOCAB - 1, VOCAB - 2} & set(FakeRunner(VOCAB).greedy(prompt, num_tokens)):
            return prompt
    raise AssertionError("no safe prompt")


@pytest.mark.parametrize("token", [VOCAB - 1, VOCAB - 2], ids=["forward-raises", "nan-logits"])
def test_runner_failure_gives_500_and_server_survives(server, token):
    body = {"model": server.model, "prompt": [token, 3, 4], "max_tokens": 4, "temperature": 0}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    good = client.completions.create(model=server.model, prompt=_good_prompt(server), max_tokens=8, temperature=0)
    assert good.choices[0].finish_reason in ("length", "stop")
    wait_for(lambda: scrape(server.base_url, "lightllm_free_state_slots") == 4, what="slots returned")


def _stream_events(server, prompt: list[int]) -> list[dict]:
    body = {"model": server.model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=30) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_runner_failure_in_stream_reports_error_event(server):
    # "error" is no OpenAI finish_reason: the stream ends with an error event carrying the engine's message
    events = _stream_events(server, [VOCAB - 2, 5])
    assert events[-1]["error"]["message"] == NONFINITE_LOGITS_ERROR
    assert events[-1]["error"]["type"] == "server_error"
    assert not any(c.get("finish_reason") == "error" for e in events for c in e.get("choices", []))
    with pytest.raises(openai.APIError, match="NaN or infinite logits"):
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        list(client.completions.create(model=server.model, prompt=[VOCAB - 2, 5], max_tokens=4, stream=True))


def test_good_stream_has_no_error_event(server):
    events = _stream_events(server, _good_prompt(server))
    assert "error" not in events[-1] and events[-1]["choices"][0]["finish_reason"] in ("length", "stop")


def test_abort_on_stream_disconnect_returns_every_slot(server):
    body = {
        "model": server.model,
        "prompt": "long one",
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    aborted = _num_aborted(server)
    with httpx.Client(timeout=30) as http:
        for _ in range(2):
            with http.stream("POST", f"{server.base_url}/v1/completions", json=body) as r:
                lines = r.iter_lines()
                got = [next(lines) for _ in range(6)]
                assert all(line.startswith("data: ") or line == "" for line in got)
    wait_for(lambda: scrape(server.base_url, "lightllm_num_requests_running") == 0, what="aborted requests to leave")
    wait_for(lambda: scrape(server.base_url, "lightllm_free_state_slots") == 4, what="slots returned")
    assert scrape(server.base_url, "lightllm_free_kv_tokens") == 512
    assert _num_aborted(server) == aborted + 2


def test_abort_on_non_stream_disconnect(server):
    body = {"model": server.model, "prompt": "long two", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    aborted = _num_aborted(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=0.3)
    wait_for(lambda: scrape(server.base_url, "lightllm_num_requests_running") == 0, what="aborted request to leave")
    # the engine frees the slot after it reports the request gone: poll, the two metrics are not one update
    wait_for(lambda: scrape(server.base_url, "lightllm_free_state_slots") == 4, what="slots returned")
    assert _num_aborted(server) == aborted + 1


def _num_aborted(server) -> float:
    text = httpx.get(f"{server.base_url}/metrics").text
    return scrape(server.base_url, 'lightllm_requests_total{finish_reason="abort"}') if "abort" in text else 0.0


def test_dead_engine_fails_requests_and_health(server):
    # greedy on a prompt that stays clear of the failure tokens: only the kill may end this request
    prompt = _good_prompt(server, 400)
    body = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")
        server.engine.process.kill()
        server.engine.process.join(10)
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    # the request in flight ends with the reason, not with a cut-off stream
    assert events[-1]["error"]["message"] == "the engine process exited"
    wait_for(lambda: httpx.get(f"{server.base_url}/health").status_code == 503, what="health to report the dead engine")
    body = {"model": server.model, "prompt": "anyone there?", "max_tokens": 4}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 503 and "not running" in r.json()["error"]["message"]
