"""Output parsers (lightllm.server.http.parsers): known texts parse to known calls, and every streaming parser
gives the same result however the text is cut (speculation delivers several tokens per delta)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightllm.server.http.parsers import (
    KimiToolParser,
    OutputParser,
    ParsedOutput,
    Qwen3JsonToolParser,
    Qwen3XmlToolParser,
    ReasoningParser,
    ToolCall,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "opts": {"type": "object"}},
            },
        },
    }
]


def fixed_id() -> str:
    return "call_x"


def json_call(name: str, args: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


def json_string_call(name: str, args: dict) -> str:
    """A call whose arguments are written as a JSON string holding the object (some models do this)."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(json.dumps(args))}}}\n</tool_call>'


def xml_call(name: str, args: dict) -> str:
    params = "".join(
        f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n" for k, v in args.items()
    )
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def kimi_calls(calls: list[tuple[str, dict]], singular: bool = False) -> str:
    section = "tool_call_section" if singular else "tool_calls_section"
    body = "".join(
        f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{json.dumps(a)}<|tool_call_end|>"
        for i, (n, a) in enumerate(calls)
    )
    return f"<|{section}_begin|>{body}<|{section}_end|>"


FORMATS = {
    "qwen3_json": (lambda: Qwen3JsonToolParser(fixed_id), lambda cs: "\n".join(json_call(n, a) for n, a in cs)),
    "qwen3_json_string": (
        lambda: Qwen3JsonToolParser(fixed_id),
        lambda cs: "\n".join(json_string_call(n, a) for n, a in cs),
    ),
    "qwen3_xml": (lambda: Qwen3XmlToolParser(TOOLS, fixed_id), lambda cs: "\n".join(xml_call(n, a) for n, a in cs)),
    "kimi": (lambda: KimiToolParser(fixed_id), kimi_calls),
    "kimi_singular": (lambda: KimiToolParser(fixed_id), lambda cs: kimi_calls(cs, singular=True)),
}


def streamed(parser, text: str, cuts: list[int]) -> ParsedOutput:
    deltas, i = [], 0
    for size in cuts:
        deltas.append(parser.feed(text[i : i + size]))
        i += size
    deltas += [parser.feed(text[i:]), parser.finish()]
    return ParsedOutput.merge(deltas)


