"""`<think>...</think>` reasoning, split from the answer.

A model whose chat template opens the thinking block in the prompt (Qwen3.5 with thinking on) starts inside it:
everything up to `</think>` is reasoning. Otherwise reasoning is a `<think>` block at the very start of the output
(after whitespace). Newlines right after `</think>` are the template's separator, not content. A block never
closed is reasoning to the end.
"""

from __future__ import annotations

from lightllm.server.http.parsers.base import ParsedDelta, held_suffix

OPEN, CLOSE = "<think>", "</think>"


class ReasoningParser:
    """`verbatim`: the reasoning part keeps its markers and separator, so reasoning + content is the text as
    written (for a server that returns reasoning inside content but must still find where the answer starts)."""

    def __init__(self, starts_in_reasoning: bool = False, verbatim: bool = False):
        # "start": before the output's first non-space text; "think": inside the block; "gap": right after it;
        # "answer": the rest
        self.state = "think" if starts_in_reasoning else "start"
        self.verbatim = verbatim
        self.buf = ""

    def feed(self, text: str) -> ParsedDelta:
        self.buf += text
        return self._run(final=False)

    def finish(self) -> ParsedDelta:
        return self._run(final=True)

    def _run(self, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        while True:
            if self.state == "start":
                rest = self.buf.lstrip()
                if rest.startswith(OPEN):
                    if self.verbatim:
                        out.reasoning += self.buf[: len(self.buf) - len(rest)] + OPEN
                    self.buf, self.state = rest[len(OPEN) :], "think"
                elif OPEN.startswith(rest) and not final:
                    return out
                else:
                    self.state = "answer"
            elif self.state == "think":
                end = self.buf.find(CLOSE)
                if end < 0:
                    keep = 0 if final else held_suffix(self.buf, (CLOSE,))
                    out.reasoning += self.buf[: len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep :]
                    return out
                out.reasoning += self.buf[: end + (len(CLOSE) if self.verbatim else 0)]
                self.buf, self.state = self.buf[end + len(CLOSE) :], "gap"
            elif self.state == "gap":
                rest = self.buf.lstrip("\n")
                if self.verbatim:
                    out.reasoning += self.buf[: len(self.buf) - len(rest)]
                self.buf = rest
                if not self.buf and not final:
                    return out
                self.state = "answer"
            else:
                out.content += self.buf
                self.buf = ""
                return out
