"""Qwen3.5 (qwen3_coder style): one block per call,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

The call is committed once `<function=NAME>` has arrived (a `<tool_call>` followed by anything else is prose).
Each parameter is sent as one argument fragment when its `</parameter>` arrives (`{"city": "Paris"`, then
`, "days": 3`, then `}`), its value typed by the tool's JSON schema: the text read as JSON is kept when it is one
of the types the schema admits (a `type` or a list of them, `anyOf` / `oneOf` members, a local `$ref` into
`$defs`, `enum` values); text that is none of them stays a string.
"""

from __future__ import annotations

import json
import math

from lightllm.server.http.parsers.base import IdFactory, ParsedDelta, new_call_id
from lightllm.server.http.parsers.tagged import Region, TaggedToolParser

START, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
# a function or parameter name longer than this is not one
MAX_NAME = 128
# Qwen3.5's released template writes a scalar argument through Jinja's `string` filter, which spells these the
# Python way
_PYTHON_LITERALS = {"True": True, "False": False, "None": None}
# schemas visited to resolve one parameter's types, and their nesting (`$ref`s followed, `anyOf` in `anyOf`), at
# most: past either (a `$ref` cycle, a client's schema built to branch without end) the parameter reads as
# unrestricted
MAX_SCHEMA_NODES, MAX_SCHEMA_DEPTH = 1000, 32


