"""Qwen3-Next (Hermes style): `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, one block per call.

The call is committed once `{"name": "...", "arguments":` has arrived; the arguments then stream as written,
holding back the last `}` seen (it may close the outer object). Some models write the arguments as a JSON string
(`"arguments": "{\"a\": 1}"`): its decoded text is the arguments, sent once the block closes. A `<tool_call>` not
followed by `{` is prose, and so is one whose header does not appear within `WINDOW` characters (unless a complete
block parses as JSON).
"""

from __future__ import annotations

import json
import re

from lightllm.server.http.parsers.base import ParsedDelta, held_suffix
from lightllm.server.http.parsers.tagged import Region, TaggedToolParser

START, END = "<tool_call>", "</tool_call>"
WINDOW = 512
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def _outer_stripped(body: str) -> str:
    """The arguments' text: the body after the header without the outer object's closing brace."""
    body = body.rstrip()
    return body[:-1].rstrip() if body.endswith("}") else body


def _string_arguments(body: str) -> str:
    """Arguments written as a JSON string: its decoded text when the body is that string and the outer object's
    closing brace; otherwise (a block cut short, text after the string) the body as written."""
    try:
        value, end = json.JSONDecoder().raw_decode(body)
    except ValueError:
        return _outer_stripped(body)
    if not isinstance(value, str) or body[end:].strip() not in ("}", ""):
        return _outer_stripped(body)
    return value


class Qwen3JsonToolParser(TaggedToolParser):
    starts = (START,)

    def region_begin(self) -> None:
        self.in_arguments = False
        self.num_sent = 0

    def region(self, out: ParsedDelta, final: bool) -> Region:
        if not self.in_arguments:
            return self._header(out, final)
        close = self.buf.find(END)
        if close >= 0 or final:
            raw = (self.buf[:close] if close >= 0 else self.buf).lstrip()
            text = _string_arguments(raw) if raw.startswith('"') else _outer_stripped(raw)[self.num_sent :]
            self.add_arguments(out, text)
            self.buf = self.buf[close + len(END) :] if close >= 0 else ""
            return Region.DONE
        ready = self.buf[: len(self.buf) - held_suffix(self.buf, (END,))].lstrip()
        if ready.startswith('"'):
            # a string's decoded text cannot be sent before its end is known
            return Region.WAIT
        brace = ready.rfind("}")
        safe = ready[:brace].rstrip() if brace >= 0 else ""
        if len(safe) > self.num_sent:
            self.add_arguments(out, safe[self.num_sent :])
            self.num_sent = len(safe)
        return Region.WAIT

    def _header(self, out: ParsedDelta, final: bool) -> Region:
        window = self.buf[:WINDOW]
        head = window.lstrip()
        if head and head[0] != "{":
            return Region.PROSE
        match = _HEADER.match(window)
        if match is not None:
            self.open_call(out, json.loads(f'"{match.group(1)}"'))
            self.buf = self.buf[match.end() :]
            self.in_arguments = True
            return self.region(out, final)
        close = window.find(END)
        if close >= 0:
            return self._whole_block(out, close)
        if final or len(self.buf) >= WINDOW:
            return Region.PROSE
        return Region.WAIT

    def _whole_block(self, out: ParsedDelta, close: int) -> Region:
        """A block whose keys come in another order: accepted when it parses as a call."""
        try:
            call = json.loads(self.buf[:close])
        except ValueError:
            return Region.PROSE
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return Region.PROSE
        args = call.get("arguments", {})
        self.open_call(out, call["name"])
        self.add_arguments(out, args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
        self.buf = self.buf[close + len(END) :]
        return Region.DONE
