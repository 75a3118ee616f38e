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
`, "days": 3`, then `}`), its value typed by the tool's JSON schema: strings stay text, other types are read as
JSON when they parse.
"""

from __future__ import annotations

import json

from lightllm.server.http.parsers.base import IdFactory, ParsedDelta, new_call_id
from lightllm.server.http.parsers.tagged import Region, TaggedToolParser

START, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
# a function or parameter name longer than this is not one
MAX_NAME = 128
_JSON_TYPES = {"integer", "number", "boolean", "object", "array", "null"}


def _param_types(tools: list[dict] | None) -> dict[str, dict[str, object]]:
    """function name -> parameter name -> its schema's `type` (from OpenAI `tools`)."""
    types: dict[str, dict[str, object]] = {}
    for tool in tools or []:
        fn = tool.get("function") or {}
        props = (fn.get("parameters") or {}).get("properties") or {}
        types[fn.get("name", "")] = {k: (v or {}).get("type") for k, v in props.items() if isinstance(v, dict)}
    return types


def typed_value(text: str, schema_type) -> str:
    """The JSON text of a parameter value: a string unless its schema says otherwise and it parses."""
    kinds = set(schema_type) if isinstance(schema_type, list) else {schema_type}
    if kinds & _JSON_TYPES:
        try:
            return json.dumps(json.loads(text), ensure_ascii=False)
        except ValueError:
            pass
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
