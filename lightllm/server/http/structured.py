"""Grammars for constrained decoding (llguidance): `response_format` (json_object, json_schema), a tool call
forced by `tool_choice` (required, or a named function), written in the model family's tool-call format, and
vLLM's `structured_outputs` (json, json_object, regex, choice, grammar, structural_tag) on both routes.

Building and validating a grammar is CPU work on a client's schema: the route runs it in the front-end's pool.
A schema the compiler refuses is a 400 naming the problem.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping

import msgspec
from pydantic import ValidationError

from lightllm.engine.sampling_params import SamplingParams, StructuredOutputsParams
from lightllm.server.http.chat_messages import NamedToolChoice, ToolDef
from lightllm.server.http.output_formats import ResponseFormat, StructuralTag, StructuredOutputs
from lightllm.server.http.parsers.qwen3_xml import schema_types
from lightllm.server.http.protocol import ChatCompletionRequest, CompletionRequest
from lightllm.server.http.schema_base import RequestError

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_OBJECT = {"type": "object"}
# the texts a tokenizer reads as one token wherever they occur (its added and special tokens) -> their ids: a
# grammar names them as tokens, never as text the model could spell from pieces
WholeTokens = Mapping[str, int]
# JSON as models (and json.dumps) write it: one space after ':' and ',', no other whitespace; flexible whitespace
# would let a model pad forever
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_schema_grammar(schema: dict | str) -> str:
    """llguidance grammar of the JSON values `schema` (an object, or its JSON text) admits (raises ValueError when
    it is not an object)."""
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)


def _lark_json(schema: dict) -> str:
    """A Lark rule body embedding `schema` with the same JSON layout."""
    return "%json" + json.dumps({**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}})


def _lark_str(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _arguments_schema(tool: ToolDef) -> dict:
    """The arguments' schema; keys it does not name are refused unless it allows them (a forced call should not
    invent parameters)."""
    schema = tool.function.parameters or _OBJECT
    return {"additionalProperties": False, **schema}


class _Markers:
    """A format's markers in Lark: a marker that is one token of the vocabulary (`<tool_call>` is an added token)
    must be that token, `<[id]>`; the model cannot spell it from pieces."""

    def __init__(self, token_of: Callable[[str], int | None]):
        self.token_of = token_of

    def __call__(self, *parts: str) -> str:
        """`parts` alternate text and markers: text, marker, text, ... (empty text is skipped)."""
        out = []
        for k, part in enumerate(parts):
            if not part:
                continue
            token = self.token_of(part) if k % 2 else None
            out.append(f"<[{token}]>" if token is not None else _lark_str(part))
        return " ".join(out)


def _json_call(i: int, tool: ToolDef, m: _Markers) -> list[str]:
    head = m("", "<tool_call>", '\n{"name": "' + tool.function.name + '", "arguments": ')
    return [
        f"call_{i}: {head} args_{i} " + m("}\n", "</tool_call>"),
        f"args_{i}: {_lark_json(_arguments_schema(tool))}",
    ]


# a string parameter's value: any text up to the first line that closes it (`suffix` makes the terminal lazy, so it
# ends there). The parser ends a value at the first `</parameter>`, `<parameter=`, `</function>` or `</tool_call>`,
# so a value holding one of them is refused here rather than read back cut short.
_XML_TEXT = [
    'xml_text[suffix="\\n</parameter>\\n"]: XML_TEXT',
    "XML_TEXT: /(?s:.*)/ & ~/(?s:.*)(<\\/parameter>|<parameter=|<\\/function>|<\\/tool_call>)(?s:.*)/",
]


def _xml_call(i: int, tool: ToolDef, m: _Markers) -> list[str]:
    schema = _arguments_schema(tool)
    props = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    # a parameter's schema embedded alone still resolves `$ref`s into the definitions beside it
    defs = {key: schema[key] for key in ("$defs", "definitions") if key in schema}
    close = _lark_str("\n</parameter>\n")
    parts, rules = [], []
    for k, (name, prop) in enumerate(props.items()):
        prop = prop if isinstance(prop, dict) else {}
        head = _lark_str(f"<parameter={name}>\n")
        literals = prop.get("enum") if isinstance(prop.get("enum"), list) else None
        if "const" in prop:
            literals = [prop["const"]]
        types = schema_types(prop, schema)
        if literals:
            # values are written as the template writes them: strings bare, others as JSON
            values = (v if isinstance(v, str) else json.dumps(v, ensure_ascii=False) for v in literals)
            rules.append(f"param_{i}_{k}: {head} ({' | '.join(_lark_str(v) for v in values)}) {close}")
        elif not types or "string" in types:
            # text, which the parser reads as one of the schema's other types where it is one
            rules.append(f"param_{i}_{k}: {head} xml_text")
        else:
            rules.append(f"value_{i}_{k}: {_lark_json({**defs, **prop})}")
            rules.append(f"param_{i}_{k}: {head} value_{i}_{k} {close}")
        parts.append(f"param_{i}_{k}" + ("" if name in required else "?"))
    head = m("", "<tool_call>", f"\n<function={tool.function.name}>\n")
    tail = m("</function>\n", "</tool_call>")
    return [f"call_{i}: {head} {' '.join(parts)} {tail}", *rules]


def _kimi_call(i: int, tool: ToolDef, m: _Markers) -> list[str]:
    head = m("", "<|tool_call_begin|>", f"functions.{tool.function.name}:")
    return [
        f"call_{i}: {head} INDEX {m('', '<|tool_call_argument_begin|>')} args_{i} {m('', '<|tool_call_end|>')}",
        f"args_{i}: {_lark_json(_arguments_schema(tool))}",
    ]


_CALL_RULES = {"qwen3_json": _json_call, "qwen3_xml": _xml_call, "kimi": _kimi_call}


def tool_call_lark(
    parser: str, tools: list[ToolDef], choice, parallel: bool, token_of: Callable[[str], int | None]
) -> str:
    """A Lark grammar whose sentences are one call (a named function's, or any tool's), or with `parallel` one or
    more calls, in `parser`'s format."""
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t.function.name == choice.function.name]
    m = _Markers(token_of)
    rules: list[str] = []
    for i, tool in enumerate(tools):
        rules += _CALL_RULES[parser](i, tool, m)
    alternatives = " | ".join(f"call_{i}" for i in range(len(tools)))
    many = parallel and not isinstance(choice, NamedToolChoice)
    if parser == "kimi":
        body = "call+" if many else "call"
        start = f"start: {m('', '<|tool_calls_section_begin|>')} {body} {m('', '<|tool_calls_section_end|>')}"
    else:
        start = 'start: call ("\\n" call)*' if many else "start: call"
    terminals = _XML_TEXT if parser == "qwen3_xml" else ["INDEX: /[0-9]{1,3}/"]
    return "\n".join([start, f"call: {alternatives}", *rules, *terminals]) + "\n"


