"""/v1/chat/completions: messages (tool calls and results included) → chat template → engine sequences → JSON or
SSE, each sequence's text split into reasoning, content and tool calls by the model family's parsers."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from lightllm.engine.sampling_params import SamplingParams
from lightllm.server.http.logprobs import chat_logprobs, token_names
from lightllm.server.http.openai_api import (
    SSE_DONE,
    StreamUsage,
    _cached_tokens,
    _collect,
    _frontend,
    _guarded,
    _params,
    _sse_error,
    _until_disconnect,
    _usage,
    ranked_prompt,
)
from lightllm.server.http.parsers import (
    OutputParser,
    ParsedDelta,
    ParsedOutput,
    ReasoningParser,
    ToolCallDelta,
    make_tool_parser,
    reasoning_parser_name,
    tool_parser_name,
)
from lightllm.server.http.protocol import ChatCompletionRequest
from lightllm.server.http.schema_base import RequestError
from lightllm.server.http.serving import ApiError, Frontend, Sequence
from lightllm.server.http.structured import (
    THINK_CLOSE,
    THINK_OPEN,
    constrained,
    opens_reasoning,
    reasoning_end,
    request_grammar,
    single_token,
)
from lightllm.server.output import Delta, default_length, truncated

router = APIRouter()


class ChatOutput:
    """How this request's sequences are parsed: which parsers, whether the prompt opened a reasoning block (then a
    grammar starts after it, and tool calls are looked for after it, whether or not reasoning is split out)."""

    def __init__(self, fe: Frontend, body: ChatCompletionRequest):
        model_type = fe.info.model_type
        self.tool_parser = tool_parser_name(fe.args.tool_call_parser, model_type)
        self.reasoning = reasoning_parser_name(fe.args.reasoning_parser, model_type) is not None
        self.body = body
        # how the logprobs objects name tokens: their text, or their ids when the client asked so
        self.token_names = token_names(fe.tokenizer, body.return_tokens_as_token_ids)
        if body.uses_tools and self.tool_parser is None:
            raise ApiError(
                400, "tools: this model has no tool-call format; start the server with --tool_call_parser", "tools"
            )
        self.starts_in_reasoning = False
        # `echo`: the final message's text when its role is the response's (the assistant's when a turn is opened,
        # else the final message's own, as vLLM has it), which starts the response's content
        last = body.messages[-1]
        role = "assistant" if body.add_generation_prompt else last.role
        self.echo = last.as_template_input()["content"] if body.echo and last.role == role else ""
        # a continued message is the start of the output: it is parsed with it (from outside any reasoning block,
        # which its own text may open); a finished one only precedes it
        self.echo_parsed = bool(self.echo) and body.continue_final_message

    @property
    def parses(self) -> bool:
        return self.reasoning or self.body.uses_tools

    def parser(self) -> OutputParser:
        tools = None
        if self.body.uses_tools:
            specs = [t.model_dump(by_alias=True, exclude_none=True) for t in self.body.tools]
            tools = make_tool_parser(self.tool_parser, specs)
        in_reasoning = self.starts_in_reasoning and not self.echo_parsed
        if self.reasoning:
            return OutputParser(ReasoningParser(in_reasoning), tools)
        # reasoning stays in content, but a call written while thinking is not a call
        return OutputParser(ReasoningParser(in_reasoning, verbatim=True), tools, reasoning_as_content=True)

    def parse(self, text: str) -> ParsedOutput:
        """A whole output's text as the response reports it, the echoed message included."""
        if not self.parses:
            return ParsedOutput(content=self.echo + text)
        parsed = self.parser().parse(self.echo + text if self.echo_parsed else text)
        if not self.echo_parsed:
            parsed.content = self.echo + parsed.content
        return parsed

    def echo_deltas(self, parsers: dict[int, OutputParser]) -> dict[int, ParsedDelta]:
        """The echoed message as each sequence's first streamed delta (fed to its parser when it is parsed)."""
        if not self.echo:
            return {}
        if self.echo_parsed and self.parses:
            return {i: parser.feed(self.echo) for i, parser in parsers.items()}
        return {i: ParsedDelta(content=self.echo) for i in range(self.body.n)}

    def shown(self, parsed: ParsedDelta) -> ParsedDelta:
        """What a streamed delta shows: the first call only with parallel_tool_calls false, no reasoning with
        include_reasoning false."""
        if not self.body.parallel_tool_calls:
            parsed.tool_calls = [c for c in parsed.tool_calls if c.index == 0]
        if not self.body.include_reasoning:
            parsed.reasoning = ""
        return parsed


