"""Property-based fuzzing of the live server (fake runner): whatever a client sends to the OpenAI routes and the
tokenizer endpoints, the answer is never a 5xx, every error is an OpenAI error body, every stream ends with
[DONE], and afterwards every state slot is free. Bounded to a fixed number of examples (about a minute on 2 cores).
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unit_tests.server.conftest import scrape, wait_for
from unit_tests.server.live_server import LiveServer

MAX_RUNNING = 8
EXAMPLES = 800

# values a hostile client tries in any field
HOSTILE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, -1, 0]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(["16", "yes", "", "\ud800", "\udfffx", "true", "NaN"]),
    st.lists(st.integers(min_value=-3, max_value=600), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
SMALL_TEXT = st.text(max_size=30)
PROMPT = st.one_of(
    SMALL_TEXT,
    st.lists(SMALL_TEXT, max_size=3),
    st.lists(st.integers(min_value=-2, max_value=520), max_size=8),
    st.lists(st.lists(st.integers(min_value=0, max_value=511), max_size=5), max_size=3),
    HOSTILE,
)
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.one_of(st.sampled_from(["user", "system", "assistant"]), HOSTILE),
        "content": st.one_of(SMALL_TEXT, HOSTILE),
    }
)


# each field's valid values; a request makes at most two fields (or its text fields) hostile
VALID = {
    "max_tokens": st.integers(min_value=1, max_value=8),
    "n": st.integers(min_value=1, max_value=3),
    "temperature": st.floats(min_value=0, max_value=2),
    "top_p": st.floats(min_value=0.01, max_value=1),
    "top_k": st.integers(min_value=-1, max_value=2**31 - 1),
    "min_p": st.floats(min_value=0, max_value=1),
    "repetition_penalty": st.floats(min_value=0.1, max_value=10),
    "presence_penalty": st.floats(min_value=-2, max_value=2),
    "seed": st.integers(min_value=0, max_value=2**63 - 3),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=3)),
    "stop_token_ids": st.lists(st.integers(min_value=0, max_value=511), max_size=3),
    "logprobs": st.integers(min_value=0, max_value=5),
    "echo": st.booleans(),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "stream": st.booleans(),
    "chat_template_kwargs": st.dictionaries(st.sampled_from(["enable_thinking", "x"]), st.booleans()),
}


@st.composite
def requests(draw, model: str):
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]))
    hostile = draw(st.sets(st.sampled_from(sorted([*VALID, "model", "text"])), max_size=2))
    body: dict = {"model": draw(HOSTILE) if "model" in hostile else model}
    text = st.text(min_size=1, max_size=30)
    if path == "/v1/completions":
        body["prompt"] = draw(PROMPT if "text" in hostile else st.one_of(text, st.lists(text, min_size=1, max_size=3)))
    elif path == "/tokenize" and draw(st.booleans()):
        body["prompt"] = draw(PROMPT if "text" in hostile else text)
    if path == "/v1/chat/completions" or (path == "/tokenize" and "prompt" not in body):
        valid_messages = st.lists(
            st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": text}),
            min_size=1,
            max_size=3,
        )
        body["messages"] = draw(
            st.one_of(st.lists(MESSAGE, min_size=1, max_size=3), HOSTILE) if "text" in hostile else valid_messages
        )
    if path == "/detokenize":
        ids = st.lists(st.integers(min_value=0, max_value=511), max_size=8)
        body["tokens"] = draw(
            st.one_of(st.lists(st.integers(min_value=-1, max_value=600), max_size=8), HOSTILE)
            if "text" in hostile
            else ids
        )
    for name, valid in VALID.items():
        if name in hostile:
            body[name] = draw(HOSTILE)
        elif draw(st.integers(0, 2)) == 0:
            body[name] = draw(valid)
    if path == "/v1/chat/completions" and "logprobs" in body and "logprobs" not in hostile:
        # chat's logprobs is a boolean, with top_logprobs for alternatives
        body["top_logprobs"], body["logprobs"] = body["logprobs"], True
    if body.get("stream") is True and draw(st.booleans()):
        body["stream_options"] = {"include_usage": True}
    return path, body


@pytest.fixture(scope="module")
def server():
    s = LiveServer(device="cpu", max_running_requests=MAX_RUNNING, max_total_token_num=2048, chunked_prefill_size=64)
    yield s
    s.close()


def test_fuzz_never_5xx(server):
    http = httpx.Client(base_url=server.base_url, timeout=60)
    seen: dict[int, int] = {}

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(requests(server.model))
    def check(request):
        path, body = request
        # allow_nan: NaN and Infinity literals are what a hostile client sends; ensure_ascii keeps lone surrogates
        raw = json.dumps(body, allow_nan=True).encode()
        headers = {"content-type": "application/json"}
        with http.stream("POST", path, content=raw, headers=headers) as r:
            text = r.read().decode("utf-8", errors="replace")
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, f"{path} {raw[:300]!r} -> {r.status_code} {text[:300]}"
        if r.status_code >= 400:
            error = json.loads(text)["error"]
            assert error["message"] and error["code"] == r.status_code
        elif r.headers["content-type"].startswith("text/event-stream"):
            assert text.rstrip().endswith("data: [DONE]"), text[-300:]
            # every event is JSON and none is an error event (the generated text itself may say "error")
            events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
            assert all("error" not in json.loads(event) for event in events[:-1]), text[-300:]

    try:
        check()
    finally:
        http.close()
    # both outcomes were exercised, so "no 5xx" covers served requests too
    assert seen.get(200, 0) > EXAMPLES // 10 and seen.get(400, 0) > EXAMPLES // 10, seen
    wait_for(lambda: scrape(server.base_url, "lightllm_free_state_slots") == MAX_RUNNING, what="slots returned")
    assert httpx.get(f"{server.base_url}/health").status_code == 200
