"""vLLM's `structured_outputs` over HTTP (the fake runner behind the tiny Qwen3.5 checkpoint's tokenizer, n-gram
drafts on): json, json_object, regex, choice and a Lark grammar, on /v1/completions and /v1/chat/completions,
sampled at temperature 1 with several sequences. The grammar, not the model, makes every output valid; the twin is
the same request unconstrained, whose text does not match. Bad constraints are 400s naming the field."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from unit_tests.server.live_server import tiny_checkpoint_server

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["alpha", "beta", "gamma delta"]
LARK = 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/'
LARK_TEXT = re.compile(r"\([0-9]{1,3}(,[0-9]{1,3})*\)")
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["name", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server():
    s = tiny_checkpoint_server("qwen3_5", "none")
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _completions(server, client, constraint: dict | None, max_tokens: int = 40) -> list[tuple[str, str]]:
    extra = {"structured_outputs": constraint} if constraint is not None else {}
    out = client.completions.create(
        model=server.model, prompt="Answer:", max_tokens=max_tokens, n=3, temperature=1.0, seed=7, extra_body=extra
    )
    return [(c.text, c.finish_reason) for c in out.choices]


def _chat(server, client, constraint: dict | None, max_tokens: int = 40) -> list[tuple[str, str]]:
    extra = {**NO_THINKING, **({"structured_outputs": constraint} if constraint is not None else {})}
    out = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "answer"}],
        max_tokens=max_tokens,
        n=3,
        temperature=1.0,
        seed=11,
        extra_body=extra,
    )
    return [(c.message.content, c.finish_reason) for c in out.choices]


def _finished(outputs: list[tuple[str, str]]) -> list[str]:
    """The texts, each of which must have ended by the grammar (EOS once complete), not at the length limit."""
    assert all(finish == "stop" for _, finish in outputs), outputs
    return [text for text, _ in outputs]


ROUTES = {"completions": _completions, "chat": _chat}


@pytest.mark.parametrize("route", ROUTES)
def test_regex_outputs_match_and_the_free_twin_does_not(server, client, route):
    assert all(re.fullmatch(REGEX, t) for t in _finished(ROUTES[route](server, client, {"regex": REGEX})))
    assert not all(re.fullmatch(REGEX, t) for t, _ in ROUTES[route](server, client, None, max_tokens=8))


@pytest.mark.parametrize("route", ROUTES)
def test_choice_outputs_are_one_of_the_choices(server, client, route):
    assert all(t in CHOICES for t in _finished(ROUTES[route](server, client, {"choice": CHOICES})))
    assert not all(t in CHOICES for t, _ in ROUTES[route](server, client, None, max_tokens=4))


def _favouring(server, client, token: int, extra: dict, max_tokens: int, n: int) -> list[str]:
    """Completions sampled at temperature 1 with `token` forced (logit_bias) wherever the constraint in `extra`
    allows it."""
    out = client.completions.create(
        model=server.model,
        prompt="Answer:",
        max_tokens=max_tokens,
        n=n,
        temperature=1.0,
        seed=3,
        logit_bias={str(token): 100},
        extra_body=extra,
    )
    return [c.text for c in out.choices]


def test_a_choice_spelling_an_added_token_is_written_with_it(server, client):
    """A choice whose text holds `</tool_call>` (one of the vocabulary's added tokens): once "a" is written the rest
    is forced, and the forced text is written with that token, which the grammar accepts (a quoted text would let
    the mask offer the token and the matcher refuse it: a 500)."""
    (a,) = server.tokenizer.encode_rendered("a")
    texts = _favouring(server, client, a, {"structured_outputs": {"choice": ["a</tool_call>b", "c"]}}, 16, n=2)
    assert texts == ["a</tool_call>b"] * 2


@pytest.mark.parametrize("route", ROUTES)
def test_lark_grammar_outputs_are_in_its_language(server, client, route):
    outputs = ROUTES[route](server, client, {"grammar": LARK}, max_tokens=64)
    assert all(LARK_TEXT.fullmatch(t) for t in _finished(outputs))


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("form", ["object", "text"])
def test_json_schema_and_json_object_outputs_parse(server, client, route, form):
    """The schema as an object or as its JSON text (vLLM takes both)."""
    schema = SCHEMA if form == "object" else json.dumps(SCHEMA)
    for text in _finished(ROUTES[route](server, client, {"json": schema}, max_tokens=64)):
        value = json.loads(text)
        assert set(value) == {"name", "n"} and 0 <= value["n"] <= 999 and len(value["name"]) <= 8
    # any object is unbounded: a random model may still be inside one at the length limit, where the text so far
    # is a JSON object's beginning
    for text, finish in ROUTES[route](server, client, {"json_object": True}, max_tokens=96):
        assert text.startswith("{")
        if finish == "stop":
            assert isinstance(json.loads(text), dict)


CALL_HEAD, CALL_END = '<tool_call>\n{"name": "lookup", "arguments": ', "}\n</tool_call>"
TOOL_TAG = {
    "type": "structural_tag",
    "structures": [{"begin": CALL_HEAD, "schema": SCHEMA, "end": CALL_END}],
    "triggers": ["<tool_call>"],
}


def _calls(text: str) -> list[str]:
    """The complete calls of `text`, which must be nothing but calls (the last one may be cut by the length limit),
    each checked against the structure; returns their arguments' texts."""
    parts = text.split("<tool_call>")
    assert parts[0] == "" and len(parts) > 2, text
    arguments = []
    for part in parts[1:-1]:
        call = "<tool_call>" + part
        assert call.startswith(CALL_HEAD) and call.endswith(CALL_END), call
        arguments.append(call[len(CALL_HEAD) : -len(CALL_END)])
    return arguments


@pytest.mark.parametrize("form", ["structured_outputs", "structured_outputs_text", "response_format"])
def test_structural_tag_constrains_each_call_the_trigger_starts(server, client, form):
    """vLLM's structural tag, with the `<tool_call>` token forced wherever the text is free (logit_bias): every call
    that follows it is the structure's head, arguments valid for the schema and its end. Twin: the same biased
    request without the tag writes calls whose arguments are not the schema's."""
    tool_call = server.tokenizer.encode_rendered("<tool_call>")
    assert len(tool_call) == 1
    constraint = {
        "structured_outputs": {"structured_outputs": {"structural_tag": TOOL_TAG}},
        "structured_outputs_text": {"structured_outputs": {"structural_tag": json.dumps(TOOL_TAG)}},
        "response_format": {"response_format": TOOL_TAG},
    }[form]

    def texts(extra: dict) -> list[str]:
        return _favouring(server, client, tool_call[0], extra, 120, n=3)

    for text in texts(constraint):
        for arguments in _calls(text):
            value = json.loads(arguments)
            assert set(value) == {"name", "n"} and 0 <= value["n"] <= 999 and len(value["name"]) <= 8
    free = [t.split("<tool_call>") for t in texts({})]
    assert not any(part.startswith(CALL_HEAD[len("<tool_call>") :]) for parts in free for part in parts[1:])


def test_completions_take_response_format_as_chat_does(server, client):
    """vLLM's /v1/completions takes response_format too: json_schema outputs parse against the schema, json_object
    outputs open an object; `text` (the twin) leaves the output free, as no response_format does."""

    def texts(fmt: dict | None, max_tokens: int = 64) -> list[tuple[str, str]]:
        extra = {"response_format": fmt} if fmt is not None else {}
        out = client.completions.create(
            model=server.model, prompt="Answer:", max_tokens=max_tokens, n=3, temperature=1.0, seed=5, extra_body=extra
        )
        return [(c.text, c.finish_reason) for c in out.choices]

    schema_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    for text in _finished(texts(schema_format)):
        value = json.loads(text)
        assert set(value) == {"name", "n"} and 0 <= value["n"] <= 999
    assert all(text.startswith("{") for text, _ in texts({"type": "json_object"}))
    assert texts({"type": "text"}, 8) == texts(None, 8)
    assert not all(text.startswith("{") for text, _ in texts(None, 8))


def test_completions_echo_logprobs_and_stream_beside_a_constraint(server, client):
    """Echo, logprobs and streaming beside structured_outputs: each choice is the prompt, then text the regex
    matches whole, with a log-probability for every prompt and output token; the stream carries the same texts as
    the seeded plain response. Twin: unconstrained, the text after the prompt does not match."""
    kwargs = dict(model=server.model, prompt="Answer:", max_tokens=40, n=2, temperature=1.0, seed=7, echo=True)

    def texts(extra: dict) -> list[str]:
        r = client.completions.create(**kwargs, logprobs=1, extra_body=extra)
        for c in r.choices:
            assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) > r.usage.prompt_tokens
        streamed = {}
        for chunk in client.completions.create(**kwargs, stream=True, extra_body=extra):
            for c in chunk.choices:
                streamed[c.index] = streamed.get(c.index, "") + c.text
        assert [streamed[i] for i in range(2)] == [c.text for c in r.choices]
        assert all(c.text.startswith("Answer:") for c in r.choices)
        return [c.text[len("Answer:") :] for c in r.choices]

    assert all(re.fullmatch(REGEX, t) for t in texts({"structured_outputs": {"regex": REGEX}}))
    assert not all(re.fullmatch(REGEX, t) for t in texts({}))


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/{path}", json={"model": server.model, **body}, timeout=30)