def _validated(grammar: str, field: str) -> str:
    from llguidance import LLMatcher

    problem = LLMatcher.validate_grammar(grammar)
    if problem:
        raise RequestError(field, f"{field}: cannot be enforced: {problem}")
    return grammar


def structured_outputs_grammar(so: StructuredOutputs, whole_tokens: WholeTokens) -> str:
    """The llguidance grammar of a `structured_outputs` constraint (the request checked it names exactly one);
    raises RequestError naming the constraint when it cannot be compiled."""
    (kind,) = so.kinds()
    return constraint_grammar(kind, so.json_ if kind == "json" else getattr(so, kind), whole_tokens)


def offline_grammar(so: StructuredOutputsParams, whole_tokens: WholeTokens) -> str:
    """The same for the offline `LLM`'s StructuredOutputsParams (validated to name exactly one constraint)."""
    return constraint_grammar(*so.constraint(), whole_tokens)


def constraint_grammar(kind: str, value, whole_tokens: WholeTokens) -> str:
    """The grammar of one `structured_outputs` constraint: `kind` json (a schema), json_object, regex, choice (a
    list of strings), grammar (Lark) or structural_tag (an object or its JSON text; `whole_tokens` names its
    tokens). RequestError naming `structured_outputs.<kind>` when it cannot compile."""
    from llguidance import LLMatcher

    field = f"structured_outputs.{kind}"
    if kind == "structural_tag":
        return structural_tag_grammar(_parsed_tag(value, field), field, whole_tokens)
    try:
        if kind == "json":
            grammar = json_schema_grammar(value)
        elif kind == "json_object":
            grammar = json_schema_grammar(_OBJECT)
        elif kind == "regex":
            grammar = LLMatcher.grammar_from_regex(value)
        elif kind == "choice":
            grammar = LLMatcher.grammar_from_lark("start: " + " | ".join(_literal(c, whole_tokens) for c in value))
        else:
            grammar = LLMatcher.grammar_from_lark(value)
    except ValueError as exc:
        raise RequestError(field, f"{field}: {exc}") from None
    return _validated(grammar, field)