def _continues_reasoning(body: ChatCompletionRequest) -> bool:
    """The assistant message being continued opened a `<think>` block and did not close it (a prefilled start of
    the reasoning): the output begins inside the block, though the prompt does not end with its opening."""
    if not body.continue_final_message:
        return False
    text = body.messages[-1].as_template_input()["content"]
    return text.rfind(THINK_OPEN) > text.rfind(THINK_CLOSE)


async def _constrain(fe: Frontend, body: ChatCompletionRequest, out: ChatOutput, params):
    """Attach the request's grammar (built off the event loop); a reasoning block opened by the prompt stays free
    until `</think>`."""
    try:
        grammar = await fe.offload(
            request_grammar,
            body,
            out.tool_parser,
            lambda text: single_token(fe.tokenizer, text),
            fe.tokenizer.whole_tokens,
        )
        if grammar is None:
            return params
        return constrained(params, grammar, reasoning_end(fe.tokenizer) if out.starts_in_reasoning else None)
    except RequestError as exc:
        exc = body.as_sent(exc)
        raise ApiError(400, str(exc), exc.field) from None


def _tool_call_json(calls: list) -> list[dict]:
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments or "{}"}} for c in calls
    ]


def _delta_calls(deltas: list[ToolCallDelta]) -> list[dict]:
    """OpenAI's streamed tool-call entries: the first of a call has id, type and name; fragments of one call in a
    row are joined."""
    entries: list[dict] = []
    for d in deltas:
        if d.id is None and entries and entries[-1]["index"] == d.index:
            entries[-1]["function"]["arguments"] += d.arguments
            continue
        entry: dict = {"index": d.index, "function": {"arguments": d.arguments}}
        if d.id is not None:
            entry.update(id=d.id, type="function")
            entry["function"]["name"] = d.name
        entries.append(entry)
    return entries


def _delta_body(parsed: ParsedDelta) -> dict:
    body: dict = {}
    if parsed.reasoning:
        body["reasoning_content"] = parsed.reasoning
    if parsed.content:
        body["content"] = parsed.content
    if parsed.tool_calls:
        body["tool_calls"] = _delta_calls(parsed.tool_calls)
    return body


