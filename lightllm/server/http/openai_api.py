"""/v1/chat/completions and /v1/completions: OpenAI request → engine sequences → JSON or SSE."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from lightllm.server.http.protocol import ChatCompletionRequest, CompletionRequest
from lightllm.server.http.serving import ApiError, ClientDisconnected, Frontend, Sequence
from lightllm.server.output import Delta

router = APIRouter()


def _frontend(request: Request) -> Frontend:
    return request.app.state.frontend


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _chat_logprobs(fe: Frontend, delta_ids: list[int], entries) -> dict | None:
    if not entries:
        return None

    def item(token_id: int, logprob: float) -> dict:
        text = fe.tokenizer.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**item(t, lp), "top_logprobs": [item(a, alp) for a, alp in top]}
            for t, (lp, top) in zip(delta_ids, entries)
        ]
    }


def _completion_logprobs(fe: Frontend, delta_ids: list[int], entries, offset: int) -> dict | None:
    if not entries:
        return None
    tokens = [fe.tokenizer.token_text(t) for t in delta_ids]
    offsets, pos = [], offset
    for text in tokens:
        offsets.append(pos)
        pos += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp for lp, _ in entries],
        "top_logprobs": [{fe.tokenizer.token_text(a): alp for a, alp in top} for _, top in entries],
        "text_offset": offsets,
    }


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
    errors = [s.output.error or "engine error" for s in ordered if s.output.finish_reason == "error"]
    if errors:
        raise ApiError(500, errors[0], kind="server_error")
    return ordered


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    fe = _frontend(request)
    fe.check_engine()
    fe.check_model(body.model)
    if not fe.tokenizer.has_chat_template:
        raise ApiError(400, "this model has no chat template; use /v1/completions", "messages")
    params = body.to_sampling_params()
    messages = [m.as_template_input() for m in body.messages]
    try:
        prompt_ids = fe.tokenizer.encode_chat(messages, **(body.chat_template_kwargs or {}))
    except Exception as exc:
        raise ApiError(400, f"the chat template could not render these messages: {exc}", "messages") from None
    fe.check_prompt(prompt_ids, params, "messages")
    rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), fe.args.served_model_name
    stream = fe.generate([prompt_ids], params, request)
    if not body.stream:
        seqs = await _collect(stream)
        choices = [
            {
                "index": s.index,
                "message": {"role": "assistant", "content": s.output.text},
                "logprobs": _chat_logprobs(fe, s.output.token_ids, s.output.logprobs),
                "finish_reason": s.output.finish_reason,
            }
            for s in seqs
        ]
        usage = _usage(len(prompt_ids), sum(len(s.output.token_ids) for s in seqs))
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": usage,
        }

    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def events() -> AsyncIterator[str]:
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        for i in range(params.n):
            yield _sse(
                {
                    **head,
                    "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
                }
            )
        num_tokens = 0
        async for seq, delta in _until_disconnect(stream):
            num_tokens += len(delta.token_ids)
            if not delta.text and not delta.finish_reason and not delta.logprobs:
                continue
            choice = {
                "index": seq.index,
                "delta": {"content": delta.text} if delta.text else {},
                "logprobs": _chat_logprobs(fe, delta.token_ids, delta.logprobs),
                "finish_reason": delta.finish_reason,
            }
            yield _sse({**head, "choices": [choice]})
        if include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(len(prompt_ids), num_tokens)})
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    fe = _frontend(request)
    fe.check_engine()
    fe.check_model(body.model)
    params = body.to_sampling_params()
    raw = body.prompt
    if isinstance(raw, str) or (raw and isinstance(raw[0], str)) or not raw:
        texts = [raw] if isinstance(raw, str) else list(raw)
        prompts = [fe.tokenizer.encode(t) for t in texts]
    else:
        prompts = [raw] if isinstance(raw[0], int) else [list(p) for p in raw]
        texts = [fe.tokenizer.decode(p, skip_special_tokens=False) for p in prompts]
    if not prompts:
        raise ApiError(400, "the prompt list is empty", "prompt")
    for ids in prompts:
        fe.check_prompt(ids, params, "prompt")
    rid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), fe.args.served_model_name
    num_prompt_tokens = sum(len(p) for p in prompts) * params.n
    stream = fe.generate(prompts, params, request)
    if not body.stream:
        seqs = await _collect(stream)
        choices = [
            {
                "index": s.index,
                "text": (texts[s.prompt_index] if body.echo else "") + s.output.text,
                "logprobs": _completion_logprobs(fe, s.output.token_ids, s.output.logprobs, 0),
                "finish_reason": s.output.finish_reason,
            }
            for s in seqs
        ]
        usage = _usage(num_prompt_tokens, sum(len(s.output.token_ids) for s in seqs))
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": usage,
        }

    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def events() -> AsyncIterator[str]:
        head = {"id": rid, "object": "text_completion", "created": created, "model": model}
        if body.echo:
            for i in range(len(prompts) * params.n):
                yield _sse({**head, "choices": [{"index": i, "text": texts[i // params.n], "finish_reason": None}]})
        num_tokens = 0
        offsets: dict[int, int] = {}
        async for seq, delta in _until_disconnect(stream):
            num_tokens += len(delta.token_ids)
            if not delta.text and not delta.finish_reason and not delta.logprobs:
                continue
            offset = offsets.get(seq.index, 0)
            offsets[seq.index] = offset + len(delta.text)
            choice = {
                "index": seq.index,
                "text": delta.text,
                "logprobs": _completion_logprobs(fe, delta.token_ids, delta.logprobs, offset),
                "finish_reason": delta.finish_reason,
            }
            yield _sse({**head, "choices": [choice]})
        if include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(num_prompt_tokens, num_tokens)})
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def error_response(exc: ApiError) -> JSONResponse:
    body = {"error": {"message": exc.message, "type": exc.kind, "param": exc.param, "code": exc.status}}
    return JSONResponse(body, status_code=exc.status)
