"""OpenAI's Responses API (`POST /v1/responses`) against the chat route it is served through (the fake runner behind
tiny checkpoints' tokenizers and templates, n-gram drafts on): the same seed gives the same reasoning, text and
calls; input items render the conversation an explicit chat history renders; the stream's typed events build
exactly the plain response's items; what cannot be served is a 400 naming the Responses field."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from unit_tests.server.live_server import tiny_checkpoint_server

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": WEATHER}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}


@pytest.fixture(scope="module", params=[("qwen3_5", "think"), ("kimi_linear", "none")])
def server(request):
    s = tiny_checkpoint_server(*request.param)
    yield s
    s.close()


def _responses(server, **fields) -> httpx.Response:
    body = {"model": server.model, "max_output_tokens": 16, "temperature": 1.0, **fields}
    return httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=60)


def _chat(server, **fields) -> dict:
    body = {"model": server.model, "max_tokens": 16, "temperature": 1.0, **fields}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _items(response: dict, kind: str) -> list[dict]:
    return [item for item in response["output"] if item["type"] == kind]


def _text(response: dict, kind: str) -> str:
    return "".join(part["text"] for item in _items(response, kind) for part in item["content"])


def test_text_and_reasoning_equal_the_chat_answer(server, prompts_sent):
    """A greedy response carries the greedy chat answer's reasoning and content as its items, and its usage counts
    the same prompt; the twin, another question, gets another answer."""
    r = _responses(server, input="Name a prime.", temperature=0.0)
    assert r.status_code == 200, r.text
    response = r.json()
    chat = _chat(server, messages=[{"role": "user", "content": "Name a prime."}], temperature=0.0)
    message = chat["choices"][0]["message"]
    assert prompts_sent[0] == prompts_sent[1]
    assert _text(response, "message") == (message["content"] or "")
    assert _text(response, "reasoning") == (message.get("reasoning_content") or "")
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"] == len(prompts_sent[0])
    assert response["usage"]["output_tokens"] == 16 and response["store"] is True
    # a bound on OpenAI's built-in tools, none of which run here: accepted, echoed, changes nothing
    bounded = _responses(server, input="Name a prime.", temperature=0.0, max_tool_calls=0).json()
    assert bounded["max_tool_calls"] == 0 and bounded["output"][0]["content"] == response["output"][0]["content"]
    other = _responses(server, input="Name a composite.", temperature=0.0).json()
    assert (_text(other, "message"), _text(other, "reasoning")) != (
        _text(response, "message"),
        _text(response, "reasoning"),
    )


def test_input_items_render_the_equivalent_chat_history(server, prompts_sent):
    """instructions, a developer message, an earlier answer with its reasoning, a function call and its output
    render exactly as the chat history written out by hand."""
    items = [
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Use the tool."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    r = _responses(server, input=items, instructions="You are terse.", tools=[TOOL])
    assert r.status_code == 200, r.text
    history = [
        {"role": "system", "content": "You are terse."},
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Use the tool.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    _chat(server, messages=history, tools=[CHAT_TOOL])
    assert len(prompts_sent) == 2 and prompts_sent[0] == prompts_sent[1]
    # the twin: without the function call's output the prompt differs
    prompts_sent.clear()
    assert _responses(server, input=items[:-1], instructions="You are terse.", tools=[TOOL]).status_code == 200
    _chat(server, messages=history, tools=[CHAT_TOOL])
    assert prompts_sent[0] != prompts_sent[1]


def test_a_forced_call_is_a_function_call_item(server):
    # thinking off: the fake model never closes a reasoning block, after which a forced call would start
    off = {"reasoning": {"effort": "none"}, "parallel_tool_calls": False}
    r = _responses(server, input="Weather in Oslo?", tools=[TOOL], tool_choice="required", max_output_tokens=64, **off)
    assert r.status_code == 200, r.text
    (call,) = _items(r.json(), "function_call")
    assert call["name"] == "get_weather" and json.loads(call["arguments"])["city"] in ("Paris", "Oslo")
    assert call["call_id"] and call["status"] == "completed" and r.json()["status"] == "completed"
    named = _responses(
        server,
        input="Weather?",
        tools=[TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=64,
        **off,
    )
    assert _items(named.json(), "function_call")[0]["name"] == "get_weather"


def test_text_format_json_schema_constrains_the_message(server):
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}
    fields = {"text": {"format": fmt}, "reasoning": {"effort": "none"}, "max_output_tokens": 48}
    response = _responses(server, input="Weather?", **fields).json()
    assert json.loads(_text(response, "message"))["city"] in ("Paris", "Oslo")
    assert response["text"]["format"]["name"] == "weather"


@pytest.mark.parametrize("tools", [False, True], ids=["text", "call"])
def test_the_stream_builds_the_plain_responses_items(server, tools):
    """The typed events: created, in_progress, then per item added → deltas → done, numbered from 1, ending in the
    finished response; the deltas join into the items the closing event holds, which equal a plain request's."""
    fields = {"input": "Weather in Oslo?", "temperature": 0.0, "max_output_tokens": 40}
    if tools:
        fields.update(tools=[TOOL], tool_choice="required", reasoning={"effort": "none"}, parallel_tool_calls=False)
    plain = _responses(server, **fields).json()
    r = _responses(server, stream=True, **fields)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in r.text.strip().split("\n\n"):
        kind_line, data_line = block.split("\n")
        event = json.loads(data_line[len("data: ") :])
        assert kind_line == f"event: {event['type']}"
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    final = events[-1]["response"]
    assert events[-1]["type"] == f"response.{final['status']}" == f"response.{plain['status']}"
    strip = lambda items: [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in items]  # noqa: E731
    assert strip(final["output"]) == strip(plain["output"])
    # each item's deltas join into its final text, between its added and done events
    for index, item in enumerate(final["output"]):
        mine = [e for e in events if e.get("output_index") == index]
        assert mine[0]["type"] == "response.output_item.added" and mine[-1]["type"] == "response.output_item.done"
        joined = "".join(e["delta"] for e in mine if e["type"].endswith(".delta"))
        assert joined == (item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"])


def test_the_openai_client_reads_it(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    response = client.responses.create(model=server.model, input="Hi", max_output_tokens=8, temperature=0)
    assert response.output_text == _text(
        _responses(server, input="Hi", max_output_tokens=8, temperature=0).json(), "message"
    )
    with client.responses.stream(model=server.model, input="Hi", max_output_tokens=8, temperature=0) as stream:
        streamed = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    assert streamed == response.output_text


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"max_tool_calls": -1}, "max_tool_calls"),
        ({"tools": [{"type": "web_search"}]}, "tools.0"),
        ({"temperature": 5.0}, "temperature"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.json_schema"),
        ({"tool_choice": "required"}, "tool_choice"),
        # vLLM's priority reaches the scheduler as on chat: this server schedules in arrival order
        ({"priority": 3}, "priority"),
        ({"cache_salt": ""}, "cache_salt"),
    ],
    ids=lambda v: json.dumps(v)[:40] if isinstance(v, dict) else v,
)
def test_what_cannot_be_served_is_400_naming_the_field(server, fields, param):
    r = _responses(server, **{"input": "Hi", **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.json()
    # the twin: the same request without the field is served
    assert _responses(server, input="Hi").status_code == 200


def test_output_text_logprobs_are_the_chat_answers(server):
    """top_logprobs: the message part's tokens with their logprobs and alternatives, as the same greedy chat answer
    reports them (without a final stop token, which writes no text); a stream's deltas carry the same; without it,
    none."""
    # no reasoning first (the chat logprobs would cover it too)
    fields = {"input": "Name a prime.", "temperature": 0.0, "top_logprobs": 2, "reasoning": {"effort": "none"}}
    response = _responses(server, **fields).json()
    part = response["output"][-1]["content"][0]
    question = [{"role": "user", "content": "Name a prime."}]
    chat = _chat(server, messages=question, temperature=0.0, logprobs=True, top_logprobs=2, reasoning_effort="none")
    expected = chat["choices"][0]["logprobs"]["content"]
    if chat["choices"][0]["finish_reason"] == "stop":
        expected = expected[:-1]
    assert part["text"] == chat["choices"][0]["message"]["content"]
    assert expected and part["logprobs"] == expected and all(len(e["top_logprobs"]) == 2 for e in expected)
    body = {"model": server.model, "max_output_tokens": 16, "stream": True, **fields}
    with httpx.stream("POST", f"{server.base_url}/v1/responses", json=body, timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    streamed = [e for ev in events if ev["type"] == "response.output_text.delta" for e in ev["logprobs"]]
    assert streamed == expected
    # the twin: not asked for, not there
    plain = _responses(server, **{k: v for k, v in fields.items() if k != "top_logprobs"}).json()
    plain = plain["output"][-1]["content"][0]
    assert "logprobs" not in plain and plain["text"] == part["text"]
