"""vLLM's chat rendering switches: `continue_final_message` renders the final assistant message left open so the
output continues it (the engine's prompt is exactly the template's rendering of that), `add_generation_prompt:
false` renders the messages without opening a turn; contradictory or unusable combinations get 400 naming the
field."""

from __future__ import annotations

import httpx
import pytest

from unit_tests.server.live_server import LiveServer, reasoning_and_content, tiny_checkpoint_server

MESSAGES = [
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "Seven, and the next one is"},
]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


@pytest.fixture(scope="module")
def server():
    s = tiny_checkpoint_server("qwen3_next", "none")
    yield s
    s.close()


def _chat(server, **fields) -> httpx.Response:
    body = {"model": server.model, "messages": MESSAGES, "max_tokens": 3, **fields}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)


def test_the_final_message_is_continued(server, prompts_sent):
    tok = server.tokenizer
    r = _chat(server, continue_final_message=True, add_generation_prompt=False)
    assert r.status_code == 200, r.text
    expected = tok.render_chat(MESSAGES, add_generation_prompt=False, continue_final_message=True)
    assert expected.endswith("Seven, and the next one is")
    assert prompts_sent == [tok.encode_rendered(expected)]
    # twins: the default opens a new assistant turn after the closed message; without a generation prompt the
    # final message is closed and no turn opened
    for fields, kwargs in (({}, {}), ({"add_generation_prompt": False}, {"add_generation_prompt": False})):
        prompts_sent.clear()
        assert _chat(server, **fields).status_code == 200
        other = tok.render_chat(MESSAGES, **kwargs)
        assert prompts_sent == [tok.encode_rendered(other)] and other != expected


