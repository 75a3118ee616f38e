"""The chat route's response assembly (lightllm.server.http.chat_api): one sequence's text, delivered in engine
deltas of any size, becomes reasoning_content, content and tool_calls in OpenAI's shapes, streamed and not."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from lightllm.server.http.chat_api import ChatOutput, _choice, _events
from lightllm.server.http.openai_api import StreamUsage
from lightllm.server.http.protocol import ChatCompletionRequest
from lightllm.server.http.serving import Sequence
from lightllm.server.output import Delta

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
TEXT = (
    "I should look it up.</think>\n\nChecking.<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
    "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"
    "</parameter>\n</function>\n</tool_call>"
)


def _setup(parallel: bool = True):
    fe = SimpleNamespace(
        args=SimpleNamespace(tool_call_parser="auto", reasoning_parser="auto"),
        info=SimpleNamespace(model_type="qwen3_5"),
        tokenizer=SimpleNamespace(whole_tokens={}),
    )
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "parallel_tool_calls": parallel}
    )
    out = ChatOutput(fe, body)
    out.starts_in_reasoning = True
    return fe, out


def _sequence(text: str, reason: str = "stop") -> Sequence:
    return Sequence(0, 0, "r", SimpleNamespace(text=text, token_ids=[], logprobs=None, finish_reason=reason))


async def _stream(pieces: list[str]):
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        yield _sequence(""), Delta(text=piece, token_ids=[1], finish_reason="stop" if last else None)


def _collect_events(fe, out, pieces: list[str]) -> list[dict]:
    async def run():
        events = []
        async for event in _events(fe, out, _stream(pieces), 1, StreamUsage(None, [3], 1), "id", 0, "m", [1, 2, 3]):
            events.append(event)
        return events

    raw = asyncio.run(run())
    assert raw[-1] == b"data: [DONE]\n\n"
    return [json.loads(e[len(b"data: ") :]) for e in raw[:-1]]


def test_non_streamed_message():
    fe, out = _setup()
    choice = _choice(fe, out, _sequence(TEXT))
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert message["reasoning_content"] == "I should look it up."
    assert message["content"] == "Checking."
    calls = message["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}, {"city": "Oslo"}]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert calls[0]["id"] != calls[1]["id"]


@pytest.mark.parametrize("size", [1, 3, 8, 1000])
def test_streamed_events_add_up_to_the_message(size):
    fe, out = _setup()
    events = _collect_events(fe, out, [TEXT[i : i + size] for i in range(0, len(TEXT), size)])
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    reasoning = content = ""
    calls: dict[int, dict] = {}
    finish = None
    for event in events[1:]:
        (choice,) = event["choices"]
        delta = choice["delta"]
        reasoning += delta.get("reasoning_content", "")
        content += delta.get("content", "")
        for entry in delta.get("tool_calls", []):
            if entry["index"] not in calls:
                assert entry["id"] and entry["type"] == "function" and entry["function"]["name"] == "get_weather"
                calls[entry["index"]] = {"arguments": entry["function"]["arguments"]}
            else:
                assert "id" not in entry and "name" not in entry["function"]
                calls[entry["index"]]["arguments"] += entry["function"]["arguments"]
        finish = choice["finish_reason"] or finish
    assert (reasoning, content, finish) == ("I should look it up.", "Checking.", "tool_calls")
    assert [json.loads(calls[i]["arguments"]) for i in sorted(calls)] == [{"city": "Paris"}, {"city": "Oslo"}]


def test_parallel_tool_calls_false_keeps_the_first():
    fe, out = _setup(parallel=False)
    assert len(_choice(fe, out, _sequence(TEXT))["message"]["tool_calls"]) == 1
    events = _collect_events(fe, out, [TEXT[i : i + 5] for i in range(0, len(TEXT), 5)])
    indexes = {e["index"] for ev in events[1:] for e in ev["choices"][0]["delta"].get("tool_calls", [])}
    assert indexes == {0}


def test_plain_answer_without_tools_or_reasoning_block():
    fe, out = _setup()
    out.starts_in_reasoning = False
    choice = _choice(fe, out, _sequence("Just text with <tool_call> in it.", reason="length"))
    assert choice["message"]["content"] == "Just text with <tool_call> in it."
    assert choice["message"]["reasoning_content"] is None and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "length"


def test_openapi_schema_describes_the_agent_fields():
    from fastapi import FastAPI

    from lightllm.server.http.chat_api import router

    app = FastAPI()
    app.include_router(router)
    schemas = app.openapi()["components"]["schemas"]
    request = schemas["ChatCompletionRequest"]["properties"]
    for name in ("tools", "tool_choice", "parallel_tool_calls", "response_format", "chat_template_kwargs"):
        assert request[name].get("description"), name
    assert {"tool_calls", "tool_call_id", "reasoning_content"} <= set(schemas["ChatMessage"]["properties"])
    assert set(schemas["ResponseFormat"]["properties"]["type"]["enum"]) == {
        "text",
        "json_object",
        "json_schema",
        "structural_tag",
    }
    assert "schema" in schemas["JsonSchemaFormat"]["properties"]
    assert schemas["FunctionDef"]["properties"]["name"]["pattern"]


def test_constrained_output_on_a_tiktoken_checkpoint_gets_its_grammar(tmp_path):
    """A checkpoint with only tiktoken.model (Kimi's released format) is constrained like any other: the engine
    reads its vocabulary from that file (unit_tests/server/test_grammar_vocab.py)."""
    from lightllm.engine.sampling_params import SamplingParams
    from lightllm.server.http.chat_api import _constrain
    from lightllm.server.http.serving import ApiError

    async def offload(fn, *args):
        return fn(*args)

    (tmp_path / "tiktoken.model").write_text("")
    fe, out = _setup()
    fe.info.model_dir, fe.offload = str(tmp_path), offload
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}
    )
    out.starts_in_reasoning = False
    params = asyncio.run(_constrain(fe, body, out, SamplingParams()))
    assert params.grammar and params.grammar_start_token is None
    # twin: without response_format nothing is constrained
    plain = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert asyncio.run(_constrain(fe, plain, out, SamplingParams())).grammar is None
    # a grammar ends with EOS: ignore_eos would pad to max_tokens with it
    with pytest.raises(ApiError) as err:
        asyncio.run(_constrain(fe, body, out, SamplingParams(ignore_eos=True)))
    assert err.value.status == 400 and err.value.param == "ignore_eos"


@pytest.mark.parametrize("opened", [True, False])
def test_structured_outputs_start_after_a_reasoning_block_the_prompt_opened(opened):
    """structured_outputs, like response_format, constrains the answer: with the prompt inside `<think>` its
    grammar applies from `</think>` (the tokenizer's one token for it) on; the twin, a prompt without the block,
    constrains from the first token."""
    from lightllm.engine.sampling_params import SamplingParams
    from lightllm.server.http.chat_api import _constrain
    from lightllm.server.http.structured import structured_outputs_grammar

    async def offload(fn, *args):
        return fn(*args)

    think_close = 77
    fe, out = _setup()
    fe.offload = offload
    fe.tokenizer = SimpleNamespace(
        encode_rendered=lambda text: [think_close] if text == "</think>" else [1, 2], whole_tokens={}
    )
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "structured_outputs": {"regex": "[0-9]{2}"}}
    )
    out.starts_in_reasoning = opened
    params = asyncio.run(_constrain(fe, body, out, SamplingParams()))
    assert params.grammar == structured_outputs_grammar(body.structured_outputs, {})
    assert params.grammar_start_token == (think_close if opened else None)