def kimi_id(name: str, i: int) -> str:
    return f"functions.{name}:{i}"


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_known_calls_parse(fmt):
    make, render = FORMATS[fmt]
    calls = [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Oslo", "opts": {"a": [1, 2]}})]
    out = make().parse("Checking both. " + render(calls))
    assert out.content == "Checking both. "
    assert [c.name for c in out.tool_calls] == ["get_weather", "get_weather"]
    assert [json.loads(c.arguments) for c in out.tool_calls] == [a for _, a in calls]
    ids = [kimi_id(n, i) for i, (n, _) in enumerate(calls)] if fmt.startswith("kimi") else ["call_x", "call_x"]
    assert [c.id for c in out.tool_calls] == ids


@pytest.mark.parametrize("fmt", ["qwen3_json", "qwen3_xml"])
@pytest.mark.parametrize(
    "prose",
    [
        "Wrap calls in <tool_call> tags.",
        "a <tool_call>\nnot json</tool_call> b",
        "<tool_call>",
        "x <tool_call> <tool_call>",
    ],
)
def test_literal_tag_in_prose_is_content(fmt, prose):
    make, _ = FORMATS[fmt]
    out = make().parse(prose)
    assert (out.content, out.tool_calls) == (prose, [])
    # streamed one character at a time, the prose comes out before the text ends (the stream does not freeze)
    parser, seen = make(), ""
    for ch in prose + " and more text after it":
        seen += parser.feed(ch).content
    assert seen.startswith(prose)


def test_kimi_singular_section_spelling():
    calls = [("get_weather", {"city": "Rome"})]
    for singular in (False, True):
        out = KimiToolParser(fixed_id).parse(kimi_calls(calls, singular))
        assert out.tool_calls == [ToolCall("functions.get_weather:0", "get_weather", '{"city": "Rome"}')]


def test_broken_call_is_not_a_call():
    # the twin of test_known_calls_parse: the same block without its function tag is prose
    text = xml_call("get_weather", {"city": "Paris"}).replace("<function=get_weather>", "function get_weather")
    out = Qwen3XmlToolParser(TOOLS, fixed_id).parse(text)
    assert out.tool_calls == [] and out.content == text


def test_xml_values_follow_the_schema():
    out = Qwen3XmlToolParser(TOOLS, fixed_id).parse(xml_call("get_weather", {"city": "42", "days": 7}))
    assert json.loads(out.tool_calls[0].arguments) == {"city": "42", "days": 7}


@pytest.mark.parametrize("starts_in_reasoning", [False, True])
def test_reasoning_split(starts_in_reasoning):
    text = ("" if starts_in_reasoning else "<think>") + "step 1\nstep 2</think>\n\nThe answer is 4."
    out = OutputParser(ReasoningParser(starts_in_reasoning), None).parse(text)
    assert (out.reasoning, out.content) == ("step 1\nstep 2", "The answer is 4.")
    unclosed = OutputParser(ReasoningParser(starts_in_reasoning), None).parse(text.split("</think>")[0])
    assert (unclosed.reasoning, unclosed.content) == ("step 1\nstep 2", "")
    # without a block there is no reasoning
    plain = OutputParser(ReasoningParser(False), None).parse("The answer is 4.")
    assert (plain.reasoning, plain.content) == ("", "The answer is 4.")


def test_tool_call_inside_reasoning_is_not_a_call():
    text = "<think>maybe " + json_call("get_weather", {"city": "X"}) + "</think>\n\nNo call."
    out = OutputParser(ReasoningParser(False), Qwen3JsonToolParser(fixed_id)).parse(text)
    assert out.tool_calls == [] and out.content == "No call." and "<tool_call>" in out.reasoning


PROSE = st.sampled_from(
    ["Hello", " world", "\n", "Use <tool_call> here", "<tool", "a < b > c", "}", "{", "<think>", "</think>", " "]
)
# a nested object whose strings hold the braces and quotes the JSON parsers count
NESTED = st.fixed_dictionaries(
    {"a": st.lists(st.integers(0, 9), max_size=3), "b": st.fixed_dictionaries({"c": st.sampled_from(["x", '}{"'])})}
)
ARGS = st.fixed_dictionaries(
    {"city": st.sampled_from(["Paris", "Lo}ndon", "São Paulo", 'a"b', "a < b\nc"]), "days": st.integers(0, 99)},
    optional={"opts": NESTED},
)


@st.composite
def outputs(draw, fmt: str):
    """Reasoning, prose with stray markers, and calls, in random order."""
    _, render = FORMATS[fmt]
    parts = []
    if draw(st.booleans()):
        parts.append("<think>" + draw(PROSE) + draw(PROSE) + "</think>\n\n")
    for _ in range(draw(st.integers(0, 4))):
        if draw(st.booleans()):
            parts.append(draw(PROSE))
        else:
            calls = draw(st.lists(st.tuples(st.sampled_from(["get_weather", "f"]), ARGS), min_size=1, max_size=2))
            parts.append(render(calls))
    text = "".join(parts)
    if draw(st.booleans()):
        # the stream ends anywhere (EOS or max_tokens inside a call, a marker or the reasoning)
        text = text[: draw(st.integers(0, len(text)))]
    cuts = draw(st.lists(st.integers(1, 24), max_size=len(text)))
    return text, cuts


@pytest.mark.parametrize("fmt", list(FORMATS))
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_stream_equals_whole_parse(fmt, data):
    text, cuts = data.draw(outputs(fmt))
    make, _ = FORMATS[fmt]
    whole = OutputParser(ReasoningParser(False), make()).parse(text)
    assert streamed(OutputParser(ReasoningParser(False), make()), text, cuts) == whole


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_call_split_across_chunks_and_think_mid_chunk(fmt):
    make, render = FORMATS[fmt]
    text = "plan</think>\n\nOK " + render([("get_weather", {"city": "Paris", "days": 2})])
    whole = OutputParser(ReasoningParser(True), make()).parse(text)
    assert whole.reasoning == "plan" and whole.content == "OK " and len(whole.tool_calls) == 1
    for cut in range(1, len(text)):
        # two chunks: `</think>` or the call's markers split at every position
        assert streamed(OutputParser(ReasoningParser(True), make()), text, [cut]) == whole
    # one character at a time: OpenAI's delta shape, id and name first, then argument fragments only
    parser = OutputParser(ReasoningParser(True), make())
    deltas = [t for ch in text for t in parser.feed(ch).tool_calls] + parser.finish().tool_calls
    assert deltas[0].id and deltas[0].name == "get_weather" and not deltas[0].arguments
    assert all(d.id is None and d.name is None and d.arguments for d in deltas[1:])
    # arguments written as a JSON string are sent whole once the block closes; the others stream in pieces
    assert len(deltas) == 2 if fmt == "qwen3_json_string" else len(deltas) > 2


@pytest.mark.parametrize("starts_in_reasoning", [False, True])
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_verbatim_reasoning_keeps_the_text(starts_in_reasoning, data):
    """Reasoning left in content (no reasoning parser) comes back exactly as written, calls aside."""
    text, cuts = data.draw(outputs("qwen3_json"))
    parser = OutputParser(ReasoningParser(starts_in_reasoning, verbatim=True), None, reasoning_as_content=True)
    out = streamed(parser, text, cuts)
    assert (out.content, out.reasoning, out.tool_calls) == (text, "", [])


def test_call_while_thinking_is_not_a_call_with_reasoning_in_content():
    call = json_call("get_weather", {"city": "X"})
    text = "maybe " + call + "</think>\n\nNo. " + call
    parser = OutputParser(
        ReasoningParser(True, verbatim=True), Qwen3JsonToolParser(fixed_id), reasoning_as_content=True
    )
    out = parser.parse(text)
    assert out.content == "maybe " + call + "</think>\n\nNo. " and out.reasoning == ""
    assert [c.name for c in out.tool_calls] == ["get_weather"]


CUTS = st.lists(st.integers(1, 16), max_size=80)
NESTED_ARGS = {"code": 'print("}")\nx = {"a": 1}', "opts": {"a": [1, 2], "b": {"c": "é\\n"}}}


@settings(max_examples=100, deadline=None)
@given(cuts=CUTS)
def test_json_string_arguments_are_the_decoded_object(cuts):
    text = "Calling. " + json_string_call("run", NESTED_ARGS) + " done"
    whole = Qwen3JsonToolParser(fixed_id).parse(text)
    # the string the model wrote holds the object as json.dumps writes it: that text is the arguments
    want = ParsedOutput("Calling.  done", "", [ToolCall("call_x", "run", json.dumps(NESTED_ARGS))])
    assert whole == want
    assert streamed(Qwen3JsonToolParser(fixed_id), text, cuts) == whole


def test_json_string_arguments_twins():
    text = json_string_call("run", NESTED_ARGS)
    (call,) = Qwen3JsonToolParser(fixed_id).parse(text).tool_calls
    # the string literal itself (a JSON string, not an object) is not the arguments
    assert call.arguments != json.dumps(json.dumps(NESTED_ARGS)) and isinstance(json.loads(call.arguments), dict)
    # nothing of a string is sent before the block closes (its decoded text is not known until then)
    parser = Qwen3JsonToolParser(fixed_id)
    head = parser.feed(text[: text.index("</tool_call>")])
    assert [(d.name, d.arguments) for d in head.tool_calls] == [("run", "")]
    assert [d.arguments for d in parser.feed("</tool_call>").tool_calls] == [json.dumps(NESTED_ARGS)]
    # a string followed by more keys, or cut short, is not a string's arguments: it is kept as written
    extra = '<tool_call>\n{"name": "run", "arguments": "{}", "x": 1}\n</tool_call>'
    assert Qwen3JsonToolParser(fixed_id).parse(extra).tool_calls[0].arguments == '"{}", "x": 1'
    cut = text[: text.index("opts")]
    assert Qwen3JsonToolParser(fixed_id).parse(cut).tool_calls[0].arguments == cut.split('"arguments": ')[1]


TYPED_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "typed",
            "parameters": {
                "type": "object",
                "properties": {
                    "n": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                    "m": {"type": ["integer", "null"]},
                    "x": {"oneOf": [{"type": "number"}, {"type": "boolean"}]},
                    "p": {"$ref": "#/$defs/Point"},
                    "q": {"$ref": "#/definitions/Flag"},
                    "s": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                    "e": {"enum": [1, 2, "three"]},
                    "c": {"type": "string"},
                },
                "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}}}},
                "definitions": {"Flag": {"type": "boolean"}},
            },
        },
    }
]
# (parameter, the text the model writes, the value the arguments hold)
TYPED = [
    ("n", "3", 3),
    ("n", "null", None),
    ("m", "7", 7),
    ("x", "2.5", 2.5),
    ("x", "true", True),
    ("p", '{"x": 1}', {"x": 1}),
    # Qwen3.5's released template writes scalars the Python way
    ("q", "False", False),
    ("s", "hello", "hello"),
    ("s", "None", None),
    ("e", "2", 2),
    ("e", "three", "three"),
]
# text that is none of the parameter's types stays the string written
UNTYPED = [
    ("n", "abc"),
    ("n", "2.5"),
    ("m", "true"),
    ("x", "null"),
    ("p", "[1, 2]"),
    ("q", "yes"),
    ("s", '"q"'),
    ("e", "[2]"),
    ("c", "3"),
]