CMPL = {"prompt": "x", "max_tokens": 4}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BAD = [
    ("completions", CMPL, {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ("completions", CMPL, {"structured_outputs": {}}, "structured_outputs"),
    ("completions", CMPL, {"structured_outputs": {"json_object": False}}, "structured_outputs"),
    ("completions", CMPL, {"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
    ("completions", CMPL, {"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs.grammar"),
    ("completions", CMPL, {"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ("completions", CMPL, {"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice.1"),
    ("completions", CMPL, {"structured_outputs": {"json": {"type": "objectx"}}}, "structured_outputs.json"),
    ("completions", CMPL, {"structured_outputs": {"json": json.dumps(SCHEMA)[:-1]}}, "structured_outputs.json"),
    # a key of vLLM's this server does not apply is refused, not ignored
    (
        "completions",
        CMPL,
        {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
        "structured_outputs.whitespace_pattern",
    ),
    ("completions", CMPL, {"structured_outputs": {"regex": "a"}, "ignore_eos": True}, "ignore_eos"),
    (
        "chat/completions",
        CHAT,
        {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
        "structured_outputs",
    ),
    (
        "completions",
        CMPL,
        {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
        "structured_outputs",
    ),
    ("completions", CMPL, {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ("completions", CMPL, {"response_format": {"type": "structural_tag"}}, "response_format"),
    (
        "completions",
        CMPL,
        {"structured_outputs": {"structural_tag": {**TOOL_TAG, "triggers": ["<function="]}}},
        "structured_outputs.structural_tag",
    ),
    (
        "completions",
        CMPL,
        {"structured_outputs": {"structural_tag": {"type": "structural_tag", "format": {"type": "any_text"}}}},
        "structured_outputs.structural_tag",
    ),
    ("completions", CMPL, {"structured_outputs": {"structural_tag": "{not json"}}, "structured_outputs.structural_tag"),
    ("completions", CMPL, {"structural_tag": json.dumps(TOOL_TAG)}, "structural_tag"),
    (
        "completions",
        CMPL,
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
        "response_format.json_schema.schema",
    ),
]


@pytest.mark.parametrize("path, base, bad, param", BAD, ids=[f"{b[0][:4]}-{json.dumps(b[2])[:48]}" for b in BAD])
def test_bad_constraints_are_400_naming_the_field(server, path, base, bad, param):
    r = _post(server, path, {**base, **bad})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    # the twin: the same body with a valid constraint is served
    assert _post(server, path, {**base, "structured_outputs": {"regex": "[ab]{1,3}"}}).status_code == 200
