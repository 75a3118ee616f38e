"""A hostile client against the live server (fake runner): every bad field is a 400 naming it (and the same body
with the field fixed is served), unexpected exceptions are a JSON 500 that leaves the keep-alive connection usable,
an absurd request cannot change what the requests batched with it produce, and slow text work does not stall the
event loop."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from unit_tests.engine.fake_runner import FakeRunner
from unit_tests.server.live_server import LiveServer

MAX_RUNNING = 8


@pytest.fixture(scope="module")
def server():
    s = LiveServer(device="cpu", max_running_requests=MAX_RUNNING, max_total_token_num=2048, chunked_prefill_size=64)
    yield s
    s.close()


def _post(server, path: str, body: dict, client: httpx.Client | None = None) -> httpx.Response:
    # json.dumps escapes a lone surrogate as \ud800, as a hostile client would send it (httpx's own encoder cannot)
    raw = json.dumps(body).encode()
    send = client.post if client is not None else httpx.post
    return send(f"{server.base_url}/v1/{path}", content=raw, headers={"content-type": "application/json"}, timeout=30)


CMPL = {"prompt": "hello", "max_tokens": 3}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
# (path, base body, bad fields, good fields, the field the 400 must name)
CASES = [
    ("completions", CMPL, {"top_k": 2**63}, {"top_k": 5}, "top_k"),
    ("completions", CMPL, {"top_k": 2**64 + 1}, {"top_k": 2**31 - 1}, "top_k"),
    ("completions", CMPL, {"seed": 2**63 - 1, "n": 2}, {"seed": 2**63 - 2, "n": 2}, "seed"),
    ("completions", CMPL, {"seed": 2**64}, {"seed": 0}, "seed"),
    ("completions", CMPL, {"stop": ""}, {"stop": "a"}, "stop"),
    ("completions", CMPL, {"stop": ["a", ""]}, {"stop": ["a", "b"]}, "stop"),
    ("completions", CMPL, {"stop": [1]}, {"stop": ["1"]}, "stop"),
    ("completions", CMPL, {"stop_token_ids": [-1]}, {"stop_token_ids": [1]}, "stop_token_ids.0"),
    ("completions", CMPL, {"stop_token_ids": [2**40]}, {"stop_token_ids": [3]}, "stop_token_ids.0"),
    ("completions", CMPL, {"prompt": [1, 2**32]}, {"prompt": [1, 2]}, "prompt"),
    ("completions", CMPL, {"prompt": [[1], [-1]]}, {"prompt": [[1], [2]]}, "prompt"),
    ("completions", CMPL, {"prompt": [2**70]}, {"prompt": [7]}, "prompt"),
    ("completions", CMPL, {"prompt": "\ud800x"}, {"prompt": "\u00e9x"}, "prompt"),
    ("completions", CMPL, {"prompt": ["ok", "\udfffy"]}, {"prompt": ["ok", "y"]}, "prompt"),
    ("completions", CMPL, {"prompt": [True, False]}, {"prompt": [1, 0]}, "prompt"),
    ("completions", CMPL, {"prompt": {"a": 1}}, {"prompt": "a"}, "prompt"),
    ("completions", CMPL, {"max_tokens": "16"}, {"max_tokens": 16}, "max_tokens"),
    ("completions", CMPL, {"max_tokens": 2**40}, {"max_tokens": 2}, "max_tokens"),
    ("completions", CMPL, {"temperature": "0.5"}, {"temperature": 0.5}, "temperature"),
    ("completions", CMPL, {"echo": "yes"}, {"echo": True}, "echo"),
    ("completions", CMPL, {"stream": 1}, {"stream": False}, "stream"),
    ("completions", CMPL, {"n": 2.0}, {"n": 2}, "n"),
    ("completions", CMPL, {"n": 65}, {"n": 3}, "n"),
    ("completions", CMPL, {"logprobs": 21}, {"logprobs": 20}, "logprobs"),
    ("completions", CMPL, {"min_tokens": 4}, {"min_tokens": 3}, "min_tokens"),
    ("completions", CMPL, {"min_tokens": -1}, {"min_tokens": 0}, "min_tokens"),
    (
        "chat/completions",
        CHAT,
        {"min_tokens": 2, "structured_outputs": {"regex": "[ab]{1,9}"}},
        {"min_tokens": 2},
        "min_tokens",
    ),
    ("completions", CMPL, {"logit_bias": {"5": 101}}, {"logit_bias": {"5": 100}}, "logit_bias"),
    ("completions", CMPL, {"logit_bias": {"+5": 1}}, {"logit_bias": {"5": 1}}, "logit_bias"),
    ("completions", CMPL, {"logit_bias": {"5": "1"}}, {"logit_bias": {"5": -1.5}}, "logit_bias"),
    ("completions", CMPL, {"logit_bias": {"5": True}}, {"logit_bias": {}}, "logit_bias"),
    ("completions", CMPL, {"logit_bias": [5]}, {"logit_bias": None}, "logit_bias"),
    ("completions", CMPL, {"logit_bias": {"99999999": 1}}, {"logit_bias": {"0": 1}}, "logit_bias"),
    ("chat/completions", CHAT, {"logit_bias": {str(2**40): 1}}, {"logit_bias": {"7": -100}}, "logit_bias"),
    ("completions", CMPL, {"suffix": "end"}, {"suffix": None}, "suffix"),
    ("completions", CMPL, {"stream_options": {"include_usage": True}}, {"stream_options": None}, "stream_options"),
    ("chat/completions", CHAT, {"top_logprobs": 2}, {"top_logprobs": 2, "logprobs": True}, "top_logprobs"),
    ("chat/completions", CHAT, {"tools": [{"type": "function"}]}, {"tools": []}, "tools.0.function"),
    ("chat/completions", CHAT, {"tool_choice": "required"}, {"tool_choice": "none"}, "tool_choice"),
    (
        "chat/completions",
        CHAT,
        {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        "tool_choice.function.name",
    ),
    (
        "chat/completions",
        CHAT,
        {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "objectx"}}}},
        {"response_format": {"type": "json_object"}},
        "response_format.json_schema.schema",
    ),
    (
        "chat/completions",
        CHAT,
        {"messages": [{"role": "tool", "content": "sunny"}]},
        {"messages": [{"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]},
        "messages[0].tool_call_id",
    ),
    ("chat/completions", CHAT, {"chat_template": "{% for i in range(100000) %}x{% endfor %}"}, {}, "chat_template"),
    (
        "chat/completions",
        CHAT,
        {"chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
        {"chat_template_kwargs": {"enable_thinking": False}},
        "chat_template_kwargs.chat_template",
    ),
    (
        "chat/completions",
        CHAT,
        {"chat_template_kwargs": {"tokenize": True}},
        {"chat_template_kwargs": {}},
        "chat_template_kwargs.tokenize",
    ),
    (
        "chat/completions",
        CHAT,
        {"messages": [{"role": "user", "content": "\ud800"}]},
        {"messages": [{"role": "user", "content": "\u4f60"}]},
        "messages.0.content",
    ),
    ("chat/completions", CHAT, {"max_completion_tokens": 0}, {"max_completion_tokens": 1}, "max_completion_tokens"),
    ("chat/completions", CHAT, {"logprobs": "true"}, {"logprobs": True}, "logprobs"),
]


@pytest.mark.parametrize(
    "path, base, bad, good, param", CASES, ids=[f"{c[0].split('/')[0]}-{json.dumps(c[2])[:40]}" for c in CASES]
)
def test_bad_field_is_400_naming_it_and_fixed_body_is_served(server, path, base, bad, good, param):
    body = {"model": server.model, **base}
    r = _post(server, path, {**body, **bad})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    fixed = {k: v for k, v in {**body, **good}.items() if v is not None}
    ok = _post(server, path, fixed)
    assert ok.status_code == 200, ok.text


def test_nan_literal_is_400(server):
    raw = f'{{"model": "{server.model}", "prompt": "x", "max_tokens": 2, "temperature": NaN}}'.encode()
    url, headers = f"{server.base_url}/v1/completions", {"content-type": "application/json"}
    r = httpx.post(url, content=raw, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    assert httpx.post(url, content=raw.replace(b"NaN", b"0.5"), headers=headers).status_code == 200


def test_too_long_text_is_refused_before_tokenizing(server, monkeypatch):
    calls = []
    real = server.tokenizer.encode
    monkeypatch.setattr(server.tokenizer, "encode", lambda text: calls.append(len(text)) or real(text))
    limit = server.tokenizer.max_chars(server.args.max_req_total_len)
    r = _post(server, "completions", {"model": server.model, "prompt": "a" * (limit + 1)})
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"] and calls == []
    r = _post(server, "completions", {"model": server.model, "prompt": "a b c", "max_tokens": 2})
    assert r.status_code == 200 and calls == [5]


def _local_port(r: httpx.Response) -> int:
    return r.extensions["network_stream"].get_extra_info("client_addr")[1]


def test_unexpected_exception_is_json_500_and_keeps_the_connection(server, monkeypatch):
    def broken(text):
        raise RuntimeError("secret internals")

    body = {"model": server.model, "prompt": "boom", "max_tokens": 2}
    with httpx.Client(timeout=30) as client:
        monkeypatch.setattr(server.tokenizer, "encode", broken)
        r = _post(server, "completions", body, client)
        assert r.status_code == 500
        assert r.json()["error"] == {
            "message": "internal server error",
            "type": "server_error",
            "param": None,
            "code": 500,
        }
        assert "secret" not in r.text
        monkeypatch.undo()
        again = _post(server, "completions", body, client)
        assert again.status_code == 200
        assert _local_port(again) == _local_port(r), "the keep-alive connection was dropped after the 500"


def test_unexpected_exception_mid_stream_ends_with_error_event(server, monkeypatch):
    def broken(token_id):
        raise RuntimeError("secret internals")

    body = {"model": server.model, "prompt": "boom", "max_tokens": 4, "logprobs": 1, "stream": True}
    with httpx.Client(timeout=30) as client:
        monkeypatch.setattr(server.tokenizer, "token_text", broken)
        with client.stream("POST", f"{server.base_url}/v1/completions", json=body) as r:
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["error"]["message"] == "internal server error"
        assert "secret" not in "".join(lines)
        monkeypatch.undo()
        with client.stream("POST", f"{server.base_url}/v1/completions", json=body) as r:
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]" and "error" not in lines[-2]


def test_slow_tokenization_does_not_delay_health(server, monkeypatch):
    real = server.tokenizer.encode

    def slow(text):
        time.sleep(3.0)
        return real(text)

    monkeypatch.setattr(server.tokenizer, "encode", slow)
    took = {}

    def request():
        t0 = time.monotonic()
        took["status"] = _post(server, "completions", {"model": server.model, "prompt": "slow", "max_tokens": 2})
        took["s"] = time.monotonic() - t0

    worker = threading.Thread(target=request)
    worker.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    health_s = time.monotonic() - t0
    worker.join(30)
    # twin: the tokenization really was slow, so a blocked loop would have shown
    assert took["status"].status_code == 200 and took["s"] >= 3.0
    assert health_s < 1.0, f"/health took {health_s:.2f} s while a request was being tokenized"


def test_absurd_request_leaves_six_batched_requests_unchanged(server):
    prompts = [f"batched request {i} " + "y" * i for i in range(6)]
    runner = FakeRunner(server.info.vocab_size)
    expected = [server.tokenizer.decode(runner.greedy(server.tokenizer.encode(p), 20)) for p in prompts]
    aclient = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    kw = dict(model=server.model, max_tokens=20, extra_body={"ignore_eos": True})

    async def valid(p: str) -> str:
        r = await aclient.completions.create(prompt=p, temperature=0, **kw)
        return r.choices[0].text

    async def absurd(extra: dict):
        try:
            r = await aclient.completions.create(prompt="absurd", **{**kw, "extra_body": {"ignore_eos": True, **extra}})
            return r.choices[0].finish_reason
        except openai.BadRequestError as exc:
            return exc.body["param"]

    async def together():
        return await asyncio.gather(
            *(valid(p) for p in prompts),
            absurd({"top_k": 2**31 - 1, "min_p": 1.0, "repetition_penalty": 10.0}),
            absurd({"top_k": 2**63}),
            absurd({"seed": 2**63 - 1, "n": 2}),
        )

    *texts, big_ok, huge, seed = asyncio.run(together())
    assert texts == expected
    assert (big_ok, huge, seed) == ("length", "top_k", "seed")
    # twin: different prompts give different texts, so the equality is not vacuous
    assert expected != [server.tokenizer.decode(runner.greedy(server.tokenizer.encode(p + "!"), 20)) for p in prompts]