def test_tokenize_renders_messages_as_the_chat_request_does(server, prompts_sent):
    """/tokenize of messages takes vLLM's add_generation_prompt and continue_final_message too: its ids are the
    prompt a chat request with the same fields hands the engine; the twin without them opens a new turn."""
    opening = {"continue_final_message": True, "add_generation_prompt": False}
    assert _chat(server, **opening).status_code == 200
    r = httpx.post(f"{server.base_url}/tokenize", json={"messages": MESSAGES, **opening}, timeout=60)
    assert r.status_code == 200, r.text
    assert prompts_sent == [r.json()["tokens"]]
    plain = httpx.post(f"{server.base_url}/tokenize", json={"messages": MESSAGES}, timeout=60).json()["tokens"]
    assert plain != r.json()["tokens"]
    assert plain == server.tokenizer.encode_rendered(server.tokenizer.render_chat(MESSAGES))
    r = httpx.post(f"{server.base_url}/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False})
    closed = server.tokenizer.render_chat(MESSAGES, add_generation_prompt=False)
    assert r.json()["tokens"] == server.tokenizer.encode_rendered(closed)
    bad = httpx.post(f"{server.base_url}/tokenize", json={"messages": MESSAGES, "continue_final_message": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "continue_final_message", bad.text


@pytest.fixture(scope="module")
def thinking_server():
    s = tiny_checkpoint_server("qwen3_5", "think")
    yield s
    s.close()


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_tokenize_takes_tools_and_template_variables_as_chat_does(thinking_server, prompts_sent):
    """/tokenize of messages with tools and chat_template_kwargs counts the prompt a chat request with the same
    fields hands the engine (vLLM's /tokenize takes both); twins: either left out gives another prompt."""
    s, messages = thinking_server, [MESSAGES[0]]
    fields = {"tools": [WEATHER_TOOL], "chat_template_kwargs": {"enable_thinking": False}}
    r = httpx.post(
        f"{s.base_url}/v1/chat/completions",
        json={"model": s.model, "messages": messages, "max_tokens": 2, **fields},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    counted = httpx.post(f"{s.base_url}/tokenize", json={"messages": messages, **fields}, timeout=60)
    assert counted.status_code == 200, counted.text
    assert prompts_sent == [counted.json()["tokens"]]
    for left_out in fields:
        other = {k: v for k, v in fields.items() if k != left_out}
        r = httpx.post(f"{s.base_url}/tokenize", json={"messages": messages, **other}, timeout=60)
        assert r.json()["tokens"] != counted.json()["tokens"], left_out
    bad = {"messages": messages, "chat_template_kwargs": {"tools": []}}
    r = httpx.post(f"{s.base_url}/tokenize", json=bad, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs.tools", r.text


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_continued_reasoning_block_stays_reasoning(thinking_server, stream):
    """A prefilled reply that opened `<think>` and did not close it is continued inside the block: the output up to
    `</think>` (which this model never writes) is reasoning, as when the template opens the block. The twin: a
    prefill whose block is closed is continued as the answer."""
    s = thinking_server
    opened = [MESSAGES[0], {"role": "assistant", "content": "<think>\nSeven is prime; the next"}]
    closed = [MESSAGES[0], {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\nSeven, and the next"}]
    parts = {}
    for name, messages in (("opened", opened), ("closed", closed)):
        body = {"model": s.model, "messages": messages, "max_tokens": 8, "stream": stream}
        body.update(continue_final_message=True, add_generation_prompt=False)
        r = httpx.post(f"{s.base_url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        parts[name] = reasoning_and_content(r, stream)
    assert parts["opened"][0] and not parts["opened"][1]
    assert parts["closed"][1] and not parts["closed"][0]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_echo_starts_the_answer_with_the_final_assistant_message(thinking_server, stream):
    """vLLM's `echo`: the final message, when it is the assistant's, starts the response. A continued one is parsed
    with the output (its opened `<think>` makes its text and the output's reasoning; a closed block splits it), a
    finished one precedes the new turn's content verbatim; a final user message echoes nothing. Each is checked
    against the same request without echo (the engine's output is the same: echo changes no prompt)."""
    s = thinking_server
    opened = [MESSAGES[0], {"role": "assistant", "content": "<think>\nSeven is prime; the next"}]
    closed = [MESSAGES[0], {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\nSeven, and the next"}]

    def ask(messages, echo, **fields):
        body = {
            "model": s.model,
            "messages": messages,
            "max_tokens": 8,
            "stream": stream,
            "echo": echo,
            "seed": 5,
            **fields,
        }
        r = httpx.post(f"{s.base_url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return reasoning_and_content(r, stream)

    reasoning, content = ask(opened, True, **CONTINUE)
    plain_reasoning, plain_content = ask(opened, False, **CONTINUE)
    assert reasoning.lstrip().startswith("Seven is prime; the next") and reasoning.endswith(plain_reasoning)
    assert len(reasoning) > len(plain_reasoning) and content == plain_content == ""
    reasoning, content = ask(closed, True, **CONTINUE)
    plain_reasoning, plain_content = ask(closed, False, **CONTINUE)
    assert reasoning.strip() == "Easy." and plain_reasoning == ""
    assert content.lstrip().startswith("Seven, and the next") and content.endswith(plain_content)
    assert len(content) > len(plain_content) and "</think>" not in content
    # a finished assistant message, then a new turn: its text, as sent, before the new content
    assert ask(MESSAGES, True) == (ask(MESSAGES, False)[0], MESSAGES[1]["content"] + ask(MESSAGES, False)[1])
    # the twin: a final user message has nothing to echo when the assistant's turn is opened; without the opened
    # turn the response's role is the final message's own, and it is echoed (vLLM's rule)
    assert ask(MESSAGES[:1], True) == ask(MESSAGES[:1], False)
    closed = {"add_generation_prompt": False}
    reasoning, content = ask(MESSAGES[:1], True, **closed)
    plain_reasoning, plain_content = ask(MESSAGES[:1], False, **closed)
    assert (reasoning, content) == (plain_reasoning, MESSAGES[0]["content"] + plain_content)


@pytest.fixture(scope="module")
def rewriting_server():
    # a template that does not write the assistant's text as sent: no final message of it can be continued
    template = "{% for m in messages %}{{ m.role }}: {{ m.content | upper }}\n{% endfor %}"
    s = LiveServer(device="cpu", chat_template=template, max_running_requests=2, max_total_token_num=1024)
    yield s
    s.close()


def test_a_template_that_rewrites_the_final_message_gets_400_naming_the_field(rewriting_server):
    s = rewriting_server
    body = {"model": s.model, "messages": MESSAGES, "max_tokens": 3}
    r = httpx.post(f"{s.base_url}/v1/chat/completions", json={**body, **CONTINUE}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "continue_final_message"
    assert "the chat template does not write the final message as sent" in error["message"]
    # the twin: the same conversation with a new turn opened renders
    assert httpx.post(f"{s.base_url}/v1/chat/completions", json=body, timeout=60).status_code == 200


@pytest.mark.parametrize(
    "fields,messages,problem",
    [
        ({"continue_final_message": True}, MESSAGES, "set add_generation_prompt to false"),
        ({"continue_final_message": True, "add_generation_prompt": False}, MESSAGES[:1], "must be the assistant's"),
        (
            {
                "continue_final_message": True,
                "add_generation_prompt": False,
                "response_format": {"type": "json_object"},
            },
            MESSAGES,
            "cannot be combined",
        ),
    ],
    ids=["with-generation-prompt", "last-is-user", "with-a-grammar"],
)
def test_unusable_combinations_are_refused(server, fields, messages, problem):
    body = {"model": server.model, "messages": messages, "max_tokens": 3, **fields}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and problem in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "continue_final_message"
