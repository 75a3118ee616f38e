"""One sequence's output text → content, reasoning and tool calls: the reasoning parser first, then the tool
parser over what is left (a tool call written inside the reasoning is not a call)."""

from __future__ import annotations

from lightllm.server.http.parsers.base import ParsedDelta, ParsedOutput, ToolParser
from lightllm.server.http.parsers.reasoning import ReasoningParser


class OutputParser:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None):
        self.reasoning, self.tools = reasoning, tools

    def feed(self, text: str) -> ParsedDelta:
        return self._split(self.reasoning.feed(text) if self.reasoning else ParsedDelta(content=text), False)

    def finish(self) -> ParsedDelta:
        return self._split(self.reasoning.finish() if self.reasoning else ParsedDelta(), True)

    def _split(self, delta: ParsedDelta, final: bool) -> ParsedDelta:
        if self.tools is None:
            return delta
        out = ParsedDelta(reasoning=delta.reasoning)
        out.extend(self.tools.feed(delta.content) if delta.content else ParsedDelta())
        if final:
            out.extend(self.tools.finish())
        return out

    def parse(self, text: str) -> ParsedOutput:
        return ParsedOutput.merge([self.feed(text), self.finish()])
