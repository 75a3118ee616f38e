"""vLLM's chat rendering switches: `continue_final_message` renders the final assistant message left open so the
output continues it (the engine's prompt is exactly the template's rendering of that), `add_generation_prompt:
false` renders the messages without opening a turn; contradictory or unusable combinations get 400 naming the
field."""

from __future__ import annotations

import httpx
import pytest

from unit_tests.server.live_server import tiny_checkpoint_server

MESSAGES = [
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "Seven, and the next one is"},
]


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
