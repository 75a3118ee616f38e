"""What every output parser produces, and the text-buffer helpers they share.

A streaming parser is fed the detokenized text of one sequence in arbitrary pieces (one token, or several when
speculation accepted drafts) and returns what it can commit now; `finish()` flushes the rest. It never takes back
what it emitted, so the concatenation of its deltas is the parse of the whole text, whatever the cut.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class ToolCallDelta:
    """A piece of one tool call: its first delta carries `id` and `name`, later ones argument fragments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def extend(self, other: ParsedDelta) -> ParsedDelta:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls += other.tool_calls
        return self


@dataclass
class ToolCall:
    id: str
    name: str
    # the arguments as the model wrote them (a JSON object's text for every supported format)
    arguments: str


@dataclass
class ParsedOutput:
    """A whole sequence's parse: the merge of its deltas."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    @classmethod
    def merge(cls, deltas: list[ParsedDelta]) -> ParsedOutput:
        out = cls()
        calls: dict[int, ToolCall] = {}
        for d in deltas:
            out.content += d.content
            out.reasoning += d.reasoning
            for t in d.tool_calls:
                if t.index not in calls:
                    calls[t.index] = ToolCall(t.id or "", t.name or "", "")
                calls[t.index].arguments += t.arguments
        out.tool_calls = [calls[i] for i in sorted(calls)]
        return out


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


IdFactory = Callable[[], str]


def held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`: those characters may
    be the start of a marker still arriving, so they are held back."""
    best = 0
    for marker in markers:
        for k in range(min(len(text), len(marker) - 1), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


def find_first(text: str, markers: tuple[str, ...], start: int = 0) -> tuple[int, str] | None:
    """The earliest occurrence of any marker at or after `start` (longest marker on a tie)."""
    hits = [(text.find(m, start), -len(m), m) for m in markers]
    hits = [h for h in hits if h[0] >= 0]
    if not hits:
        return None
    pos, _, marker = min(hits)
    return pos, marker


class ToolParser:
    """A streaming tool-call parser over the content text (reasoning already removed)."""

    def __init__(self, new_id: IdFactory = new_call_id):
        self.new_id = new_id
        self.num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        raise NotImplementedError

    def finish(self) -> ParsedDelta:
        raise NotImplementedError

    def parse(self, text: str) -> ParsedOutput:
        """The whole text at once (the non-streaming response)."""
        return ParsedOutput.merge([self.feed(text), self.finish()])
