"""Tool calling, reasoning and structured output over HTTP with the official openai client, engine = fake runner
(its output is meaningless text, so a tool call is made by forcing it: tool_choice required / named is a grammar).

The flow an agent runs: the model calls a tool, the client sends the result back, the model answers. The history
(assistant tool_calls and the tool message) must reach the model: its prompt tokens are those of the chat template
rendering them.
"""

from __future__ import annotations

import json

import openai
import pytest

from unit_tests.server.live_server import tiny_checkpoint_server

CITY = {"type": "string", "enum": ["Paris", "Oslo"]}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": CITY, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                "required": ["city", "days"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module", params=[("qwen3_5", "think"), ("qwen3_next", "none"), ("kimi_linear", "none")])
def server(request):
    s = tiny_checkpoint_server(*request.param)
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _prompt_len(server, messages: list[dict], tools=TOOLS) -> int:
    """Prompt tokens of the conversation as the chat template renders it (the reference)."""
    tok = server.tokenizer
    text = tok.render_chat(messages, tools=tools, enable_thinking=False)
    return len(tok.encode_rendered(text))


def test_call_result_answer_flow(server, client):
    messages = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    first = client.chat.completions.create(
        model=server.model,
        messages=messages,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=96,
        extra_body=NO_THINKING,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Oslo") and 1 <= args["days"] <= 7
    assert first.usage.prompt_tokens == _prompt_len(server, messages)

    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    final = client.chat.completions.create(
        model=server.model, messages=messages, tools=TOOLS, max_tokens=8, extra_body=NO_THINKING
    )
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the call and its result are in the prompt: the template's rendering of them (arguments as an object, as
    # transformers documents) gives the prompt's length, and its text holds the call's arguments and the result
    rendered_call = {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": args}}
    reference = [
        messages[0],
        {"role": "assistant", "content": "", "tool_calls": [rendered_call]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    history = server.tokenizer.render_chat(reference, tools=TOOLS, enable_thinking=False)
    assert "sunny, 21 C" in history and args["city"] in history.split("Weather in Paris")[1]
    assert final.usage.prompt_tokens == _prompt_len(server, reference)
    # twin: the conversation without the call and its result is shorter
    assert final.usage.prompt_tokens > _prompt_len(server, messages[:1]) + 8


def test_history_with_a_call_is_the_prompt_the_engine_gets(server, client, prompts_sent):
    """The ids, not only their count: the engine's prompt is the template's rendering of the call (its arguments, a
    JSON string on the wire, as an object) and of the tool's result."""
    args = {"city": "Oslo", "days": 2}

    def conversation(result: str, arguments) -> list[dict]:
        call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        return [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": result},
        ]

    def send(result: str) -> list[int]:
        prompts_sent.clear()
        client.chat.completions.create(
            model=server.model,
            messages=conversation(result, json.dumps(args)),
            tools=TOOLS,
            max_tokens=2,
            extra_body=NO_THINKING,
        )
        (prompt,) = prompts_sent
        return prompt

    tok = server.tokenizer
    reference = tok.render_chat(conversation("rain, 9 C", args), tools=TOOLS, enable_thinking=False)
    assert "rain, 9 C" in reference and "Oslo" in reference.split("Weather in Oslo?")[1]
    assert send("rain, 9 C") == tok.encode_rendered(reference)
    # twin: another tool result is another prompt
    assert send("snow, -3 C") != tok.encode_rendered(reference)


def test_required_streams_calls_in_openai_shape(server, client):
    stream = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Weather and time?"}],
        tools=TOOLS,
        tool_choice="required",
        max_tokens=128,
        stream=True,
        extra_body=NO_THINKING,
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:
            if tc.index not in calls:
                # the first delta of a call carries its id and name
                assert tc.id and tc.function.name
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments or ""}
            else:
                assert tc.id is None and tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish in ("tool_calls", "length")
    assert calls and sorted(calls) == list(range(len(calls)))
    if finish == "tool_calls":
        for call in calls.values():
            assert call["name"] in ("get_weather", "get_time")
            assert isinstance(json.loads(call["arguments"]), dict)


def test_json_schema_response_is_valid(server, client):
    schema = {
        "type": "object",
        "properties": {"city": CITY, "ok": {"type": "boolean"}},
        "required": ["city", "ok"],
        "additionalProperties": False,
    }
    out = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "JSON please"}],
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": True}},
        max_tokens=64,
        n=2,
        temperature=1.0,
        extra_body=NO_THINKING,
    )
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        value = json.loads(choice.message.content)
        assert set(value) == {"city", "ok"} and value["city"] in ("Paris", "Oslo")


def test_tool_choice_none_offers_no_tools(server, client):
    out = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "hi"}],
        tools=TOOLS,
        tool_choice="none",
        max_tokens=4,
        extra_body=NO_THINKING,
    )
    assert out.choices[0].message.tool_calls is None
    assert out.usage.prompt_tokens == _prompt_len(server, [{"role": "user", "content": "hi"}], tools=None)


def test_thinking_prompt_leaves_the_reasoning_free(server, client):
    """The template opened a reasoning block: the forced call's grammar waits for `</think>`, which this model
    never writes, so the whole output is reasoning (with a reasoning parser) and no call is made."""
    if server.args.reasoning_parser == "none" or server.info.model_type != "qwen3_5":
        pytest.skip("needs a template that opens a reasoning block and a reasoning parser")
    out = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=TOOLS,
        tool_choice="required",
        max_tokens=12,
    )
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "length" and message.tool_calls is None
    assert message.reasoning_content and not message.content
