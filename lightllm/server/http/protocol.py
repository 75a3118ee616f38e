"""OpenAI request schemas (the subset we serve) and their translation into `SamplingParams`.

Unknown fields are ignored like OpenAI does; wrong types and out-of-range values become 400 errors naming the
field. Types are strict: `"16"` is not a number and `"yes"` or `1` is not a boolean. Every integer is bounded to what
the engine can store, so no value a client sends can fail the engine step it is batched into.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from lightllm.engine.messages import MAX_PRIORITY, MIN_PRIORITY
from lightllm.engine.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_INT,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_N,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MIN_REPETITION_PENALTY,
    SamplingParams,
    SamplingParamsError,
)
from lightllm.server.http.chat_messages import (
    ChatMessage,
    NamedToolChoice,
    ToolDef,
    check_opening,
    check_template_kwargs,
    template_kwargs,
)
from lightllm.server.http.extra_fields import guided_field, read_guided, refused_field, renamed_errors
from lightllm.server.http.output_formats import ResponseFormat, StructuredOutputs
from lightllm.server.http.schema_base import CacheSalt, Int, RequestError, StrictModel, Text, check_text

# at most this many stop strings / stop token ids per request (each is checked against the stream)
MAX_STOPS = 64
MAX_STOP_TOKEN_IDS = 1024
MAX_TOOLS = 128


class StreamOptions(StrictModel):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far
    continuous_usage_stats: bool = False


def _is_id_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


class _SamplingFields(StrictModel):
    model: Text
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_INT)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    # the schema states what the plain validator below accepts
    stop: Any = Field(
        None,
        json_schema_extra={
            "anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOPS},
                {"type": "null"},
            ]
        },
    )
    stop_token_ids: list[Int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = Field(False, description="the stop string that ended the output ends its text")
    min_tokens: int = Field(
        0, ge=0, le=MAX_INT, description="no stop token or stop string ends the first this many tokens"
    )
    skip_special_tokens: bool = True
    # vLLM's; a no-op there too for the fast tokenizers served here, which join special tokens without spaces
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(
        None,
        ge=-1,
        le=MAX_INT,
        description="keep only the prompt's last this many tokens; -1: as many as leave room for max_tokens (vLLM's)",
    )
    thinking_token_budget: int | None = Field(
        None,
        ge=0,
        le=MAX_INT,
        description="vLLM's: at most this many tokens inside a reasoning block; then the model's </think> is forced",
    )
    priority: int = Field(
        0,
        ge=MIN_PRIORITY,
        le=MAX_PRIORITY,
        description="vLLM's: lower runs first (only under --scheduling_policy priority; else it must be 0)",
    )
    request_id: Annotated[Text, Field(min_length=1, max_length=256)] | None = Field(
        None, description="vLLM's: the response's id is built from it (cmpl-<request_id>, chatcmpl-<request_id>)"
    )
    return_token_ids: bool = Field(
        False,
        description="vLLM's: the response carries the prompt's token ids and each choice's generated ones (streamed: "
        "the prompt's in the first chunk, each chunk's own tokens)",
    )
    return_tokens_as_token_ids: bool = Field(
        False, description="vLLM's: logprobs name each token `token_id:{id}` instead of its text"
    )
    truncation_side: Literal["left", "right"] = Field(
        "left", description="vLLM's: truncate_prompt_tokens keeps the prompt's end (left) or its start (right)"
    )
    cache_salt: CacheSalt | None = None
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        le=20,
        description="vLLM's: each prompt token's log-probability and rank given the tokens before it, with this many "
        "most likely alternatives (not with stream)",
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    structured_outputs: StructuredOutputs | None = Field(
        None,
        description="vLLM's: one of json (a schema), json_object, regex, choice, grammar or structural_tag constrains "
        "the output",
    )
    allowed_token_ids: list[Int] | None = Field(
        None,
        min_length=1,
        max_length=MAX_ALLOWED_TOKEN_IDS,
        description="vLLM's: only these token ids may be generated (list EOS's to let the output end before max_tokens)",
    )
    bad_words: list[Annotated[Text, Field(pattern=r"\S")]] | None = Field(
        None,
        max_length=MAX_BAD_WORDS,
        description="vLLM's: words the output never ends with (each banned as written and after a space)",
    )
    # OpenAI's form: token ids as JSON object keys (strings of digits), each mapped to a number
    logit_bias: Any = Field(
        None,
        description="token ids (digit strings) to values in [-100, 100] added to their logits every step",
        json_schema_extra={
            "anyOf": [
                {
                    "type": "object",
                    "propertyNames": {"pattern": "^[0-9]+$"},
                    "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS, "maximum": MAX_LOGIT_BIAS},
                    "maxProperties": MAX_LOGIT_BIAS_TOKENS,
                },
                {"type": "null"},
            ]
        },
    )

    # the first field of another API this request sets to something this server does not do (`extra_fields`)
    _refused: tuple[str, str] | None = PrivateAttr(None)
    # the guided_* field read as structured_outputs (`extra_fields.read_guided`): errors name it
    _guided: str | None = PrivateAttr(None)

    @model_validator(mode="wrap")
    @classmethod
    def _other_apis_fields(cls, data, handler):
        """Keys of vLLM's and OpenAI's APIs that the fields below do not hold: vLLM's guided_* become
        structured_outputs; one that asks for what this server does not do is refused by `check_supported`."""
        refused = refused_field(data) if isinstance(data, dict) else None
        guided = guided_field(data) if isinstance(data, dict) and refused is None else None
        try:
            model = handler(read_guided(data) if guided is not None else data)
        except ValidationError as exc:
            if guided is None:
                raise
            # a bad value is named as the client sent it: guided_choice.0, not structured_outputs.choice.0
            raise renamed_errors(exc, cls.__name__, guided) from None
        model._refused = refused
        model._guided = guided
        return model

    @field_validator("stop", mode="plain")
    @classmethod
    def _stop(cls, value):
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError("must be a string or a list of strings")
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings, got {len(stops)}")
        if not all(stops):
            raise ValueError("stop strings must not be empty")
        return [check_text(s) for s in stops]

    @field_validator("logit_bias", mode="plain")
    @classmethod
    def _logit_bias(cls, value):
        """OpenAI's digit-string keys as token ids; the values' range and the entry count are SamplingParams'
        checks (a 400 naming logit_bias too)."""
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError("must be an object mapping token ids to numbers")
        for key in value:
            # a key of digits alone: int() would also take " 5", "+5" or "5_0"
            if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= len(str(MAX_INT))):
                raise ValueError(f"keys must be token ids written in digits, got {str(key)[:40]!r}")
        return {int(key): v for key, v in value.items()}

    def check_supported(self) -> None:
        """Refuse options that parse but that this server would otherwise ignore."""
        if self._refused is not None:
            raise RequestError(*self._refused)
        if self.truncate_prompt_tokens == 0:
            raise RequestError("truncate_prompt_tokens", "truncate_prompt_tokens: must be -1 or at least 1")

        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options", "stream_options: only allowed with stream: true")
        if self.prompt_logprobs is not None and self.stream:
            # vLLM's rule too: the scores come with the whole response
            raise RequestError("prompt_logprobs", "prompt_logprobs: not available with stream: true")
        if self.structured_outputs is not None:
            kinds = self.structured_outputs.kinds()
            if len(kinds) != 1:
                raise RequestError(
                    "structured_outputs",
                    "structured_outputs: give exactly one of json, json_object, regex, choice, grammar, structural_tag"
                    + (f" (got {', '.join(kinds)})" if kinds else ""),
                )

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, defaults: dict[str, float | int]
    ) -> SamplingParams:
        """Raises RequestError for combinations the field checks cannot see (seed + n, ...). `defaults`: the model's
        values for the sampling knobs the request leaves out (`lightllm.server.sampling_defaults`); their length
        default applies where the prompt is known (`lightllm.server.output.default_length`)."""
        self.check_supported()
        if self.truncate_prompt_tokens == -1 and max_tokens is None and "max_tokens" not in defaults:
            raise RequestError(
                "truncate_prompt_tokens",
                "truncate_prompt_tokens: -1 keeps the room for max_tokens; set max_tokens (this model sets no default)",
            )
        knobs = {k: v for k, v in defaults.items() if k != "max_tokens"} | {
            k: getattr(self, k)
            for k in (
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "repetition_penalty",
                "presence_penalty",
                "frequency_penalty",
            )
            if getattr(self, k) is not None
        }
        try:
            return SamplingParams(
                n=self.n,
                seed=self.seed,
                max_tokens=max_tokens,
                stop=list(self.stop or []),
                stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=self.ignore_eos,
                include_stop_str_in_output=self.include_stop_str_in_output,
                min_tokens=self.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=self.prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens,
                logit_bias=dict(self.logit_bias or {}),
                allowed_token_ids=None if self.allowed_token_ids is None else list(self.allowed_token_ids),
                bad_words=list(self.bad_words or []),
                thinking_token_budget=self.thinking_token_budget,
                **knobs,
            )
        except SamplingParamsError as exc:
            raise RequestError(self.field_name(exc.field), str(exc)) from None

    def response_id(self, prefix: str) -> str:
        """The response's id: `prefix-` and the client's request_id, or a fresh one."""
        return f"{prefix}-{self.request_id if self.request_id is not None else uuid.uuid4().hex}"

    def field_name(self, params_field: str) -> str:
        """The request field a SamplingParams field (or structured_outputs) comes from."""
        if self._guided is not None and params_field.split(".")[0] == "structured_outputs":
            return self._guided
        return params_field

    def as_sent(self, exc: RequestError) -> RequestError:
        """`exc` naming the field as the client sent it (a guided_* field read as structured_outputs)."""
        field = self.field_name(exc.field)
        message = str(exc)
        if field != exc.field and message.startswith(exc.field):
            message = field + message[len(exc.field) :]
        return RequestError(field, message)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    chat_template: Text | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="variables for the chat template, e.g. {'enable_thinking': false}"
    )
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = Field(
        None,
        description="the template's enable_thinking (false for none, true otherwise) unless chat_template_kwargs sets "
        "it; templates that read reasoning_effort get it (vLLM's)",
    )
    tools: list[ToolDef] | None = Field(
        None, max_length=MAX_TOOLS, description="functions the model may call (OpenAI's tools)"
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description="none: no calls; auto: the model decides (default with tools); required: at least one call; "
        "{'type': 'function', 'function': {'name': ...}}: that function, once. required and named are enforced by "
        "a grammar",
    )
    parallel_tool_calls: bool = Field(True, description="false: at most one call per response")
    response_format: ResponseFormat | None = Field(
        None, description="text, json_object, or json_schema (output constrained to the schema by a grammar)"
    )
    add_generation_prompt: bool = Field(True, description="open the assistant's turn after the messages (vLLM's)")
    # the completions field, sent to chat by some clients: n sequences are returned, never a best one
    best_of: int | None = Field(None, ge=1, le=1, description="only 1: use n for several sequences")
    add_special_tokens: bool = Field(
        False, description="add the tokenizer's own markers (a BOS, ...) around the rendered prompt (vLLM's)"
    )
    include_reasoning: bool = Field(True, description="false: the reasoning is left out of the response (vLLM's)")
    echo: bool = Field(
        False,
        description="the final message, when its role is the response's (the assistant's, or any with "
        "add_generation_prompt false), starts the response's content (vLLM's); with continue_final_message it is "
        "parsed with the output (reasoning, tool calls)",
    )
    continue_final_message: bool = Field(
        False,
        description="render the final assistant message left open, so that the output continues it (vLLM's); "
        "with add_generation_prompt false",
    )
    # the legacy function-calling fields: refused unless they ask for nothing (send tools / tool_choice)
    functions: Any = None
    function_call: Any = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs", "top_logprobs: only allowed with logprobs: true")
        if self.functions or self.function_call not in (None, "none"):
            name = "functions" if self.functions else "function_call"
            raise RequestError(name, f"{name}: the legacy function-calling fields are not supported; use tools")
        self._check_tools()
        fmt = self.response_format
        if fmt is not None:
            fmt.check()
        if fmt is not None and fmt.constrains and self.forced_tool_choice:
            raise RequestError(
                "response_format", "response_format: cannot be combined with tool_choice required or a named function"
            )
        if self.structured_outputs is not None and ((fmt is not None and fmt.constrains) or self.forced_tool_choice):
            raise RequestError(
                "structured_outputs",
                "structured_outputs: cannot be combined with response_format or tool_choice required / a named function",
            )
        self._check_continuation(fmt)
        for i, message in enumerate(self.messages):
            if message.role == "tool" and message.tool_call_id is None:
                raise RequestError(
                    f"messages[{i}].tool_call_id", f"messages[{i}].tool_call_id: required in a tool message"
                )
            if message.tool_calls and message.role != "assistant":
                raise RequestError(
                    f"messages[{i}].tool_calls", f"messages[{i}].tool_calls: only assistant messages make calls"
                )
        check_template_kwargs(self.chat_template_kwargs)

    def _check_continuation(self, fmt: ResponseFormat | None) -> None:
        check_opening(self.add_generation_prompt, self.continue_final_message, self.messages)
        if not self.continue_final_message:
            return
        # a grammar constrains a whole reply, not the rest of one already begun
        if (fmt is not None and fmt.constrains) or self.structured_outputs is not None or self.forced_tool_choice:
            raise RequestError(
                "continue_final_message",
                "continue_final_message: cannot be combined with response_format, structured_outputs or tool_choice "
                "required / a named function",
            )

    def _check_tools(self) -> None:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise RequestError("tools", "tools: function names must be unique")
        choice = self.tool_choice
        if not self.forced_tool_choice:
            return
        if not names:
            raise RequestError("tool_choice", "tool_choice: asks for a tool call but no tools are given")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise RequestError(
                "tool_choice.function.name",
                f"tool_choice.function.name: {choice.function.name!r} is not one of the tools ({', '.join(names)})",
            )

    def template_variables(self) -> dict[str, Any]:
        """What the chat template renders with beside the messages (`template_kwargs`), with reasoning_effort's
        thinking switch where the client's variables leave it."""
        variables = template_kwargs(self.chat_template_kwargs, self.tools if self.uses_tools else None)
        if self.reasoning_effort is not None:
            # as vLLM: any effort but none asks for thinking, and templates that read the effort see it
            variables.setdefault("enable_thinking", self.reasoning_effort != "none")
            variables.setdefault("reasoning_effort", self.reasoning_effort)
        return variables

    @property
    def forced_tool_choice(self) -> bool:
        """tool_choice obliges the model to call: required, or a named function."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    @property
    def uses_tools(self) -> bool:
        """Tools are offered and not switched off: the output is parsed for calls."""
        return bool(self.tools) and self.tool_choice != "none"

    def to_sampling_params(self, defaults: dict[str, float | int]) -> SamplingParams:
        num_top = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(self.max_completion_tokens or self.max_tokens, num_top, defaults)

    def field_name(self, params_field: str) -> str:
        if params_field == "logprobs":
            return "top_logprobs"
        if params_field == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return super().field_name(params_field)


_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": MAX_INT}, "minItems": 1}


class CompletionRequest(_SamplingFields):
    # text, a batch of texts, token ids, or a batch of token id lists (the schema states what `_prompt` accepts)
    prompt: Any = Field(
        json_schema_extra={
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}, "minItems": 1},
                _TOKEN_IDS,
                {"type": "array", "items": _TOKEN_IDS, "minItems": 1},
            ]
        }
    )
    max_tokens: int | None = Field(16, ge=1, le=MAX_INT)
    # OpenAI's best_of samples best_of sequences and returns the n most likely: only best_of == n (all of them)
    # is honoured; anything else is refused, never silently ignored
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: Text | None = None
    add_special_tokens: bool = Field(
        True, description="false: a text prompt is encoded without the tokenizer's markers (a BOS, ...) (vLLM's)"
    )
    response_format: ResponseFormat | None = Field(
        None, description="json_object or json_schema: the output constrained as on chat (vLLM's)"
    )

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt(cls, value):
        if isinstance(value, str):
            return check_text(value)
        if isinstance(value, list) and value and all(isinstance(p, str) for p in value):
            return [check_text(p) for p in value]
        if _is_id_list(value) or (isinstance(value, list) and value and all(_is_id_list(p) for p in value)):
            return value
        if value == []:
            return value
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of token-id lists")

    def check_supported(self) -> None:
        super().check_supported()
        if self.response_format is not None:
            self.response_format.check()
            if self.response_format.constrains and self.structured_outputs is not None:
                raise RequestError("structured_outputs", "structured_outputs: cannot be combined with response_format")
        if self.suffix:
            raise RequestError("suffix", "suffix: not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError(
                "best_of", f"best_of: only best_of equal to n ({self.n}) is supported (every sequence is returned)"
            )

    def to_sampling_params(self, defaults: dict[str, float | int]) -> SamplingParams:
        return self.sampling_params(self.max_tokens, self.logprobs, defaults)