def _finish_reason(reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if reason == "stop" and has_calls else reason


@dataclass
class ChatRun:
    """A chat request's submitted sequences and how their text is parsed."""

    out: ChatOutput
    params: SamplingParams
    prompt_ids: list[int]
    stream: AsyncIterator[tuple[Sequence, Delta]]


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    fe = _frontend(request)
    run = await start_chat(fe, body, request)
    out, params, prompt_ids, stream = run.out, run.params, run.prompt_ids, run.stream
    rid, created, model = body.response_id("chatcmpl"), int(time.time()), fe.args.served_model_name
    if not body.stream:
        seqs = await _collect(stream)
        usage = _usage(len(prompt_ids), sum(len(s.output.token_ids) for s in seqs), _cached_tokens(seqs, params.n))
        response = {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [_choice(fe, out, s) for s in seqs],
            "usage": usage,
        }
        if body.return_token_ids:
            response["prompt_token_ids"] = prompt_ids
        if body.prompt_logprobs is not None:
            # the first sequence scored the prompt
            response["prompt_logprobs"] = ranked_prompt(fe, prompt_ids, seqs[0].output, body.prompt_logprobs)
        return response
    counts = StreamUsage(body.stream_options, [len(prompt_ids)], params.n)
    events = _events(fe, out, stream, params.n, counts, rid, created, model, prompt_ids)
    return StreamingResponse(_guarded(events, stream), media_type="text/event-stream")


async def start_chat(fe: Frontend, body: ChatCompletionRequest, request: Request) -> ChatRun:
    """Check, render and submit a chat request (ApiError for what cannot be served)."""
    fe.check_engine()
    fe.check_model(body.model)
    params = _params(body, fe)
    fe.check_capacity(params.n, "n")
    out = ChatOutput(fe, body)
    messages, kwargs = _template_input(body)
    prompt_ids = await render_chat(fe, body)
    full_len = len(prompt_ids)
    answer_length = params.max_tokens or fe.sampling_defaults.get("max_tokens")
    prompt_ids = truncated(
        prompt_ids, body.truncate_prompt_tokens, answer_length, fe.args.max_req_total_len, body.truncation_side
    )
    fe.check_prompt(prompt_ids, params, "messages")
    params = default_length(prompt_ids, params, fe.sampling_defaults.get("max_tokens"), fe.args.max_req_total_len)
    out.starts_in_reasoning = opens_reasoning(fe.tokenizer, prompt_ids) or _continues_reasoning(body)
    params = await _constrain(fe, body, out, params)
    if out.body.uses_tools and out.tool_parser == "kimi" and params.skip_special_tokens:
        # Kimi's tool-call section markers are special tokens: the parser has to see them
        params = msgspec.structs.replace(params, skip_special_tokens=False)
    fe.check_capacity(params.n, "n")
    # the conversation before an opened assistant turn is what the next turn repeats; a prompt that opens none
    # gets no hint
    opens_turn = body.add_generation_prompt and not body.continue_final_message
    history = 0
    if opens_turn and len(prompt_ids) == full_len:
        # a truncated prompt no longer starts with the earlier turns: no hint
        history = await fe.chat_history_len(messages, body.chat_template, kwargs, prompt_ids)
    stream = fe.generate(
        [prompt_ids],
        params,
        request,
        checkpoint_hints=[history] if history else [],
        priority=body.priority,
        cache_salt=body.cache_salt,
    )
    return ChatRun(out, params, prompt_ids, stream)


def _template_input(body: ChatCompletionRequest) -> tuple[list[dict], dict]:
    return [m.as_template_input() for m in body.messages], body.template_variables()


async def render_chat(fe: Frontend, body: ChatCompletionRequest) -> list[int]:
    """The prompt ids of the request's conversation as its template renders them (ApiError where it cannot)."""
    messages, kwargs = _template_input(body)
    opening = dict(add_generation_prompt=body.add_generation_prompt, continue_final_message=body.continue_final_message)
    return await fe.encode_chat(messages, body.chat_template, kwargs, body.add_special_tokens, **opening)


def _choice(fe: Frontend, out: ChatOutput, s: Sequence) -> dict:
    parsed = out.parse(s.output.text)
    message: dict = {"role": "assistant", "content": parsed.content}
    has_calls = False
    if out.parses:
        calls = parsed.tool_calls if out.body.parallel_tool_calls else parsed.tool_calls[:1]
        has_calls = bool(calls)
        message["content"] = parsed.content if parsed.content or not calls else None
        if out.reasoning and out.body.include_reasoning:
            message["reasoning_content"] = parsed.reasoning or None
        if calls:
            message["tool_calls"] = _tool_call_json(calls)
    choice = {
        "index": s.index,
        "message": message,
        "logprobs": chat_logprobs(out.token_names, s.output.token_ids, s.output.logprobs),
        "finish_reason": _finish_reason(s.output.finish_reason, has_calls),
    }
    if out.body.return_token_ids:
        choice["token_ids"] = s.output.token_ids
    return choice


async def _events(
    fe: Frontend, out: ChatOutput, stream, n: int, counts: StreamUsage, rid, created, model, prompt_ids: list[int]
) -> AsyncIterator[bytes]:
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    token_ids = out.body.return_token_ids
    for i in range(n):
        opening = {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        # return_token_ids: the prompt's ids in the stream's first chunk (vLLM's)
        first = {"prompt_token_ids": prompt_ids} if token_ids and i == 0 else {}
        yield counts.chunk({**head, **first, "choices": [opening]})
    parsers = {i: out.parser() for i in range(n)} if out.parses else {}
    has_calls: dict[int, bool] = {}
    for i, parsed in out.echo_deltas(parsers).items():
        parsed = out.shown(parsed)
        has_calls[i] = bool(parsed.tool_calls)
        if parsed:
            yield counts.chunk({**head, "choices": [{"index": i, "delta": _delta_body(parsed), "finish_reason": None}]})
    async for seq, delta in _until_disconnect(stream):
        counts.add(seq, delta)
        if delta.finish_reason == "error":
            yield _sse_error(seq.output.error or "the engine failed this request")
            yield SSE_DONE
            return
        parsed = ParsedDelta(content=delta.text)
        if out.parses:
            parser = parsers[seq.index]
            parsed = parser.feed(delta.text) if delta.text else ParsedDelta()
            if delta.finish_reason:
                parsed.extend(parser.finish())
            parsed = out.shown(parsed)
        if parsed.tool_calls:
            has_calls[seq.index] = True
        if not parsed and not delta.finish_reason and not delta.logprobs and not (token_ids and delta.token_ids):
            continue
        choice = {
            "index": seq.index,
            "delta": _delta_body(parsed),
            "logprobs": chat_logprobs(out.token_names, delta.token_ids, delta.logprobs),
            "finish_reason": _finish_reason(delta.finish_reason, has_calls.get(seq.index, False)),
        }
        if token_ids:
            choice["token_ids"] = delta.token_ids
        yield counts.chunk({**head, "choices": [choice]})
    for event in counts.last(head):
        yield event
    yield SSE_DONE
