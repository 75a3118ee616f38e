"""The Responses API's output items and stream events from one text cut into deltas of any size (speculation
delivers several tokens at once): every event and the final response validate against the openai SDK's types;
the deltas join into the items the closing events carry; reasoning, text, calls and text after a call come out
as their own items whatever the cuts, a call's argument pieces stay with it; a cut-short output marks its last
item incomplete; a failure ends with `response.failed`; a background response's event log holds the same stream, and
one whose engine stream stops unfinished is failed. No server: the builder over a scripted stream."""

from __future__ import annotations

import asyncio
import json
import random
from types import SimpleNamespace

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from lightllm.server.http.background_responses import BackgroundResponses
from lightllm.server.http.chat_api import ChatOutput, ChatRun
from lightllm.server.http.protocol import ChatCompletionRequest
from lightllm.server.http.response_store import ResponseStore
from lightllm.server.http.responses_api import ResponseBuilder
from lightllm.server.http.responses_protocol import ResponsesRequest
from lightllm.server.http.serving import Sequence
from lightllm.server.output import Delta

TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\n{city}\n</parameter>\n</function>\n</tool_call>"
TEXT = "Look it up.</think>\n\nChecking." + CALL.format(city="Paris") + "\nDone." + CALL.format(city="Oslo")
EVENTS = TypeAdapter(ResponseStreamEvent)


def _builder(stream, max_output_tokens: int | None = None, store: ResponseStore | None = None) -> ResponseBuilder:
    fe = SimpleNamespace(
        args=SimpleNamespace(tool_call_parser="auto", reasoning_parser="auto", served_model_name="m"),
        info=SimpleNamespace(model_type="qwen3_5"),
        tokenizer=SimpleNamespace(encode_rendered=lambda text: list(range(len(text.split())))),
    )
    body = ResponsesRequest.model_validate(
        {"model": "m", "input": "x", "tools": [TOOL], "stream": True, "max_output_tokens": max_output_tokens}
    )
    out = ChatOutput(fe, ChatCompletionRequest.model_validate(body.chat_request()))
    out.starts_in_reasoning = True
    params = SimpleNamespace(temperature=1.0, top_p=1.0)
    return ResponseBuilder(fe, body, ChatRun(out, params, [1, 2, 3], stream), store, [])


def _sequence(text: str, reason: str | None) -> Sequence:
    output = SimpleNamespace(text=text, token_ids=[1] * 9, finish_reason=reason, num_cached_tokens=0, error="boom")
    return Sequence(0, 0, "r", output)


async def _stream(pieces: list[str], reason: str):
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        yield _sequence(piece, reason if last else None), Delta(text=piece, finish_reason=reason if last else None)


def _events(pieces: list[str], reason: str = "stop", **kwargs) -> list[dict]:
    builder = _builder(_stream(pieces, reason), **kwargs)

    async def run():
        return [event async for event in builder.events()]

    events = []
    for raw in asyncio.run(run()):
        kind_line, data_line = raw.decode().strip().split("\n")
        event = json.loads(data_line[len("data: ") :])
        assert kind_line == f"event: {event['type']}"
        EVENTS.validate_python(event)
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def _cuts(text: str, rng: random.Random, most: int) -> list[str]:
    pieces, i = [], 0
    while i < len(text):
        n = rng.randint(1, most)
        pieces.append(text[i : i + n])
        i += n
    return pieces


@pytest.mark.parametrize("most", [1, 4, 16, 64])
def test_any_cut_gives_the_same_items_and_valid_events(most):
    rng = random.Random(most)
    for _ in range(5):
        events = _events(_cuts(TEXT, rng, most))
        final = events[-1]
        assert final["type"] == "response.completed"
        Response.model_validate(final["response"])
        items = final["response"]["output"]
        kinds = [item["type"] for item in items]
        assert kinds == ["reasoning", "message", "function_call", "message", "function_call"], kinds
        assert items[0]["content"][0]["text"] == "Look it up."
        assert [json.loads(i["arguments"]) for i in items if i["type"] == "function_call"] == [
            {"city": "Paris"},
            {"city": "Oslo"},
        ]
        texts = [i["content"][0]["text"].strip() for i in items if i["type"] == "message"]
        assert texts == ["Checking.", "Done."]
        for index, item in enumerate(items):
            mine = [e for e in events if e.get("output_index") == index]
            assert mine[0]["type"] == "response.output_item.added" and mine[-1]["type"] == "response.output_item.done"
            assert mine[-1]["item"] == item and item["status"] == "completed"
            joined = "".join(e["delta"] for e in mine if e["type"].endswith(".delta"))
            assert joined == (item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"])


def test_one_delta_keeps_its_text_in_one_message_before_its_calls():
    """Within one delta the parser's text and calls are apart: the text written after a call joins the message
    before it (the order of items is kept to a delta's resolution)."""
    items = _events([TEXT])[-1]["response"]["output"]
    assert [item["type"] for item in items] == ["reasoning", "message", "function_call", "function_call"]
    assert items[1]["content"][0]["text"] == "Checking.\nDone."


def test_a_cut_short_output_marks_its_last_item_incomplete():
    events = _events(_cuts(TEXT[:-30], random.Random(1), 6), reason="length", max_output_tokens=9)
    response = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete" and response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [item["status"] for item in response["output"]][-1] == "incomplete"
    assert {item["status"] for item in response["output"][:-1]} == {"completed"}


def test_a_failure_ends_with_the_failed_response():
    events = _events(["Look", " it"], reason="error")
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["message"] == "boom"


def _background(pieces: list[str], tmp_path, finishes: bool = True) -> tuple[list[dict], dict]:
    """The events a reader of a background response's log gets, read while it runs, and the stored response; the
    engine's stream ends without a finish unless `finishes`."""
    store = ResponseStore(str(tmp_path), 2**20)

    async def stream():
        async for seq, delta in _stream(pieces, "stop"):
            if delta.finish_reason and not finishes:
                return
            yield seq, delta

    async def run():
        background = BackgroundResponses(store)
        builder = _builder(stream(), store=store)
        await background.start(builder)
        events = [json.loads(line) async for _, line in background.events(builder.id, -1)]
        await background.close()
        return events, store.get(builder.id).response

    events, stored = asyncio.run(run())
    for event in events:
        EVENTS.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events, stored


def test_a_background_responses_log_holds_the_foreground_stream(tmp_path):
    pieces = _cuts(TEXT, random.Random(21), 6)
    events, stored = _background(pieces, tmp_path)
    foreground = _events(pieces)
    assert [e["type"] for e in events[:3]] == ["response.created", "response.queued", "response.in_progress"]
    assert [e["type"] for e in events[3:]] == [e["type"] for e in foreground[2:]]
    assert events[-1]["response"] == stored and stored["status"] == "completed"
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == "".join(e["delta"] for e in foreground if e["type"] == "response.output_text.delta") != ""


def test_a_background_response_whose_stream_stops_unfinished_is_failed(tmp_path):
    events, stored = _background(_cuts(TEXT, random.Random(22), 6), tmp_path, finishes=False)
    assert stored["status"] == "failed" and "without finishing" in stored["error"]["message"]
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    # the twin: the same stream with its finish completes
    assert _background(_cuts(TEXT, random.Random(22), 6), tmp_path / "twin")[1]["status"] == "completed"
