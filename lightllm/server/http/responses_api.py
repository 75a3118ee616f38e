"""/v1/responses: OpenAI's Responses API, served as the chat request it translates into
(`responses_protocol.py`). The output's text goes through the chat route's parsers into output items: the reasoning,
the assistant's message and its function calls, in the order the model wrote them. A streamed response is the same
items announced, filled by deltas and closed as OpenAI's typed events; a plain one is the stream's final state.
A finished response is kept (`response_store.py`) unless the request says `store: false`, for its continuations
(`previous_response_id`) and OpenAI's routes that read, list the input of and delete a stored response; one that
names a stored `conversation` (`conversations.py`) starts from its items and adds its turn to it."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from lightllm.server.http.chat_api import ChatOutput, ChatRun, render_chat, start_chat
from lightllm.server.http.conversations import ConversationTurn
from lightllm.server.http.conversations_api import stored_items
from lightllm.server.http.logprobs import chat_logprobs
from lightllm.server.http.openai_api import _frontend, _guarded, _until_disconnect, json_line, named_sse
from lightllm.server.http.parsers import ParsedDelta
from lightllm.server.http.protocol import ChatCompletionRequest
from lightllm.server.http.response_store import ResponseStore, StoredResponse, new_response_id
from lightllm.server.http.responses_protocol import INPUT_ITEMS, RESPONSES_FIELD, InputItem, ResponsesRequest
from lightllm.server.http.responses_truncation import fitting_turns, rendered_len
from lightllm.server.http.schema_base import RequestError, Text
from lightllm.server.http.serving import ApiError, Frontend, Sequence
from lightllm.server.http.stored_responses_api import event_stream, stored_conversation, with_ids
from lightllm.server.output import Delta

router = APIRouter()
logger = logging.getLogger(__name__)


def _responses_error(field: str | None, message: str) -> ApiError:
    """A chat field's error named after the Responses field it comes from."""
    for chat_field, field_here in RESPONSES_FIELD.items():
        if field is not None and (field == chat_field or field.startswith((chat_field + ".", chat_field + "["))):
            renamed = field_here if chat_field == "messages" else field_here + field[len(chat_field) :]
            message = message.replace(field, renamed, 1) if message.startswith(field) else message
            return ApiError(400, message, renamed)
    return ApiError(400, message, field)


def _chat_body(body: ResponsesRequest) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(body.chat_request())
    except RequestError as exc:
        raise _responses_error(exc.field, str(exc)) from None
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first.get("loc", ())) or None
        raise _responses_error(field, f"{field}: {first.get('msg')}" if field else first.get("msg")) from None


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request):
    fe = _frontend(request)
    store: ResponseStore = request.app.state.responses
    history, chat = await _served_chat(fe, store, body)
    kept = store if store.enabled and body.store is not False else None
    if body.background:
        _check_background(kept)
    try:
        # a background response outlives its request's connection
        run = await start_chat(fe, chat, None if body.background else request)
    except ApiError as exc:
        if exc.status != 400:
            raise
        raise _responses_error(exc.param, exc.message) from None
    new_items = with_ids(body.input_items())
    conversation_id = body.conversation_id()
    turn = None if conversation_id is None else ConversationTurn(store, conversation_id, new_items)
    built = ResponseBuilder(fe, body, run, kept, [*history, *new_items], turn)
    if body.background:
        queued = await request.app.state.background.start(built)
        if not body.stream:
            return queued
        # the response's stream as any reader of its event log sees it, from its start
        return StreamingResponse(event_stream(request, built.id, -1), media_type="text/event-stream")
    if not body.stream:
        # the deltas as a stream would take them, so a plain response holds the items a stream would build
        async for seq, delta in run.stream:
            if delta.finish_reason == "error":
                error = seq.output
                raise ApiError(error.error_status or 500, error.error or "engine error", kind="server_error")
            built.take(seq, delta)
        return await built.final()
    return StreamingResponse(
        _guarded(built.events(), run.stream, error_end=built.error_end), media_type="text/event-stream"
    )


class InputTokensRequest(ResponsesRequest):
    """What `POST /v1/responses/input_tokens` counts: a Responses request whose model and input may be left out."""

    model: Text | None = None
    input: Text | list[InputItem] = []


