"""/v1/completions, and what the chat route (chat_api.py) shares with it: OpenAI request → engine sequences →
JSON or SSE."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from lightllm.engine.sampling_params import SamplingParams, SamplingParamsError
from lightllm.server.http.logprobs import (
    TextOffsets,
    completion_logprobs,
    echoed_prompt_logprobs,
    join_logprobs,
    ranked_prompt_logprobs,
    token_names,
)
from lightllm.server.http.protocol import ChatCompletionRequest, CompletionRequest, StreamOptions
from lightllm.server.http.schema_base import RequestError
from lightllm.server.http.serving import ApiError, ClientDisconnected, Frontend, Sequence
from lightllm.server.http.structured import completion_grammar, constrained
from lightllm.server.output import Delta, PromptLogprobs, SequenceOutput, truncated
from lightllm.server.token_fields import with_token_fields

logger = logging.getLogger(__name__)
router = APIRouter()


def _frontend(request: Request) -> Frontend:
    return request.app.state.frontend


_JSON = msgspec.json.Encoder()
SSE_DONE = b"data: [DONE]\n\n"
# JSON leaves U+0085, U+2028 and U+2029 unescaped, and readers that split lines as str.splitlines does (httpx's
# iter_lines among them) end a line at each: escaped, an event is one line for every reader. Their UTF-8 bytes
# occur only inside strings (the rest of the JSON is ASCII), so replacing the bytes is exact.
_LINE_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def json_line(obj) -> bytes:
    """`obj` as JSON on one line for every reader. msgspec writes UTF-8 JSON at a fraction of `json.dumps`'s cost
    (one event per streamed delta); a non-finite float, which JSON cannot carry, becomes null."""
    data = _JSON.encode(obj)
    for raw, escaped in _LINE_BREAKS:
        data = data.replace(raw, escaped)
    return data


def _sse(obj) -> bytes:
    """One server-sent event."""
    return b"data: " + json_line(obj) + b"\n\n"


def named_sse(name: str, line: bytes) -> bytes:
    """One server-sent event named `name` (`line`: its data, one JSON line)."""
    return b"event: " + name.encode() + b"\ndata: " + line + b"\n\n"


def ranked_prompt(fe: Frontend, prompt_ids: list[int], first: SequenceOutput, num_top: int) -> list[dict | None] | None:
    """A response's `prompt_logprobs` from the scores its prompt's first sequence brought (None when it brought none:
    it failed before its first token)."""
    if first.prompt_logprobs is None:
        return None
    return ranked_prompt_logprobs(fe.tokenizer, prompt_ids, first.prompt_logprobs, first.prompt_ranks, num_top)


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class StreamUsage:
    """The token counts a stream reports: the request's in a last chunk of its own with
    `stream_options.include_usage`, and with vLLM's `continuous_usage_stats` beside it, in every chunk its choice's
    so far (its prompt's tokens and the tokens it has generated, as vLLM counts them)."""

    def __init__(self, options: StreamOptions | None, prompt_lens: list[int], n: int):
        self.final = bool(options and options.include_usage)
        self.continuous = self.final and options.continuous_usage_stats
        self.prompt_lens, self.n = prompt_lens, n
        self.num_tokens: dict[int, int] = {}
        self.seen: dict[int, Sequence] = {}

    def add(self, seq: Sequence, delta: Delta) -> None:
        self.num_tokens[seq.index] = self.num_tokens.get(seq.index, 0) + len(delta.token_ids)
        self.seen[seq.index] = seq

    def usage(self) -> dict:
        tokens = sum(self.num_tokens.values())
        return _usage(sum(self.prompt_lens), tokens, _cached_tokens(self.seen.values(), self.n))

    def chunk(self, obj: dict) -> bytes:
        """One chunk's event (of one choice), with its choice's usage so far when it is continuous; stamped as it is
        sent, so that a stream's counts never go back."""
        if self.continuous:
            index = obj["choices"][0]["index"]
            obj = {**obj, "usage": _usage(self.prompt_lens[index // self.n], self.num_tokens.get(index, 0))}
        return _sse(obj)

    def last(self, head: dict) -> list[bytes]:
        """The usage chunk that ends the stream, when asked for."""
        return [_sse({**head, "choices": [], "usage": self.usage()})] if self.final else []


def _cached_tokens(seqs, n: int) -> int:
    """Prompt tokens resumed from the prefix cache, each prompt counted once (by its first sequence)."""
    return sum(s.output.num_cached_tokens for s in seqs if s.index % n == 0)


async def _until_disconnect(stream: AsyncIterator[tuple[Sequence, Delta]]) -> AsyncIterator[tuple[Sequence, Delta]]:
    """The stream's items; ends quietly when the client disconnects (nobody is left to send an error to)."""
    try:
        async for item in stream:
            yield item
    except ClientDisconnected:
        return


async def _collect(stream: AsyncIterator[tuple[Sequence, Delta]]) -> list[Sequence]:
    seqs: dict[int, Sequence] = {}
    async for seq, _ in stream:
        seqs[seq.index] = seq
    ordered = [seqs[i] for i in sorted(seqs)]
    failed = [s.output for s in ordered if s.output.finish_reason == "error"]
    if failed:
        raise ApiError(failed[0].error_status or 500, failed[0].error or "engine error", kind="server_error")
    return ordered


def _sse_error(message: str) -> bytes:
    return _sse({"error": {"message": message, "type": "server_error", "param": None, "code": 500}})


def _error_end(message: str) -> list[bytes]:
    """How a chat or completion stream ends on an error: the error event, then the end marker."""
    return [_sse_error(message), SSE_DONE]


async def _guarded(events: AsyncIterator[bytes], stream: AsyncIterator, error_end=_error_end) -> AsyncIterator[bytes]:
    """A stream that always ends well-formed: an unexpected failure becomes the API's error ending (`error_end`;
    the status line went out long ago), and the engine sequences are closed whatever happens."""
    try:
        async for event in events:
            yield event
    except Exception:
        logger.exception("streaming response failed")
        for event in error_end("internal server error"):
            yield event
    finally:
        await stream.aclose()


def _params(body: ChatCompletionRequest | CompletionRequest, fe: Frontend) -> SamplingParams:
    fe.check_priority(body.priority)
    try:
        return with_token_fields(body.to_sampling_params(fe.sampling_defaults), fe.tokenizer)
    except SamplingParamsError as exc:
        raise ApiError(400, str(exc), exc.field) from None
    except RequestError as exc:
        exc = body.as_sent(exc)
        raise ApiError(400, str(exc), exc.field) from None


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    fe = _frontend(request)
    fe.check_engine()
    fe.check_model(body.model)
    params = _params(body, fe)
    raw = body.prompt
    if not raw:
        raise ApiError(400, "the prompt is empty", "prompt")
    if body.structured_outputs is not None or body.response_format is not None:
        # compiled after the checks that need no compile; the prompt's own checks read no grammar
        try:
            grammar = await fe.offload(completion_grammar, body, fe.tokenizer.whole_tokens)
            if grammar is not None:
                params = constrained(params, grammar)
        except RequestError as exc:
            exc = body.as_sent(exc)
            raise ApiError(400, str(exc), exc.field) from None
    texts: list[str] | None = None
    if isinstance(raw, str) or isinstance(raw[0], str):
        texts = [raw] if isinstance(raw, str) else list(raw)
        fe.check_capacity(len(texts) * params.n, "prompt")
        prompts = [await fe.encode(t, "prompt", body.add_special_tokens) for t in texts]
    else:
        prompts = [raw] if isinstance(raw[0], int) else [list(p) for p in raw]
        fe.check_capacity(len(prompts) * params.n, "prompt")
    if body.truncate_prompt_tokens is not None:
        keep, total = body.truncate_prompt_tokens, fe.args.max_req_total_len
        prompts = [truncated(p, keep, params.max_tokens, total, body.truncation_side) for p in prompts]
        # an echo repeats the prompt the engine read
        texts = None
    # token ids are checked before anything decodes them
    for ids in prompts:
        fe.check_prompt(ids, params, "prompt")
    if texts is None and body.echo:
        texts = [await fe.offload(fe.tokenizer.decode, p, skip_special_tokens=False) for p in prompts]
    fe.check_capacity(len(prompts) * params.n, "prompt")
    rid, created, model = body.response_id("cmpl"), int(time.time()), fe.args.served_model_name
    # each prompt is counted once, however many sequences it has
    num_prompt_tokens = sum(len(p) for p in prompts)
    tok, want_logprobs = token_names(fe.tokenizer, body.return_tokens_as_token_ids), params.logprobs is not None
    # an echoed prompt with logprobs is scored by the engine: the first sequence of each prompt brings the scores
    # with its first tokens (see Frontend.generate)
    scored = body.echo and want_logprobs
    if scored:
        params = msgspec.structs.replace(params, prompt_logprobs=max(params.logprobs, params.prompt_logprobs or 0))

    def echoed(p: int, entries: PromptLogprobs | None = None) -> tuple[str, dict | None]:
        """The echoed prompt text and, with logprobs, its entries (`entries`: the engine's prompt scores)."""
        if not body.echo:
            return "", None
        if not want_logprobs:
            return texts[p], None
        return texts[p], echoed_prompt_logprobs(tok, prompts[p], len(texts[p]), entries, body.logprobs)

    stream = fe.generate(prompts, params, request, priority=body.priority, cache_salt=body.cache_salt)
    if not body.stream:
        seqs = await _collect(stream)
        # each prompt's scores come with its first sequence
        scored_by = {s.prompt_index: s.output for s in seqs if s.index % params.n == 0}
        choices = []
        for s in seqs:
            first = scored_by[s.prompt_index]
            prefix, prompt_logprobs = echoed(s.prompt_index, first.prompt_logprobs)
            offsets = TextOffsets(len(prefix))
            logprobs = completion_logprobs(tok, s.output.token_ids, s.output.logprobs, offsets)
            choice = {
                "index": s.index,
                "text": prefix + s.output.text,
                "logprobs": join_logprobs(prompt_logprobs, logprobs),
                "finish_reason": s.output.finish_reason,
            }
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = ranked_prompt(fe, prompts[s.prompt_index], first, body.prompt_logprobs)
            if body.return_token_ids:
                choice["prompt_token_ids"], choice["token_ids"] = prompts[s.prompt_index], s.output.token_ids
            choices.append(choice)
        usage = _usage(num_prompt_tokens, sum(len(s.output.token_ids) for s in seqs), _cached_tokens(seqs, params.n))
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": usage,
        }

    counts = StreamUsage(body.stream_options, [len(p) for p in prompts], params.n)

    async def events() -> AsyncIterator[bytes]:
        head = {"id": rid, "object": "text_completion", "created": created, "model": model}
        offsets: dict[int, TextOffsets] = {}

        def echo_chunks(p: int, entries: PromptLogprobs | None) -> list[dict]:
            """The echo chunk of each sequence of prompt `p`."""
            prefix, prompt_logprobs = echoed(p, entries)
            choices = [
                {"index": i, "text": prefix, "logprobs": prompt_logprobs, "finish_reason": None}
                for i in range(p * params.n, (p + 1) * params.n)
            ]
            return [{**head, "choices": [choice]} for choice in choices]

        for i in range(len(prompts) * params.n):
            offsets[i] = TextOffsets(len(echoed(i // params.n)[0]))
        # with return_token_ids: the choices whose prompt ids went out (in their first chunk)
        ids_sent: set[int] = set()

        def with_prompt_ids(chunk: dict) -> dict:
            """`chunk` (one choice) with its prompt's token ids when it is the choice's first (return_token_ids)."""
            choice = chunk["choices"][0]
            if body.return_token_ids and choice["index"] not in ids_sent:
                ids_sent.add(choice["index"])
                choice["prompt_token_ids"] = prompts[choice["index"] // params.n]
            return chunk

        # a scored prompt's echo waits for its scores (its first sequence's first chunk); the events of its
        # sequences wait behind it here, so each choice still starts with the echo
        held: dict[int, list[dict]] = {p: [] for p in range(len(prompts))} if scored else {}
        if body.echo and not scored:
            for p in range(len(prompts)):
                for chunk in echo_chunks(p, None):
                    yield counts.chunk(with_prompt_ids(chunk))
        async for seq, delta in _until_disconnect(stream):
            counts.add(seq, delta)
            if delta.finish_reason == "error":
                yield _sse_error(seq.output.error or "the engine failed this request")
                yield SSE_DONE
                return
            chunks: list[dict] = []
            if delta.text or delta.finish_reason or delta.logprobs or (body.return_token_ids and delta.token_ids):
                choice = {
                    "index": seq.index,
                    "text": delta.text,
                    "logprobs": completion_logprobs(tok, delta.token_ids, delta.logprobs, offsets[seq.index]),
                    "finish_reason": delta.finish_reason,
                }
                if body.return_token_ids:
                    choice["token_ids"] = delta.token_ids
                chunks.append({**head, "choices": [choice]})
            p = seq.prompt_index
            if p in held:
                out = seq.output
                if seq.index % params.n != 0 or (out.prompt_logprobs is None and not out.finished):
                    held[p] += chunks
                    continue
                chunks = [*echo_chunks(p, out.prompt_logprobs), *held.pop(p), *chunks]
            for chunk in chunks:
                yield counts.chunk(with_prompt_ids(chunk))
        for event in counts.last(head):
            yield event
        yield SSE_DONE

    return StreamingResponse(_guarded(events(), stream), media_type="text/event-stream")


def error_body(exc: ApiError) -> dict:
    return {"error": {"message": exc.message, "type": exc.kind, "param": exc.param, "code": exc.status}}


def error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=exc.status, headers=exc.headers)
