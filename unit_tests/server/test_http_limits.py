"""Limits and access at the HTTP edge: body cap (413), wait-queue cap (429 + Retry-After), sequences per request
(400), the API key (401 with an OpenAI error body; the scheme in any case) and the OpenAPI pages behind
--enable_docs and the API key."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from unit_tests.server.conftest import scrape, wait_for
from unit_tests.server.live_server import slow_server

KEY = "test-key-123"
AUTH = {"authorization": f"Bearer {KEY}"}
BODY_CAP = 4096


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # slow steps keep requests in flight long enough to fill the queue
    s = slow_server(
        tmp_path_factory.mktemp("slow"),
        max_running_requests=2,
        max_total_token_num=1024,
        max_queue_len=1,
        max_sequences_per_request=4,
        max_request_body_bytes=BODY_CAP,
        api_key=KEY,
        enable_docs=True,
        trust_request_chat_template=True,
    )
    yield s
    s.close()


def _post(server, path: str, body: dict, headers=AUTH, **kw) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=30, **kw)


def test_body_over_cap_is_413(server):
    body = {"model": server.model, "prompt": "x" * BODY_CAP, "max_tokens": 1}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 413 and "--max_request_body_bytes" in r.json()["error"]["message"]
    r = _post(server, "/v1/completions", {**body, "prompt": "x" * 100})
    assert r.status_code == 200


def test_chunked_body_over_cap_is_413(server):
    # no content-length: the cap is enforced while the body streams in
    def chunks(n: int):
        yield b'{"model": "' + server.model.encode() + b'", "max_tokens": 1, "prompt": "'
        for _ in range(n):
            yield b"y " * 128
        yield b'"}'

    url, headers = f"{server.base_url}/v1/completions", {**AUTH, "content-type": "application/json"}
    assert httpx.post(url, content=chunks(BODY_CAP // 256 + 1), headers=headers, timeout=30).status_code == 413
    assert httpx.post(url, content=chunks(1), headers=headers, timeout=30).status_code == 200


def test_too_many_sequences_is_400(server):
    body = {"model": server.model, "prompt": ["a", "b", "c"], "n": 2, "max_tokens": 1}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "6 sequences" in r.json()["error"]["message"]
    assert _post(server, "/v1/completions", {**body, "n": 1}).status_code == 200


def test_full_queue_is_429_with_retry_after(server):
    body = {"model": server.model, "prompt": "fill", "max_tokens": 300, "ignore_eos": True, "stream": True}
    url = f"{server.base_url}/v1/completions"
    with httpx.Client(headers=AUTH, timeout=30) as http:
        streams = [http.stream("POST", url, json=body) for _ in range(3)]
        for s in streams:
            s.__enter__()
        try:
            # two run, one waits: the queue (--max_queue_len 1) is full
            wait_for(
                lambda: (
                    (
                        scrape(server.base_url, "lightllm_num_requests_running"),
                        scrape(server.base_url, "lightllm_num_requests_waiting"),
                    )
                    == (2, 1)
                ),
                what="two running and one waiting",
            )
            r = _post(server, "/v1/completions", {**body, "stream": False, "max_tokens": 1})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
        finally:
            for s in streams:
                s.__exit__(None, None, None)
    wait_for(lambda: scrape(server.base_url, "lightllm_free_state_slots") == 2, what="slots returned")
    assert _post(server, "/v1/completions", {**body, "stream": False, "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize(
    "path", ["/v1/models", "/v1/completions", "/tokenize", "/detokenize", "/openapi.json", "/docs", "/redoc"]
)
def test_api_key_required_on_protected_paths(server, path):
    body = {"model": server.model, "prompt": "x", "max_tokens": 1, "tokens": [1]}
    gets = ("/v1/models", "/openapi.json", "/docs", "/redoc")
    send = (lambda h: httpx.get(f"{server.base_url}{path}", headers=h)) if path in gets else None
    send = send or (lambda h: _post(server, path, body, headers=h))
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}):
        r = send(headers)
        assert r.status_code == 401, headers
        assert r.json()["error"]["code"] == 401 and "API key" in r.json()["error"]["message"]
    assert send(AUTH).status_code == 200
    # the scheme is case-insensitive (RFC 9110), the key is not
    assert send({"authorization": f"bearer {KEY}"}).status_code == 200
    assert send({"authorization": f"BEARER  {KEY}"}).status_code == 200
    assert send({"authorization": f"bearer {KEY.upper()}"}).status_code == 401


def test_api_key_with_openai_client(server):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="nope", max_retries=0).models.list()
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == [server.model]


def test_open_paths_need_no_key(server):
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(f"{server.base_url}{path}").status_code == 200, path


def test_openapi_documents_400_not_422(server):
    schema = httpx.get(f"{server.base_url}/openapi.json", headers=AUTH).json()
    responses = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert "422" not in responses and "400" in responses
    assert "422" not in json.dumps(schema["paths"])


def test_api_key_is_not_in_args_repr(server):
    assert KEY not in repr(server.args) and server.args.api_key == KEY


def test_trusted_server_renders_a_client_chat_template(server):
    messages = [{"role": "user", "content": "hi there"}]
    body = {"model": server.model, "messages": messages, "max_tokens": 1}
    template = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    r = _post(server, "/v1/chat/completions", {**body, "chat_template": template})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(server.tokenizer.encode_rendered("[hi there]"))
    # twin: the checkpoint's own template builds a different prompt
    own = _post(server, "/v1/chat/completions", body).json()["usage"]["prompt_tokens"]
    assert own == len(server.tokenizer.encode_chat(messages)) != r.json()["usage"]["prompt_tokens"]
