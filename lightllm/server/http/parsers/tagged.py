"""The part every tool-call format shares: content text scanned for a start marker, then a region the format
parses, which either becomes tool calls or turns out to be prose (the marker is then content, and scanning goes
on right after it)."""

from __future__ import annotations

import enum

from lightllm.server.http.parsers.base import (
    IdFactory,
    ParsedDelta,
    ToolCallDelta,
    ToolParser,
    find_first,
    held_suffix,
    new_call_id,
)


class Region(enum.Enum):
    # more text is needed to decide or to go on
    WAIT = "wait"
    # the marker was not a tool call after all: it is content
    PROSE = "prose"
    # the region ended; `buf` holds the text after it
    DONE = "done"


class TaggedToolParser(ToolParser):
    """Subclasses set `starts` (the markers opening a tool-call region) and implement `region_begin` and
    `region(out, final)`, which consumes `self.buf` (the text after the marker) as far as it can."""

    starts: tuple[str, ...] = ()

    def __init__(self, new_id: IdFactory = new_call_id):
        super().__init__(new_id)
        self.buf = ""
        self.inside = False
        self.marker = ""
        # whitespace after a tool call is held: dropped before the next call or at the end, content otherwise
        self.after_call = False
        self.pending_ws = ""

    def feed(self, text: str) -> ParsedDelta:
        self.buf += text
        return self._run(final=False)

    def finish(self) -> ParsedDelta:
        return self._run(final=True)

    def region_begin(self) -> None:
        raise NotImplementedError

    def region(self, out: ParsedDelta, final: bool) -> Region:
        raise NotImplementedError

    def open_call(self, out: ParsedDelta, name: str, call_id: str | None = None) -> ToolCallDelta:
        delta = ToolCallDelta(self.num_calls, call_id or self.new_id(), name)
        self.num_calls += 1
        out.tool_calls.append(delta)
        return delta

    def add_arguments(self, out: ParsedDelta, text: str) -> None:
        if text:
            out.tool_calls.append(ToolCallDelta(self.num_calls - 1, arguments=text))

    def _run(self, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        while True:
            if not self.inside:
                hit = find_first(self.buf, self.starts)
                if hit is None:
                    keep = 0 if final else held_suffix(self.buf, self.starts)
                    text, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
                    self._content(out, text, before_call=False)
                    if final:
                        self.pending_ws = ""
                    return out
                pos, self.marker = hit
                self._content(out, self.buf[:pos], before_call=True)
                self.buf = self.buf[pos + len(self.marker) :]
                self.inside = True
                self.region_begin()
                continue
            state = self.region(out, final)
            if state is Region.WAIT:
                return out
            self.inside = False
            if state is Region.PROSE:
                self._content(out, self.marker, before_call=False)
            else:
                self.after_call = True

    def _content(self, out: ParsedDelta, text: str, before_call: bool) -> None:
        if not self.after_call:
            out.content += text
            return
        self.pending_ws += text
        if self.pending_ws.strip():
            out.content += self.pending_ws
            self.pending_ws, self.after_call = "", False
        elif before_call:
            self.pending_ws = ""