def _json_type(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if value is None:
        return "null"
    return {str: "string", list: "array", dict: "object"}.get(type(value), "")


def _resolve_ref(ref: str, root: dict):
    """A local reference (`#/$defs/Name`, `#/definitions/Name`, any JSON pointer into the parameters' schema)."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def schema_types(schema, root: dict) -> list[str]:
    """The JSON types `schema` admits, in the order it names them (`root`: the parameters' schema, which local
    references point into); empty when it does not restrict them."""
    budget = [MAX_SCHEMA_NODES]

    def types_of(node, depth: int = 0) -> list[str]:
        budget[0] -= 1
        if not isinstance(node, dict) or budget[0] < 0 or depth > MAX_SCHEMA_DEPTH:
            return []
        kind = node.get("type")
        if isinstance(kind, str):
            return [kind]
        if isinstance(kind, list):
            return list(dict.fromkeys(k for k in kind if isinstance(k, str)))
        if "const" in node:
            return [_json_type(node["const"])]
        if isinstance(node.get("enum"), list) and node["enum"]:
            return list(dict.fromkeys(_json_type(v) for v in node["enum"]))
        if isinstance(node.get("$ref"), str):
            return types_of(_resolve_ref(node["$ref"], root), depth + 1)
        members = [m for key in ("anyOf", "oneOf") if isinstance(node.get(key), list) for m in node[key]]
        types: list[str] = []
        for member in members:
            member_types = types_of(member, depth + 1)
            if not member_types:
                # a member that admits any type: so does the union
                return []
            types += member_types
        if not members and isinstance(node.get("allOf"), list):
            # every member of `allOf` holds: the first that names types bounds them
            for member in node["allOf"]:
                if member_types := types_of(member, depth + 1):
                    return member_types
        return list(dict.fromkeys(types))

    return types_of(schema)


def _param_types(tools: list[dict] | None) -> dict[str, dict[str, list[str]]]:
    """function name -> parameter name -> the types its schema admits (from OpenAI `tools`)."""
    types: dict[str, dict[str, list[str]]] = {}
    for tool in tools or []:
        fn = tool.get("function") or {}
        root = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
        props = root.get("properties") if isinstance(root.get("properties"), dict) else {}
        types[fn.get("name", "")] = {k: schema_types(v, root) for k, v in props.items() if isinstance(v, dict)}
    return types


def _is_type(value, kind: str) -> bool:
    if kind == "integer":
        return _json_type(value) == "integer" or (isinstance(value, float) and value.is_integer())
    if kind == "number":
        # NaN and Infinity read as JSON in Python but are not JSON numbers
        return _json_type(value) == "integer" or (_json_type(value) == "number" and math.isfinite(value))
    return _json_type(value) == kind


def typed_value(text: str, types: list[str] | None) -> str:
    """The JSON text of a parameter value: the value `text` reads as when that is one of `types`, else `text` as a
    string."""
    kinds = [k for k in types or [] if k != "string"]
    if kinds:
        try:
            value = json.loads(text)
        except ValueError:
            value = _PYTHON_LITERALS.get(text.strip(), text)
        if any(_is_type(value, k) for k in kinds):
            return json.dumps(value, ensure_ascii=False)
    return json.dumps(text, ensure_ascii=False)


def _strip_newline(value: str) -> str:
    """The template writes one newline after `<parameter=p>` and one before `</parameter>`."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


class Qwen3XmlToolParser(TaggedToolParser):
    starts = (START,)

    def __init__(self, tools: list[dict] | None = None, new_id: IdFactory = new_call_id):
        super().__init__(new_id)
        self.types = _param_types(tools)

    def region_begin(self) -> None:
        self.function: str | None = None
        self.function_done = False
        self.num_params = 0

    def region(self, out: ParsedDelta, final: bool) -> Region:
        if self.function_done:
            return self._after_function(out, final)
        if self.function is None:
            state = self._function_name(out, final)
            if state is not None:
                return state
        while True:
            rest = self.buf.lstrip()
            if rest.startswith(PARAMETER):
                if not self._parameter(out, rest, final):
                    return Region.WAIT if not final else self._close(out)
                continue
            for tag in (FUNCTION_END, END):
                if rest.startswith(tag):
                    self.buf = rest[len(tag) :]
                    if tag == END:
                        return self._close(out)
                    self.function_done = True
                    return self._after_function(out, final)
            if final:
                return self._close(out)
            if any(tag.startswith(rest) for tag in (PARAMETER, FUNCTION_END, END)):
                return Region.WAIT
            # stray text between parameters: skipped up to the next tag
            cut = rest.find("<", 1)
            self.buf = rest[cut:] if cut >= 0 else ""
            if cut < 0:
                return Region.WAIT

    def _function_name(self, out: ParsedDelta, final: bool) -> Region | None:
        rest = self.buf.lstrip()
        if not rest.startswith(FUNCTION):
            return Region.WAIT if FUNCTION.startswith(rest) and not final else Region.PROSE
        end = rest.find(">", len(FUNCTION))
        name = rest[len(FUNCTION) : end if end >= 0 else None]
        if end < 0 or len(name) > MAX_NAME or "\n" in name:
            too_long = len(name) > MAX_NAME or "\n" in name
            return Region.PROSE if final or too_long else Region.WAIT
        self.function = name.strip()
        self.open_call(out, self.function)
        self.buf = rest[end + 1 :]
        return None

    def _parameter(self, out: ParsedDelta, rest: str, final: bool) -> bool:
        """Send one complete parameter (or, at the end, the unfinished one); False when it is incomplete."""
        end = rest.find(">", len(PARAMETER))
        if end < 0:
            if final:
                self.buf = ""
            return False
        name = rest[len(PARAMETER) : end].strip()
        # a parameter left open runs to the next one, the function's end or the block's end
        ends = [(p, t) for t in (PARAMETER_END, PARAMETER, FUNCTION_END, END) if (p := rest.find(t, end + 1)) >= 0]
        stop, tag = min(ends) if ends else (-1, "")
        if stop < 0 and not final:
            return False
        value = _strip_newline(rest[end + 1 : stop if stop >= 0 else None])
        typed = typed_value(value, self.types.get(self.function or "", {}).get(name))
        self.add_arguments(out, ("{" if self.num_params == 0 else ", ") + json.dumps(name) + ": " + typed)
        self.num_params += 1
        if stop < 0:
            self.buf = ""
        else:
            self.buf = rest[stop + len(PARAMETER_END) :] if tag == PARAMETER_END else rest[stop:]
        return True

    def _after_function(self, out: ParsedDelta, final: bool) -> Region:
        """`</tool_call>` normally follows; anything else after `</function>` is content again."""
        rest = self.buf.lstrip()
        if rest.startswith(END):
            self.buf = rest[len(END) :]
        elif END.startswith(rest) and not final:
            return Region.WAIT
        return self._close(out)

    def _close(self, out: ParsedDelta) -> Region:
        self.add_arguments(out, "}" if self.num_params else "{}")
        self.num_params = 0
        return Region.DONE
