"""Streamed background responses over HTTP (the fake runner behind a tiny checkpoint's tokenizer and template): a
`background` + `stream` request streams what a foreground stream gives, numbered on from the queued events; the
stream is read again whole or after any event (`GET /v1/responses/{id}?stream=true&starting_after=N`) on other
connections, while the response runs and after it ended, and a client that left mid-stream loses nothing; a cancel
ends the stream with an error event; what cannot be streamed is refused by name."""

from __future__ import annotations

import itertools
import random
import time

import httpx
import openai
import pytest

from unit_tests.server.live_server import tiny_checkpoint_server
from unit_tests.server.responses_stream import stream_events


def _json_answer(name: str, string: dict) -> dict:
    """Fields that ask for a JSON object holding one string of the `string` schema, without reasoning first."""
    schema = {"type": "object", "properties": {"a": {"type": "string", **string}}, "required": ["a"]}
    schema["additionalProperties"] = False
    return {
        "text": {"format": {"type": "json_schema", "name": name, "schema": schema}},
        "reasoning": {"effort": "none"},
    }


# an answer the grammar ends early (so it completes)
SHORT = _json_answer("short", {"maxLength": 6})
# an answer that cannot end before max_output_tokens
LONG = _json_answer("long", {"minLength": 1000})


@pytest.fixture(scope="module")
def server():
    s = tiny_checkpoint_server("qwen3_5", "think")
    yield s
    s.close()


def _body(server, **fields) -> dict:
    return {"model": server.model, "max_output_tokens": 24, "temperature": 0.0, **fields}


def _post_stream(server, limit: int | None = None, **fields) -> list[tuple[str, dict]]:
    """The events of a streamed request; with `limit`, only the first `limit` (the connection then closes)."""
    with httpx.stream(
        "POST", f"{server.base_url}/v1/responses", json=_body(server, stream=True, **fields), timeout=60
    ) as s:
        assert s.status_code == 200, s.read()
        return list(itertools.islice(stream_events(s.iter_lines()), limit))


def _resumed(server, response_id: str, starting_after: int | None = None) -> list[tuple[str, dict]]:
    params = {"stream": "true"} if starting_after is None else {"stream": "true", "starting_after": starting_after}
    with httpx.stream("GET", f"{server.base_url}/v1/responses/{response_id}", params=params, timeout=60) as s:
        assert s.status_code == 200, s.read()
        return list(stream_events(s.iter_lines()))