def _typed_calls(cases: list[tuple[str, str]]) -> str:
    return "\n".join(xml_call("typed", {param: text}) for param, text in cases)


def _typed_output(cases: list[tuple[str, object]]) -> ParsedOutput:
    calls = [ToolCall("call_x", "typed", json.dumps({p: v}, ensure_ascii=False)) for p, v in cases]
    return ParsedOutput(tool_calls=calls)


@settings(max_examples=100, deadline=None)
@given(cuts=CUTS)
def test_xml_values_take_the_schema_types(cuts):
    text = _typed_calls([(p, t) for p, t, _ in TYPED])
    whole = Qwen3XmlToolParser(TYPED_TOOLS, fixed_id).parse(text)
    assert whole == _typed_output([(p, v) for p, _, v in TYPED])
    assert streamed(Qwen3XmlToolParser(TYPED_TOOLS, fixed_id), text, cuts) == whole
    # twin: read as plain strings (a schema without `type` taken for a string schema), the calls differ
    assert whole != _typed_output([(p, t) for p, t, _ in TYPED])


@settings(max_examples=100, deadline=None)
@given(cuts=CUTS)
def test_xml_values_of_another_type_stay_text(cuts):
    text = _typed_calls(UNTYPED)
    whole = Qwen3XmlToolParser(TYPED_TOOLS, fixed_id).parse(text)
    assert whole == _typed_output(UNTYPED)
    assert streamed(Qwen3XmlToolParser(TYPED_TOOLS, fixed_id), text, cuts) == whole


