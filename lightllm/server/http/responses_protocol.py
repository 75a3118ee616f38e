"""OpenAI's Responses API request (`POST /v1/responses`) and its translation into the chat request it is served as:
input items become chat messages (function calls and their outputs as tool calls and tool messages, reasoning as
the assistant's reasoning_content), `instructions` a system message first, flat function tools the chat form,
`text.format` the response_format. A continuation (`previous_response_id`, or a stored `conversation`) is served as
a request whose input is the stored conversation followed by its own; what this server cannot do is refused naming the field."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, TypeAdapter, model_validator

from lightllm.engine.sampling_params import MAX_INT
from lightllm.server.http.chat_messages import FUNCTION_NAME, FunctionDef
from lightllm.server.http.schema_base import CacheSalt, RequestError, StrictModel, Text

# the Responses field each chat field it becomes is named after (a chat error names the client's field)
RESPONSES_FIELD = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


class TextPart(StrictModel):
    # earlier responses' output_text parts come back in assistant messages
    type: Literal["input_text", "output_text"]
    text: Text


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    call_id: Text
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: Text


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: Text
    output: Text | list[TextPart]


class ReasoningPart(StrictModel):
    type: Literal["reasoning_text", "summary_text"]
    text: Text


class ReasoningItem(StrictModel):
    type: Literal["reasoning"]
    content: list[ReasoningPart] | None = None
    summary: list[ReasoningPart] = []

    def text(self) -> str:
        # the reasoning itself where the item carries it (this server's items do), else its summary
        return "".join(p.text for p in (self.content or self.summary))


def _item_kind(value: Any) -> str:
    # an easy input message has no type
    return value.get("type", "message") if isinstance(value, dict) else "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
]
INPUT_ITEMS = TypeAdapter(list[InputItem])


class FunctionTool(FunctionDef):
    """The flat form of a chat tool: the function's fields beside its type."""

    type: Literal["function"]

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, data):
        # named before the fields a function needs: a web_search tool has no name to miss
        if isinstance(data, dict) and data.get("type") != "function":
            raise ValueError(f"only function tools are supported, not {str(data.get('type'))[:40]!r}")
        return data


class NamedFunction(StrictModel):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)


class TextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str = Field("response", pattern=FUNCTION_NAME)
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextOptions(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningOptions(StrictModel):
    # the chat request's reasoning_effort
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    # the reasoning is returned whole in each reasoning item's content; no summary is written
    summary: Literal["none", "auto", "concise", "detailed"] | None = None


class ConversationRef(StrictModel):
    id: Text


class ResponsesRequest(StrictModel):
    model: Text
    input: Text | list[InputItem]
    instructions: Text | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    # kept for previous_response_id and GET /v1/responses/{id} unless false (or the server keeps none)
    store: bool | None = None
    # "message.output_text.logprobs" asks for logprobs; the rest add nothing (reasoning items carry their text,
    # never encrypted content)
    include: list[Text] | None = None
    metadata: dict[str, Text] | None = None
    previous_response_id: Text | None = None
    # a stored conversation (its id, or {"id": ...}): its items come first, and this turn is added to it
    conversation: Text | ConversationRef | None = None
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # OpenAI's bound on calls to its built-in tools (web search, ...): none run here, so any bound holds
    max_tool_calls: int | None = Field(None, ge=0, le=MAX_INT)
    # the message's output_text parts carry their tokens' logprobs with this many alternatives each
    top_logprobs: int | None = Field(None, ge=0, le=20)
    prompt: Any = None
    cache_salt: CacheSalt | None = None
    # vLLM's: lower runs first, under --scheduling_policy priority (checked as on chat)
    priority: int | None = None

    def check_supported(self) -> None:
        refused = {
            "prompt": (self.prompt is not None, "prompt templates are not supported; send input"),
            "text.verbosity": (
                self.text is not None and self.text.verbosity is not None,
                "not supported by the models served here",
            ),
        }
        for field, (asked, why) in refused.items():
            if asked:
                raise RequestError(field, f"{field}: {why}")

    def conversation_id(self) -> str | None:
        return self.conversation.id if isinstance(self.conversation, ConversationRef) else self.conversation

    def wants_logprobs(self) -> bool:
        """The output_text parts' logprobs: asked by `top_logprobs` or by including them."""
        return self.top_logprobs is not None or "message.output_text.logprobs" in (self.include or ())

    def chat_request(self) -> dict:
        """The chat request body this request is served as."""
        self.check_supported()
        chat: dict[str, Any] = {
            "model": self.model,
            "messages": self.messages(),
            "parallel_tool_calls": self.parallel_tool_calls,
            "stream": self.stream,
        }
        optional = {
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "cache_salt": self.cache_salt,
            "priority": self.priority,
        }
        chat.update({k: v for k, v in optional.items() if v is not None})
        if self.wants_logprobs():
            chat.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        if self.tools:
            chat["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in self.tools
            ]
        if isinstance(self.tool_choice, NamedFunction):
            chat["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            chat["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None:
            chat["response_format"] = {"type": fmt.type}
            if fmt.type == "json_schema":
                schema = fmt.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)
                chat["response_format"]["json_schema"] = schema
        if self.reasoning is not None and self.reasoning.effort is not None:
            chat["reasoning_effort"] = self.reasoning.effort
        return chat

    def input_items(self) -> list[InputItem]:
        """The input as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def messages(self) -> list[dict]:
        """The conversation as chat messages: consecutive function calls join one
        assistant message (the one before them when it is the assistant's), a reasoning item the next assistant
        message; a reasoning item that no assistant message follows (an answer cut short while it reasoned) is an
        assistant turn of its own, so that the turn is not lost."""
        messages: list[dict] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        reasoning: str | None = None

        def unanswered() -> None:
            nonlocal reasoning
            if reasoning is not None:
                messages.append({"role": "assistant", "content": "", "reasoning_content": reasoning})
                reasoning = None

        for item in self.input_items():
            if isinstance(item, ReasoningItem):
                reasoning = (reasoning or "") + item.text()
                continue
            if isinstance(item, FunctionCallOutputItem):
                unanswered()
                output = item.output if isinstance(item.output, str) else "".join(p.text for p in item.output)
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
                continue
            if isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function", "function": {"name": item.name}}
                call["function"]["arguments"] = item.arguments
                last = messages[-1] if messages else None
                if last is None or last["role"] != "assistant" or reasoning is not None:
                    last = {"role": "assistant", "content": None}
                    messages.append(last)
                last.setdefault("tool_calls", []).append(call)
            elif item.role != "assistant":
                unanswered()
                messages.append({"role": "system" if item.role == "developer" else item.role, "content": item.text()})
                continue
            else:
                messages.append({"role": "assistant", "content": item.text()})
                last = messages[-1]
            if reasoning is not None:
                last["reasoning_content"] = reasoning
                reasoning = None
        unanswered()
        return messages
