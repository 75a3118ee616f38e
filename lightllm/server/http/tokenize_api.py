"""vLLM's utility endpoints: POST /tokenize, POST /detokenize, GET /version."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field

from lightllm import __version__
from lightllm.server.http.chat_messages import (
    ChatMessage,
    ToolDef,
    check_opening,
    check_template_kwargs,
    template_kwargs,
)
from lightllm.server.http.protocol import MAX_TOOLS
from lightllm.server.http.schema_base import RequestError, StrictModel, Text
from lightllm.server.http.serving import ApiError, Frontend

router = APIRouter()


class TokenizeRequest(StrictModel):
    model: Text | None = None
    # exactly one of prompt (plain text) or messages (rendered with the chat template)
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    # the tokenizer's own markers (a BOS, ...): by default added around a prompt and not around rendered messages,
    # as the completion and chat requests do
    add_special_tokens: bool | None = None
    # messages: rendered as a chat request with the same fields renders them (vLLM's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)


class DetokenizeRequest(StrictModel):
    model: Text | None = None
    tokens: list[int] = Field(max_length=1 << 20)


def _frontend(request: Request, model: str | None) -> Frontend:
    fe: Frontend = request.app.state.frontend
    if model is not None:
        fe.check_model(model)
    return fe


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    fe = _frontend(request, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "give exactly one of prompt or messages", "prompt")
    if body.messages is not None:
        try:
            check_opening(body.add_generation_prompt, body.continue_final_message, body.messages)
            check_template_kwargs(body.chat_template_kwargs)
        except RequestError as exc:
            raise ApiError(400, str(exc), exc.field) from None
        messages = [m.as_template_input() for m in body.messages]
        opening = dict(
            add_generation_prompt=body.add_generation_prompt, continue_final_message=body.continue_final_message
        )
        kwargs = template_kwargs(body.chat_template_kwargs, body.tools)
        ids = await fe.encode_chat(messages, None, kwargs, bool(body.add_special_tokens), **opening)
    else:
        ids = await fe.encode(body.prompt, "prompt", body.add_special_tokens is not False)
    return {"count": len(ids), "max_model_len": fe.args.max_req_total_len, "tokens": ids}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    fe = _frontend(request, body.model)
    vocab = fe.info.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise ApiError(400, f"tokens: token ids must be in [0, {vocab})", "tokens")
    text = await fe.offload(fe.tokenizer.decode, body.tokens, skip_special_tokens=False)
    return {"prompt": text}


@router.get("/version")
async def version():
    return {"version": __version__}
