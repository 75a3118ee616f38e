"""OpenAI's routes to stored Responses API responses (`response_store.py`): read one (or a background one's
stream, resumed after any event), list the input items it answered, delete one, cancel a background one
(`background_responses.py`); and the stored conversation a continuation (`previous_response_id`) starts from."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse

from lightllm.server.http.background_responses import UNFINISHED
from lightllm.server.http.openai_api import named_sse
from lightllm.server.http.response_store import ResponseStore, StoredResponse
from lightllm.server.http.responses_protocol import InputItem
from lightllm.server.http.serving import ApiError

router = APIRouter()


async def stored_conversation(store: ResponseStore, response_id: str | None) -> list[dict]:
    """The input items a continuation of `response_id` starts from (none without one): 400 where nothing is
    kept or the response is still running (a background one), 404 where that response is not."""
    if response_id is None:
        return []
    if not store.enabled:
        raise ApiError(
            400,
            "previous_response_id: this server keeps no responses (--responses_store_mb 0); send the whole "
            "conversation in input",
            "previous_response_id",
        )
    stored = await asyncio.to_thread(store.get, response_id)
    if stored is None:
        raise ApiError(404, f"previous_response_id: no stored response {response_id[:64]!r}", "previous_response_id")
    status = stored.response["status"]
    if status in UNFINISHED:
        raise ApiError(
            400,
            f"previous_response_id: response {response_id[:64]!r} is {status}; continue it once it has ended",
            "previous_response_id",
        )
    return stored.conversation()


async def _stored(request: Request, response_id: str) -> StoredResponse:
    stored = await asyncio.to_thread(request.app.state.responses.get, response_id)
    if stored is None:
        raise ApiError(404, f"no stored response {response_id[:64]!r}", None)
    return stored


@router.get("/v1/responses/{response_id}")
async def get_response(
    response_id: str, request: Request, stream: bool = False, starting_after: int | None = Query(None, ge=-1)
):
    """The stored response; with `stream`, a background response's stream: its events numbered after
    `starting_after` (all of them without it), then each as it is made until the response ends."""
    stored = await _stored(request, response_id)
    if not stream:
        if starting_after is not None:
            raise ApiError(
                400, "starting_after: only a stream starts after an event; send stream=true", "starting_after"
            )
        return stored.response
    if not stored.response.get("background"):
        raise ApiError(
            400,
            f"stream: response {response_id[:64]!r} did not run in the background, and only a background response's "
            "stream is kept; GET it without stream",
            "stream",
        )
    if await asyncio.to_thread(request.app.state.responses.read_events, response_id, 0) is None:
        raise ApiError(404, f"stream: the events of response {response_id[:64]!r} are no longer kept", "stream")
    after = -1 if starting_after is None else starting_after
    return StreamingResponse(event_stream(request, response_id, after), media_type="text/event-stream")


async def event_stream(request: Request, response_id: str, starting_after: int) -> AsyncIterator[bytes]:
    """A background response's events after `starting_after` as server-sent events (`background_responses.py`)."""
    async for kind, line in request.app.state.background.events(response_id, starting_after):
        yield named_sse(kind, line)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request):
    if not await asyncio.to_thread(request.app.state.responses.delete, response_id):
        raise ApiError(404, f"no stored response {response_id[:64]!r}", None)
    return {"id": response_id, "object": "response", "deleted": True}


@dataclass
class PageQuery:
    """OpenAI's paging of item lists: newest first by default, at most `limit`, those after the item `after`."""

    order: Literal["asc", "desc"] = "desc"
    limit: int = Query(20, ge=1, le=100)
    after: str | None = None

    def page(self, items: list[dict], owner: str) -> dict:
        """One page of `items` (oldest first) in OpenAI's list form (400 naming `after` where `owner`, the list's
        owner in words, has no such item)."""
        items = items if self.order == "asc" else items[::-1]
        if self.after is not None:
            ids = [item.get("id") for item in items]
            if self.after not in ids:
                raise ApiError(400, f"after: no item {self.after[:64]!r} in {owner}", "after")
            items = items[ids.index(self.after) + 1 :]
        page = items[: self.limit]
        first, last = (page[0]["id"], page[-1]["id"]) if page else (None, None)
        return {"object": "list", "data": page, "first_id": first, "last_id": last, "has_more": len(items) > self.limit}


@router.get("/v1/responses/{response_id}/input_items")
async def input_items(response_id: str, request: Request, query: Annotated[PageQuery, Depends()]):
    """The conversation a stored response answered, as items (OpenAI's list: newest first by default)."""
    return query.page((await _stored(request, response_id)).input, f"response {response_id[:64]!r}")


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request):
    """Stop a background response (whichever HTTP process runs it): the response once it has stopped, as it is
    where it had already ended."""
    stored = await _stored(request, response_id)
    if not stored.response.get("background"):
        raise ApiError(400, "only a background response can be cancelled; this response was not one", None)
    response = await request.app.state.background.cancel(response_id)
    if response is None:
        raise ApiError(404, f"no stored response {response_id[:64]!r}", None)
    return response


# the id prefix of an input item of each type, as OpenAI's lists show them
_ITEM_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def with_ids(items: list[InputItem]) -> list[dict]:
    """A request's input items as stored, in the form OpenAI lists input items: each with an id of its own and
    status `completed`, a message's text as a list of parts (`input_text`, or `output_text` for the assistant's)."""
    dumped = []
    for item in items:
        data = item.model_dump(exclude_none=True)
        data["id"] = f"{_ITEM_ID_PREFIX[data['type']]}_{uuid.uuid4().hex}"
        data["status"] = "completed"
        if data["type"] == "message" and isinstance(data["content"], str):
            kind = "output_text" if data["role"] == "assistant" else "input_text"
            data["content"] = [{"type": kind, "text": data["content"]}]
        dumped.append(data)
    return dumped