def request_grammar(
    body: ChatCompletionRequest,
    tool_parser: str | None,
    token_of: Callable[[str], int | None],
    whole_tokens: WholeTokens,
) -> str | None:
    """The llguidance grammar the chat request's output must follow, or None (`token_of`: a marker's token id when
    it is one token). Raises RequestError naming the field whose schema or combination cannot be compiled."""
    from llguidance import LLMatcher

    if body.structured_outputs is not None:
        return structured_outputs_grammar(body.structured_outputs, whole_tokens)
    fmt = body.response_format
    if fmt is not None and fmt.constrains:
        return response_format_grammar(fmt, whole_tokens)
    if body.forced_tool_choice and body.tools:
        if tool_parser is None:
            raise RequestError(
                "tool_choice", "tool_choice: this model has no tool-call format (see --tool_call_parser)"
            )
        field = "tools"
        grammar = LLMatcher.grammar_from_lark(
            tool_call_lark(tool_parser, body.tools, body.tool_choice, body.parallel_tool_calls, token_of)
        )
    else:
        return None
    return _validated(grammar, field)


def completion_grammar(body: CompletionRequest, whole_tokens: WholeTokens) -> str | None:
    """The grammar a completion request's output must follow (structured_outputs or response_format), or None."""
    if body.structured_outputs is not None:
        return structured_outputs_grammar(body.structured_outputs, whole_tokens)
    if body.response_format is not None and body.response_format.constrains:
        return response_format_grammar(body.response_format, whole_tokens)
    return None


def _parsed_tag(value: dict | str, field: str) -> StructuralTag:
    """`structured_outputs.structural_tag` as given (an object, or its JSON text), checked."""
    try:
        tag = json.loads(value) if isinstance(value, str) else value
    except ValueError as exc:
        raise RequestError(field, f"{field}: not JSON: {exc}") from None
    if isinstance(tag, dict) and "format" in tag:
        raise RequestError(field, f"{field}: only the form with structures and triggers is supported (not format)")
    try:
        return StructuralTag.model_validate(tag)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise RequestError(field, f"{field}{'.' + where if where else ''}: {first.get('msg')}") from None


def _literal(text: str, whole_tokens: WholeTokens) -> str:
    """`text` as a Lark sequence: its pieces quoted, each whole token it holds as that token (`<[id]>`)."""
    names = sorted((t for t in whole_tokens if t and t in text), key=len, reverse=True)
    if not names:
        return _lark_str(text) if text else ""
    parts = re.split("(" + "|".join(map(re.escape, names)) + ")", text)
    return " ".join(f"<[{whole_tokens[p]}]>" if k % 2 else _lark_str(p) for k, p in enumerate(parts) if p)


