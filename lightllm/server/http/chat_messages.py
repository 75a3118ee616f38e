"""A chat conversation as clients send it: messages (text parts, earlier tool calls and their results), the tools
offered, a named tool choice, and the variables the chat template renders them with."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from lightllm.server.http.schema_base import RequestError, StrictModel, Text
from lightllm.server.tokenizer import opening_problem


class TextPart(StrictModel):
    type: Literal["text"]
    text: Text


class FunctionCall(StrictModel):
    name: Text
    # JSON text, as OpenAI writes it
    arguments: Text


class ToolCallIn(StrictModel):
    """An assistant message's earlier tool call, sent back in the conversation history."""

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


def _template_arguments(arguments: str):
    """Templates iterate the arguments (Qwen3.5 writes one tag per parameter) or dump them: an object's text is
    handed over as the object; anything else stays text."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[TextPart] | None = None
    # assistant turns: the calls it made; tool turns: which call this is the result of
    tool_calls: list[ToolCallIn] | None = Field(
        None, description="assistant messages: the tool calls it made (rendered back through the chat template)"
    )
    tool_call_id: Text | None = Field(None, description="tool messages (required there): the call this answers")
    name: Text | None = None
    reasoning_content: Text | None = Field(None, description="assistant messages: their reasoning, if any")

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict = {"role": self.role, "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": _template_arguments(call.function.arguments)},
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message


FUNCTION_NAME = r"^[A-Za-z0-9_.-]{1,64}$"


class FunctionDef(StrictModel):
    name: str = Field(pattern=FUNCTION_NAME)
    description: Text | None = None
    # a JSON schema of the arguments object
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(StrictModel):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(StrictModel):
    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


def check_opening(add_generation_prompt: bool, continue_final_message: bool, messages: list[ChatMessage]) -> None:
    """RequestError naming continue_final_message when the conversation cannot be rendered that way (chat
    requests and /tokenize of messages alike)."""
    problem = opening_problem(add_generation_prompt, continue_final_message, messages[-1].role)
    if problem is not None:
        raise RequestError("continue_final_message", problem)


# apply_chat_template's own arguments: as template variables they would change how the prompt is built
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    """RequestError naming the key when `chat_template_kwargs` holds an argument of the template call."""
    for key in kwargs or {}:
        if key == "chat_template":
            raise RequestError(
                "chat_template_kwargs.chat_template", "chat_template_kwargs.chat_template: send it as chat_template"
            )
        if key in RESERVED_TEMPLATE_KWARGS:
            raise RequestError(
                f"chat_template_kwargs.{key}",
                f"chat_template_kwargs.{key}: reserved (an argument of the template call, not a template variable)",
            )


def template_kwargs(kwargs: dict[str, Any] | None, tools: list[ToolDef] | None) -> dict[str, Any]:
    """What the chat template renders with beside the messages: the client's variables, and the tools offered."""
    out = dict(kwargs or {})
    if tools:
        out["tools"] = [t.model_dump(by_alias=True, exclude_none=True) for t in tools]
    return out
