"""One sequence's output text → content, reasoning and tool calls: the reasoning parser first, then the tool
parser over what is left (a tool call written inside the reasoning is not a call)."""

from __future__ import annotations

from lightllm.server.http.parsers.base import ParsedDelta, ParsedOutput, ToolParser
from lightllm.server.http.parsers.reasoning import ReasoningParser


class OutputParser:
    """`reasoning_as_content`: the reasoning is returned as content (before the answer), yet the tool parser still
    reads only the answer (pair it with a verbatim ReasoningParser to keep the text as written)."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, reasoning_as_content: bool = False):
        self.reasoning, self.tools = reasoning, tools
        self.reasoning_as_content = reasoning_as_content

    def feed(self, text: str) -> ParsedDelta:
        return self._split(self.reasoning.feed(text) if self.reasoning else ParsedDelta(content=text), False)

    def finish(self) -> ParsedDelta:
        return self._split(self.reasoning.finish() if self.reasoning else ParsedDelta(), True)

    def _split(self, delta: ParsedDelta, final: bool) -> ParsedDelta:
        reasoning, answer = delta.reasoning, delta.content
        out = ParsedDelta(content=reasoning) if self.reasoning_as_content else ParsedDelta(reasoning=reasoning)
        if self.tools is None:
            out.content += answer
            return out
        out.extend(self.tools.feed(answer) if answer else ParsedDelta())
        if final:
            out.extend(self.tools.finish())
        return out

    def parse(self, text: str) -> ParsedOutput:
        return ParsedOutput.merge([self.feed(text), self.finish()])
