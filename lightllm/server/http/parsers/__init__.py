"""Parsers of generated text: reasoning blocks and each model family's tool-call format."""

from __future__ import annotations

from lightllm.server.http.parsers.base import (
    IdFactory,
    ParsedDelta,
    ParsedOutput,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    new_call_id,
)
from lightllm.server.http.parsers.kimi import KimiToolParser
from lightllm.server.http.parsers.output import OutputParser
from lightllm.server.http.parsers.qwen3_json import Qwen3JsonToolParser
from lightllm.server.http.parsers.qwen3_xml import Qwen3XmlToolParser
from lightllm.server.http.parsers.reasoning import ReasoningParser

TOOL_CALL_PARSERS = ("qwen3_json", "qwen3_xml", "kimi")
REASONING_PARSERS = ("think",)
# each family's chat template writes calls in this format
_TOOL_PARSER_OF_MODEL = {
    "qwen3_next": "qwen3_json",
    "qwen3_5": "qwen3_xml",
    "qwen3_5_moe": "qwen3_xml",
    "kimi_linear": "kimi",
}


def tool_parser_name(flag: str, model_type: str) -> str | None:
    """`--tool_call_parser`: auto picks the model family's format; none turns tool calling off."""
    if flag == "auto":
        return _TOOL_PARSER_OF_MODEL.get(model_type)
    return None if flag == "none" else flag


def reasoning_parser_name(flag: str, model_type: str) -> str | None:
    """`--reasoning_parser`: auto is `think` for every supported family (all write `<think>` blocks)."""
    if flag == "auto":
        return "think" if model_type in _TOOL_PARSER_OF_MODEL else None
    return None if flag == "none" else flag


def make_tool_parser(name: str, tools: list[dict] | None, new_id: IdFactory = new_call_id) -> ToolParser:
    if name == "qwen3_json":
        return Qwen3JsonToolParser(new_id)
    if name == "qwen3_xml":
        return Qwen3XmlToolParser(tools, new_id)
    if name == "kimi":
        return KimiToolParser(new_id)
    raise ValueError(f"unknown tool call parser {name!r}; expected one of {TOOL_CALL_PARSERS}")


__all__ = [
    "REASONING_PARSERS",
    "TOOL_CALL_PARSERS",
    "KimiToolParser",
    "OutputParser",
    "ParsedDelta",
    "ParsedOutput",
    "Qwen3JsonToolParser",
    "Qwen3XmlToolParser",
    "ReasoningParser",
    "ToolCall",
    "ToolCallDelta",
    "make_tool_parser",
    "reasoning_parser_name",
    "tool_parser_name",
]