def test_xml_schemas_that_never_resolve_read_as_text():
    """A `$ref` cycle and a chain branching past the resolver's bounds name no types (their values stay text,
    at once); the same chain entered near its end resolves to its integer."""
    defs = {f"D{i}": {"anyOf": [{"$ref": f"#/$defs/D{i + 1}"}] * 2} for i in range(60)}
    defs |= {"D60": {"type": "integer"}, "Loop": {"$ref": "#/$defs/Loop"}}
    props = {"loop": {"$ref": "#/$defs/Loop"}, "wide": {"$ref": "#/$defs/D0"}, "near": {"$ref": "#/$defs/D58"}}
    tools = [{"type": "function", "function": {"name": "g", "parameters": {"properties": props, "$defs": defs}}}]
    out = Qwen3XmlToolParser(tools, fixed_id).parse(xml_call("g", {"loop": "3", "wide": "3", "near": "3"}))
    assert json.loads(out.tool_calls[0].arguments) == {"loop": "3", "wide": "3", "near": 3}


# string values holding newlines, `<` and pieces of the closing tags
TEXT_VALUES = ["a < b\nc", "if a<b:\n    return '</para'\n", "\n", "", "x\n</parameter", "<b>bold</b>\n\n"]


@settings(max_examples=100, deadline=None)
@given(cuts=CUTS)
def test_xml_string_values_keep_newlines_and_angle_brackets(cuts):
    cases = [("city", v) for v in TEXT_VALUES]
    text = "\n".join(xml_call("get_weather", {p: v}) for p, v in cases)
    whole = Qwen3XmlToolParser(TOOLS, fixed_id).parse(text)
    want = [ToolCall("call_x", "get_weather", json.dumps({p: v}, ensure_ascii=False)) for p, v in cases]
    assert whole == ParsedOutput(tool_calls=want)
    assert streamed(Qwen3XmlToolParser(TOOLS, fixed_id), text, cuts) == whole
    # twin: a value holding a whole closing tag ends there (the forced grammar refuses such a value)
    cut = Qwen3XmlToolParser(TOOLS, fixed_id).parse(xml_call("get_weather", {"city": "a</parameter>b"}))
    assert json.loads(cut.tool_calls[0].arguments) != {"city": "a</parameter>b"}