def structural_tag_grammar(tag: StructuralTag, field: str, whole_tokens: WholeTokens) -> str:
    """Free text in which each structure, once the text reaches a trigger its begin starts with, is its begin, a JSON
    value of its schema (laid out as `JSON_OPTIONS` says) and its end: llguidance's structural tags (a lazy rule
    ends the free text at a text trigger; a trigger that is a whole token is that token), with every whole token
    in the tag's texts named as the token. Written out here rather than by llguidance's `StructTag`, which quotes
    them as text: a forced text that spells a whole token would then let the mask offer the token that the matcher
    refuses."""
    from llguidance import LLMatcher

    rules = []
    for i, s in enumerate(tag.structures):
        trigger = next((t for t in tag.triggers if s.begin.startswith(t)), None)
        if trigger is None:
            raise RequestError(field, f"{field}.structures.{i}.begin: starts with none of the triggers")
        parts = (_literal(s.begin[len(trigger) :], whole_tokens), _lark_json(s.schema_), _literal(s.end, whole_tokens))
        body = " ".join(p for p in parts if p)
        if trigger in whole_tokens:
            rules.append(f"tag_{i}: TAG_TEXT <[{whole_tokens[trigger]}]> {body}")
        else:
            rules += [
                f"tag_{i}_trigger[lazy]: TAG_TEXT {_literal(trigger, whole_tokens)}",
                f"tag_{i}: tag_{i}_trigger {body}",
            ]
    tags = " | ".join(f"tag_{i}" for i in range(len(tag.structures)))
    lark = "\n".join(
        ["%llguidance {}", f"start: ({tags})* tag_end", "tag_end: TAG_TEXT", r"TAG_TEXT: /(.|\n)*/", *rules]
    )
    try:
        grammar = LLMatcher.grammar_from_lark(lark)
    except ValueError as exc:
        raise RequestError(field, f"{field}: {exc}") from None
    return _validated(grammar, field)


def response_format_grammar(fmt: ResponseFormat, whole_tokens: WholeTokens) -> str:
    """The grammar of a constraining `response_format` (json_object, json_schema with its schema checked present,
    or structural_tag); RequestError naming the schema when it cannot be compiled."""
    if fmt.type == "structural_tag":
        return structural_tag_grammar(fmt.structural_tag(), "response_format", whole_tokens)
    field = "response_format.json_schema.schema" if fmt.type == "json_schema" else "response_format"
    schema = fmt.json_schema.schema_ if fmt.type == "json_schema" else _OBJECT
    try:
        grammar = json_schema_grammar(schema)
    except ValueError as exc:
        raise RequestError(field, f"{field}: {exc}") from None
    return _validated(grammar, field)


def single_token(tokenizer, text: str) -> int | None:
    """The id of `text` when the tokenizer writes it as one token."""
    ids = tokenizer.encode_rendered(text)
    return ids[0] if len(ids) == 1 else None


def opens_reasoning(tokenizer, prompt_ids: list[int]) -> bool:
    """The rendered prompt ends inside an opened `<think>` block (the template turned thinking on): a grammar then
    starts at the block's end."""
    return tokenizer.decode(prompt_ids[-4:], skip_special_tokens=False).rstrip().endswith(THINK_OPEN)


def reasoning_end(tokenizer) -> int:
    """The token a grammar starts after when the output begins inside a reasoning block."""
    token = single_token(tokenizer, THINK_CLOSE)
    if token is None:
        raise RequestError("messages", "this model's reasoning end is not one token: send enable_thinking: false")
    return token


def constrained(params: SamplingParams, grammar: str, start_token: int | None = None) -> SamplingParams:
    """`params` with `grammar` attached (from `start_token` on, when given)."""
    if params.ignore_eos:
        # a complete grammar allows only EOS: ignoring it would pad the output with EOS tokens to max_tokens
        raise RequestError("ignore_eos", "ignore_eos: cannot be combined with constrained output (it ends with EOS)")
    if params.min_tokens:
        # nor can EOS be banned once the grammar allows nothing else
        raise RequestError("min_tokens", "min_tokens: cannot be combined with constrained output (it ends with EOS)")
    if params.allowed_token_ids is not None:
        raise RequestError(
            "allowed_token_ids", "allowed_token_ids: cannot be combined with constrained output (the grammar chooses)"
        )
    return msgspec.structs.replace(params, grammar=grammar, grammar_start_token=start_token)