def _poll(server, response_id: str, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        response = httpx.get(f"{server.base_url}/v1/responses/{response_id}", timeout=30).json()
        if response["status"] not in ("queued", "in_progress") or time.monotonic() > deadline:
            return response
        time.sleep(0.05)


def _text(events: list[tuple[str, dict]]) -> str:
    return "".join(e["delta"] for kind, e in events if kind in ("response.output_text.delta",))


def test_a_background_stream_streams_what_a_foreground_one_does(server):
    foreground = _post_stream(server, input="Name a prime.", store=False, **SHORT)
    background = _post_stream(server, input="Name a prime.", background=True, **SHORT)
    kinds = [kind for kind, _ in background]
    assert kinds[:3] == ["response.created", "response.queued", "response.in_progress"]
    assert background[0][1]["response"]["status"] == "queued" and background[0][1]["response"]["background"]
    # the same events after the opening ones (a foreground stream is not queued first), numbered on from them
    assert kinds[3:] == [kind for kind, _ in foreground][2:]
    assert [e["sequence_number"] for _, e in background] == list(range(len(background)))
    assert _text(background) == _text(foreground) != ""
    final = background[-1][1]["response"]
    assert kinds[-1] == "response.completed" == f"response.{final['status']}", _text(background)
    assert _poll(server, final["id"]) == final
    # the twin: another question streams another answer
    assert _text(_post_stream(server, input="Name a composite.", background=True, **SHORT)) != _text(background)


def test_the_stream_is_read_again_whole_or_after_any_event(server):
    streamed = _post_stream(server, input="Count.", background=True, max_output_tokens=60, **LONG)
    response_id = streamed[0][1]["response"]["id"]
    assert _resumed(server, response_id) == streamed
    rng = random.Random(5)
    for after in [-1, 0, 2, rng.randrange(3, len(streamed) - 2), len(streamed) - 2, len(streamed) - 1]:
        assert _resumed(server, response_id, after) == streamed[after + 1 :], after
    # the twin: a shifted cursor gives a shifted stream
    assert _resumed(server, response_id, 4) != streamed[4:]


def test_a_client_that_left_mid_stream_picks_it_up_where_it_left_off(server):
    first = _post_stream(server, limit=6, input="Count slowly.", background=True, max_output_tokens=400, **LONG)
    response_id, last_seen = first[0][1]["response"]["id"], first[-1][1]["sequence_number"]
    # the response ran on without its client; the rest of its stream, on another connection, completes it
    rest = _resumed(server, response_id, last_seen)
    assert [e["sequence_number"] for _, e in first + rest] == list(range(len(first) + len(rest)))
    final = rest[-1][1]["response"]
    assert final["status"] == "incomplete" and final["usage"]["output_tokens"] == 400
    assert _text(first + rest) == final["output"][0]["content"][0]["text"]
    assert _resumed(server, response_id) == first + rest


def test_the_openai_client_streams_and_resumes_a_background_response(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    fields = {"model": server.model, "input": "Name a prime.", "max_output_tokens": 24, "temperature": 0.0}
    stream = client.responses.create(background=True, stream=True, **fields, **SHORT)
    opening = [next(stream) for _ in range(3)]
    stream.close()
    response_id = opening[0].response.id
    assert [e.type for e in opening] == ["response.created", "response.queued", "response.in_progress"]
    with client.responses.stream(response_id=response_id) as resumed:
        final = resumed.get_final_response()
    stored = client.responses.retrieve(response_id)
    assert final.output_text == stored.output_text != "" and stored.status == "completed"
    after = list(client.responses.retrieve(response_id, stream=True, starting_after=2))
    assert after[0].sequence_number == 3 and after[-1].type == "response.completed"
    assert "".join(e.delta for e in after if e.type == "response.output_text.delta") == stored.output_text


def test_a_cancel_ends_the_stream_with_an_error_event(server):
    first = _post_stream(server, limit=4, input="Count slowly.", background=True, max_output_tokens=1500, **LONG)
    response_id = first[0][1]["response"]["id"]
    r = httpx.post(f"{server.base_url}/v1/responses/{response_id}/cancel", timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
    rest = _resumed(server, response_id, first[-1][1]["sequence_number"])
    kind, last = rest[-1]
    assert kind == "error" and last["code"] == "response_cancelled" and response_id in last["message"]
    # what was written before the cancel is in the stream, closed as the cancelled response shows it
    cancelled = r.json()
    assert _text(first + rest) == cancelled["output"][0]["content"][0]["text"]
    assert rest[-2][0] == "response.output_item.done" and rest[-2][1]["item"]["status"] == "incomplete"


def test_what_cannot_be_streamed_is_refused_by_name(server):
    plain = httpx.post(f"{server.base_url}/v1/responses", json=_body(server, input="Hi."), timeout=60).json()
    url = f"{server.base_url}/v1/responses/{plain['id']}"
    r = httpx.get(url, params={"stream": "true"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream", r.text
    r = httpx.get(url, params={"starting_after": 3}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "starting_after", r.text
    done = _post_stream(server, input="Hi.", background=True, **SHORT)
    r = httpx.get(url.replace(plain["id"], done[0][1]["response"]["id"]), params={"stream": "1", "starting_after": -2})
    assert r.status_code == 400 and "starting_after" in r.text, r.text
    # the twin: the same GET without stream or cursor reads the response
    assert httpx.get(url, timeout=30).json() == plain