@router.post("/v1/responses/input_tokens")
async def input_tokens(body: InputTokensRequest, request: Request):
    """The prompt tokens the request would be served with: its stored conversation, template and truncation
    applied (OpenAI's input token count)."""
    fe = _frontend(request)
    if body.model is not None:
        fe.check_model(body.model)
    body = body.model_copy(update={"model": fe.args.served_model_name})
    _, chat = await _served_chat(fe, request.app.state.responses, body)
    try:
        prompt = await render_chat(fe, chat)
    except ApiError as exc:
        if exc.status != 400:
            raise
        raise _responses_error(exc.param, exc.message) from None
    return {"object": "response.input_tokens", "input_tokens": len(prompt)}


async def _served_chat(
    fe: Frontend, store: ResponseStore, body: ResponsesRequest
) -> tuple[list[dict], ChatCompletionRequest]:
    """The stored items the request starts from, and the chat request it is served as."""
    history = await _history(store, body)
    items = [*INPUT_ITEMS.validate_python(history), *body.input_items()]
    if body.truncation == "auto":
        items = await _fitting(fe, body, items)
    return history, _chat_body(body.model_copy(update={"input": items}))


async def _history(store: ResponseStore, body: ResponsesRequest) -> list[dict]:
    """The stored items the request starts from: its conversation's, or those of the response it continues."""
    conversation_id = body.conversation_id()
    if conversation_id is None:
        return await stored_conversation(store, body.previous_response_id)
    if body.previous_response_id is not None:
        raise ApiError(
            400, "conversation: a request continues a conversation or a previous response, not both", "conversation"
        )
    return await stored_items(store, conversation_id)


def _check_background(kept: ResponseStore | None) -> None:
    if kept is None:
        raise ApiError(
            400,
            "background: a background response is read back from the store: it needs store true, on a server that "
            "keeps responses (--responses_store_mb > 0)",
            "background",
        )


async def _fitting(fe: Frontend, body: ResponsesRequest, items: list[InputItem]) -> list[InputItem]:
    """`items` without the oldest turns the context cannot hold beside the answer (`responses_truncation.py`)."""

    async def render(tail: list[InputItem]) -> list[int]:
        return await render_chat(fe, _chat_body(body.model_copy(update={"input": tail})))

    # a prompt must leave room for the answer: max_output_tokens, else at least one token
    room = fe.args.max_req_total_len - (body.max_output_tokens or 1)
    return await fitting_turns(items, functools.partial(rendered_len, render), room)


