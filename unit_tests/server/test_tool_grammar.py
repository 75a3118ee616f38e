"""The grammar of a forced Qwen3.5 call (server/http/structured.py, built as a request builds it) on the tiny
checkpoint's vocabulary, fed token by token through llguidance's matcher: the chat template's rendering of a call
is accepted and the parser reads it back as the call's arguments; string values may hold newlines and `<`, while
malformed closes, values the parser would cut short and values of another type are refused."""

from __future__ import annotations

import json

import pytest

from lightllm.server.grammar_vocab import load_grammar_vocabulary
from lightllm.server.http.parsers import Qwen3XmlToolParser
from lightllm.server.http.protocol import ChatCompletionRequest
from lightllm.server.http.structured import request_grammar
from lightllm.server.model_info import read_model_info
from lightllm.server.tokenizer import Tokenizer
from lightllm.tools.make_tiny_model import tiny_model_dir

POINT = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "edit",
            "parameters": {
                "type": "object",
                "properties": {
                    "code": {"type": "string"},
                    "n": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                    "p": {"$ref": "#/$defs/Point"},
                },
                "required": ["code", "n"],
                "$defs": {"Point": POINT},
            },
        },
    }
]


@pytest.fixture(scope="module")
def setup():
    folder = str(tiny_model_dir("qwen3_5"))
    info = read_model_info(folder)
    tok = Tokenizer(info)
    vocabulary = load_grammar_vocabulary(folder, info.vocab_size, tok.eos_token_ids)
    body = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "edit"}],
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "edit"}},
        }
    )

    def token_of(text: str) -> int | None:
        ids = tok.encode_rendered(text)
        return ids[0] if len(ids) == 1 else None

    return tok, vocabulary, request_grammar(body, "qwen3_xml", token_of, tok.whole_tokens)


def _accepts(setup, text: str) -> bool:
    """Whether the grammar takes `text`'s tokens one by one and may then end."""
    from llguidance import LLMatcher

    tok, vocabulary, grammar = setup
    matcher = LLMatcher(vocabulary, grammar, log_level=0)
    return all(matcher.consume_token(t) for t in tok.encode_rendered(text)) and matcher.is_accepting()


def _rendered_call(tok, args: dict) -> str:
    """The call as the chat template writes it in the history (the reference of what the model writes)."""
    call = {"id": "c", "type": "function", "function": {"name": "edit", "arguments": args}}
    messages = [{"role": "user", "content": "edit"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    text = tok.render_chat(messages, tools=TOOLS, enable_thinking=False)
    return text[text.index("<tool_call>") : text.index("</tool_call>") + len("</tool_call>")]


@pytest.mark.parametrize(
    "args",
    [
        {"code": "a < b\nc", "n": 3},
        {"code": "def f(a, b):\n    return a<b  # <x> and </y>\n", "n": None, "p": {"x": 1}},
        {"code": "", "n": 0},
        {"code": "\n", "n": -2},
    ],
)
def test_forced_call_takes_multiline_text_and_schema_types(setup, args):
    tok = setup[0]
    text = _rendered_call(tok, args)
    assert _accepts(setup, text), text
    (call,) = Qwen3XmlToolParser(TOOLS).parse(text).tool_calls
    assert (call.name, json.loads(call.arguments)) == ("edit", args)


@pytest.mark.parametrize(
    "broken",
    [
        # the close without the newline before it, or without the newline after it
        lambda t: t.replace("c\n</parameter>\n", "c</parameter>\n"),
        lambda t: t.replace("c\n</parameter>\n", "c\n</parameter> "),
        # a value holding a tag the parser ends a value at
        lambda t: t.replace("a < b\nc", "a </function> b"),
        lambda t: t.replace("a < b\nc", "a <parameter=n> b"),
        # a value that is not the parameter's type, a required parameter left out, a call left open
        lambda t: t.replace("\n3\n", "\nthree\n"),
        lambda t: t.replace("<parameter=n>\n3\n</parameter>\n", ""),
        lambda t: t[: t.index("</function>")],
    ],
)
def test_forced_call_refuses_a_malformed_call(setup, broken):
    """Twin of the test above: the same call, broken in one place, is refused."""
    text = _rendered_call(setup[0], {"code": "a < b\nc", "n": 3})
    assert _accepts(setup, text) and broken(text) != text
    assert not _accepts(setup, broken(text))
