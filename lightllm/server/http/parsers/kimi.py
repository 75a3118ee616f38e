"""Kimi: calls inside a section of special tokens,

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|>...<|tool_calls_section_end|>

The section markers come in two spellings (`tool_calls_section` and `tool_call_section`). The text between
`<|tool_call_begin|>` and `<|tool_call_argument_begin|>` is the call's id (`functions.NAME:INDEX`), which the
chat template renders back in the history; the arguments stream as written up to `<|tool_call_end|>`.
"""

from __future__ import annotations

from lightllm.server.http.parsers.base import ParsedDelta, held_suffix
from lightllm.server.http.parsers.tagged import Region, TaggedToolParser

SECTION_BEGINS = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
SECTION_ENDS = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
CALL_BEGIN, ARGUMENT_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
MAX_ID = 256


def name_of(call_id: str) -> str:
    """`functions.get_weather:0` -> `get_weather`."""
    name = call_id.split(".", 1)[1] if call_id.startswith("functions.") else call_id
    return name.rsplit(":", 1)[0] if ":" in name else name


class KimiToolParser(TaggedToolParser):
    starts = SECTION_BEGINS

    def region_begin(self) -> None:
        # None between calls, "id" while reading a call's id, "args" while streaming its arguments
        self.part: str | None = None
        self.num_in_section = 0

    def region(self, out: ParsedDelta, final: bool) -> Region:
        while True:
            if self.part == "args":
                if not self._arguments(out, final):
                    return Region.WAIT if not final else Region.DONE
                continue
            if self.part == "id":
                end = self.buf.find(ARGUMENT_BEGIN)
                if end < 0 or end > MAX_ID:
                    if final or len(self.buf) > MAX_ID + len(ARGUMENT_BEGIN):
                        self.buf = ""
                        return Region.DONE
                    return Region.WAIT
                call_id = self.buf[:end].strip()
                self.open_call(out, name_of(call_id), call_id)
                self.buf = self.buf[end + len(ARGUMENT_BEGIN) :]
                self.part, self.num_sent = "args", 0
                continue
            rest = self.buf.lstrip()
            if rest.startswith(CALL_BEGIN):
                self.buf, self.part = rest[len(CALL_BEGIN) :], "id"
                self.num_in_section += 1
                continue
            section_end = next((m for m in SECTION_ENDS if rest.startswith(m)), None)
            if section_end is not None:
                self.buf = rest[len(section_end) :]
                return Region.DONE
            if not final and any(m.startswith(rest) for m in (CALL_BEGIN, *SECTION_ENDS)):
                return Region.WAIT
            # no call opened: the marker was text; otherwise a section left open ends here
            return Region.PROSE if self.num_in_section == 0 else Region.DONE

    def _arguments(self, out: ParsedDelta, final: bool) -> bool:
        """Stream the current call's arguments; True once the call has ended."""
        end = self.buf.find(CALL_END)
        if end < 0 and not final:
            ready = self.buf[: len(self.buf) - held_suffix(self.buf, (CALL_END,))].strip()
            self.add_arguments(out, ready[self.num_sent :])
            self.num_sent = max(self.num_sent, len(ready))
            return False
        args = (self.buf[:end] if end >= 0 else self.buf).strip()
        self.add_arguments(out, args[self.num_sent :])
        self.buf = self.buf[end + len(CALL_END) :] if end >= 0 else ""
        self.part = None
        return True