class ResponseBuilder:
    """The response's output items as the parsed text fills them, and the events that tell a stream so."""

    def __init__(
        self,
        fe: Frontend,
        body: ResponsesRequest,
        run: ChatRun,
        store: ResponseStore | None,
        conversation: list[dict],
        turn: ConversationTurn | None = None,
    ):
        """`store`: where the finished response is kept (None: not kept), with `conversation` (the input items it
        answers, earlier turns' included); `turn`: its turn in a stored conversation, added once it has ended."""
        self.fe, self.body, self.run = fe, body, run
        self.store, self.conversation, self.turn = store, conversation, turn
        self.out: ChatOutput = run.out
        self.parser = self.out.parser() if self.out.parses else None
        self.id, self.created = new_response_id(), int(time.time())
        self.items: list[dict] = []
        # the item deltas go to (the last of `items`) while it is open, and its kind
        self.open: str | None = None
        # each tool call's item, by the parser's call index (its argument pieces name only the index)
        self.calls: dict[int, dict] = {}
        self.finished: Sequence | None = None
        self.logprobs = body.wants_logprobs()
        # logprobs of tokens whose text is not out yet (a character's first bytes)
        self._unwritten: list[dict] = []
        self.sequence_number = -1
        # events not sent yet: (type, the event as one JSON line), encoded when made (the items they show change)
        self.pending: list[tuple[str, bytes]] = []

    # -- events ------------------------------------------------------------------------------------------------

    def event(self, kind: str, **fields) -> None:
        """The next event of the response's stream."""
        self.sequence_number += 1
        self.pending.append((kind, json_line({"type": kind, "sequence_number": self.sequence_number, **fields})))

    def take_lines(self) -> list[bytes]:
        """The events made since the last take, as JSON lines."""
        events, self.pending = self.pending, []
        return [line for _, line in events]

    def _take(self) -> list[bytes]:
        """The events made since the last take, as server-sent events."""
        events, self.pending = self.pending, []
        return [named_sse(kind, line) for kind, line in events]

    def error_end(self, message: str) -> list[bytes]:
        """A stream's end on a failure: the error, then the failed response (what clients wait for)."""
        self.failed_events(message)
        return self._take()

    def failed_events(self, message: str) -> None:
        self.event("error", code="server_error", message=message, param=None)
        self.event("response.failed", response=self.failed(message))

    def failed(self, message: str) -> dict:
        return {**self.response(None), "status": "failed", "error": {"code": "server_error", "message": message}}

    def partial(self, status: str) -> dict:
        """The response as far as it got, ended with `status` (a cancelled background response)."""
        self._close("incomplete")
        return {**self.response(None), "status": status, "output": self.items}

    async def events(self) -> AsyncIterator[bytes]:
        self.event("response.created", response=self.response(None))
        self.event("response.in_progress", response=self.response(None))
        for event in self._take():
            yield event
        async for seq, delta in _until_disconnect(self.run.stream):
            if delta.finish_reason == "error":
                for event in self.error_end(seq.output.error or "the engine failed this request"):
                    yield event
                return
            self.take(seq, delta)
            if self.finished is not None:
                # kept before the client hears it is done: a continuation may follow at once
                response = await self.final()
                self.event(f"response.{response['status']}", response=response)
            for event in self._take():
                yield event

    # -- items -------------------------------------------------------------------------------------------------

    def take(self, seq: Sequence, delta: Delta) -> None:
        """One delta of the output into the items; the last one finishes them."""
        final = bool(delta.finish_reason)
        if self.parser is None:
            parsed = ParsedDelta(content=delta.text)
        else:
            parsed = self.parser.feed(delta.text) if delta.text else ParsedDelta()
            if final:
                parsed.extend(self.parser.finish())
        parsed = self.out.shown(parsed)
        # a delta's parts in the order they can have been written: reasoning first, the rest of a call already
        # open, text after it, then the calls it starts
        if parsed.reasoning:
            self._append("reasoning", parsed.reasoning)
        known = set(self.calls)
        for call in parsed.tool_calls:
            if call.index in known:
                self._arguments(self.calls[call.index], call.arguments)
        if parsed.content:
            self._append("message", parsed.content, self._message_logprobs(delta, parsed))
        else:
            self._message_logprobs(delta, parsed)
        for call in parsed.tool_calls:
            if call.index in known:
                continue
            if call.id is not None:
                self._open_call(call.index, call.id, call.name or "")
            self._arguments(self.calls[call.index], call.arguments)
        if final:
            self._close("incomplete" if delta.finish_reason == "length" else "completed")
            if not self.items:
                # an output with nothing in it is still an (empty) message
                self._open("message")
                self._close("completed")
            self.finished = seq

    def _message_logprobs(self, delta: Delta, parsed: ParsedDelta) -> list[dict]:
        """The logprobs of the tokens that wrote this delta's message text: its own (all of them where it also
        wrote reasoning or a call: a delta's text is not split by token) and those of deltas before it that wrote
        nothing yet (a character's first bytes)."""
        if not self.logprobs:
            return []
        entries = chat_logprobs(self.out.token_names, delta.token_ids, delta.logprobs)
        entries = entries["content"] if entries else []
        if not (parsed.content or parsed.reasoning or parsed.tool_calls):
            self._unwritten.extend(entries)
            return []
        entries, self._unwritten = [*self._unwritten, *entries], []
        return entries if parsed.content else []

    def _open(self, kind: str) -> dict:
        self._close("completed")
        index = len(self.items)
        if kind == "reasoning":
            item = {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [], "content": []}
        else:
            item = {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant", "content": []}
        item["status"] = "in_progress"
        self.items.append(item)
        self.open = kind
        self.event("response.output_item.added", output_index=index, item=item)
        part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else _output_text("")
        if kind == "message" and self.logprobs:
            part["logprobs"] = []
        item["content"].append(part)
        self.event("response.content_part.added", **self._where(), part=part)
        return item

    def _open_call(self, index: int, call_id: str, name: str) -> None:
        self._close("completed")
        item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call_id, "name": name}
        item.update(arguments="", status="in_progress")
        self.items.append(item)
        self.calls[index] = item
        self.open = "function_call"
        self.event("response.output_item.added", output_index=len(self.items) - 1, item=item)

    def _arguments(self, item: dict, text: str) -> None:
        if not text:
            return
        item["arguments"] += text
        if item["status"] == "in_progress":
            where = {"item_id": item["id"], "output_index": self.items.index(item)}
            self.event("response.function_call_arguments.delta", **where, delta=text)

    def _append(self, kind: str, text: str, logprobs: list[dict] = ()) -> None:
        if self.open != kind:
            self._open(kind)
        part = self.items[-1]["content"][0]
        part["text"] += text
        if "logprobs" in part:
            part["logprobs"].extend(logprobs)
        name = "reasoning_text" if kind == "reasoning" else "output_text"
        extra = {} if kind == "reasoning" else {"logprobs": list(logprobs)}
        self.event(f"response.{name}.delta", **self._where(), delta=text, **extra)

    def _close(self, status: str) -> None:
        if self.open is None:
            return
        item, kind = self.items[-1], self.open
        self.open = None
        if kind == "function_call":
            if not item["arguments"]:
                # a call written without arguments takes none, as chat reports it
                self._arguments(item, "{}")
            args = item["arguments"]
            where = {"item_id": item["id"], **self._index()}
            self.event("response.function_call_arguments.done", **where, name=item["name"], arguments=args)
        else:
            part = item["content"][0]
            extra = {} if kind == "reasoning" else {"logprobs": part.get("logprobs", [])}
            name = "reasoning_text" if kind == "reasoning" else "output_text"
            self.event(f"response.{name}.done", **self._where(), text=part["text"], **extra)
            self.event("response.content_part.done", **self._where(), part=part)
        item["status"] = status
        self.event("response.output_item.done", **self._index(), item=item)

    def _index(self) -> dict:
        return {"output_index": len(self.items) - 1}

    def _where(self) -> dict:
        return {"item_id": self.items[-1]["id"], **self._index(), "content_index": 0}

    # -- the response object -----------------------------------------------------------------------------------

    async def final(self) -> dict:
        """The finished response, kept in the store first where it is to be (reported `store: false` where it
        could not be: larger than the whole store, or the folder failing)."""
        response = self.response(self.finished)
        if self.turn is not None:
            # added before the client hears it is done: its next turn may follow at once
            await self.turn.add(response["output"])
        if self.store is None:
            return response
        try:
            kept = await asyncio.to_thread(self.store.put, StoredResponse(response, self.conversation))
        except OSError as exc:
            logger.warning("response %s not stored: %s", self.id, exc)
            kept = False
        if not kept:
            response["store"] = False
        return response

    def response(self, seq: Sequence | None) -> dict:
        """The response object: in progress (no sequence yet), or finished by `seq`."""
        body = self.body
        status, incomplete, usage = "in_progress", None, None
        if seq is not None:
            status = "incomplete" if seq.output.finish_reason == "length" else "completed"
            incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
            usage = self._usage(seq)
        fmt = body.text.format if body.text is not None and body.text.format is not None else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.fe.args.served_model_name,
            "output": self.items if seq is not None else [],
            "error": None,
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "tool_choice": _dumped(body.tool_choice) or "auto",
            "parallel_tool_calls": body.parallel_tool_calls,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "reasoning": _dumped(body.reasoning) or {"effort": None, "summary": None},
            "temperature": self.run.params.temperature,
            "top_p": self.run.params.top_p,
            "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": body.max_tool_calls,
            "background": bool(body.background),
            "previous_response_id": body.previous_response_id,
            "conversation": None if self.turn is None else {"id": self.turn.conversation_id},
            "store": self.store is not None,
            "truncation": body.truncation or "disabled",
            "metadata": body.metadata or {},
            "usage": usage,
        }

    def _usage(self, seq: Sequence) -> dict:
        prompt, output = len(self.run.prompt_ids), len(seq.output.token_ids)
        reasoning = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "reasoning")
        reasoning_tokens = len(self.fe.tokenizer.encode_rendered(reasoning)) if reasoning else 0
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": seq.output.num_cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, output)},
            "total_tokens": prompt + output,
        }


def _dumped(value):
    return value.model_dump() if hasattr(value, "model_dump") else value


def _output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}
