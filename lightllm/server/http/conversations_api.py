"""OpenAI's Conversations API over the stored conversations (`conversations.py`): create one (with items and
metadata), read, update its metadata, delete it; add items, list them in pages, read and delete one. And the items
a response that names a conversation starts from."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from pydantic import Field

from lightllm.server.http import conversations
from lightllm.server.http.conversations import MAX_ITEMS_PER_CALL, Conversation
from lightllm.server.http.response_store import ResponseStore
from lightllm.server.http.responses_protocol import InputItem
from lightllm.server.http.schema_base import StrictModel, Text
from lightllm.server.http.serving import ApiError
from lightllm.server.http.stored_responses_api import PageQuery, with_ids

router = APIRouter()

# OpenAI's bounds on metadata: 16 pairs (here), keys of 64 characters and values of 512 (`_checked_metadata`)
METADATA_PAIRS = 16


class ConversationCreate(StrictModel):
    items: list[InputItem] | None = Field(None, max_length=MAX_ITEMS_PER_CALL)
    metadata: dict[str, Text] | None = Field(None, max_length=METADATA_PAIRS)


class ConversationUpdate(StrictModel):
    metadata: dict[str, Text] = Field(max_length=METADATA_PAIRS)


class ItemsCreate(StrictModel):
    items: list[InputItem] = Field(min_length=1, max_length=MAX_ITEMS_PER_CALL)


def _checked_metadata(metadata: dict[str, str] | None) -> dict:
    for key, value in (metadata or {}).items():
        if len(key) > 64 or len(value) > 512:
            raise ApiError(400, "metadata: keys hold at most 64 characters and values 512", "metadata")
    return dict(metadata or {})


def _store(request: Request) -> ResponseStore:
    store = request.app.state.responses
    if not store.enabled:
        raise ApiError(
            400, "conversations are kept with the responses, and this server keeps none (--responses_store_mb 0)"
        )
    return store


async def stored_items(store: ResponseStore, conversation_id: str) -> list[dict]:
    """The items a response in conversation `conversation_id` starts from: 400 where nothing is kept, 404 where
    that conversation is not."""
    if not store.enabled:
        raise ApiError(
            400,
            "conversation: this server keeps no conversations (--responses_store_mb 0); send the whole conversation "
            "in input",
            "conversation",
        )
    found = await asyncio.to_thread(conversations.load, store, conversation_id)
    if found is None:
        raise ApiError(404, f"conversation: no stored conversation {conversation_id[:64]!r}", "conversation")
    return found.items


async def _conversation(request: Request, conversation_id: str) -> tuple[ResponseStore, Conversation]:
    store = _store(request)
    found = await asyncio.to_thread(conversations.load, store, conversation_id)
    if found is None:
        raise ApiError(404, f"no stored conversation {conversation_id[:64]!r}", None)
    return store, found


def _still_stored(done: bool, conversation_id: str) -> None:
    # the conversation went between reading it and changing it
    if not done:
        raise ApiError(404, f"no stored conversation {conversation_id[:64]!r}", None)


@router.post("/v1/conversations")
async def create_conversation(body: ConversationCreate, request: Request):
    store = _store(request)
    metadata = _checked_metadata(body.metadata)
    created = await asyncio.to_thread(conversations.create, store, metadata, with_ids(body.items or []))
    return created.info


@router.get("/v1/conversations/{conversation_id}")
async def get_conversation(conversation_id: str, request: Request):
    return (await _conversation(request, conversation_id))[1].info


@router.post("/v1/conversations/{conversation_id}")
async def update_conversation(conversation_id: str, body: ConversationUpdate, request: Request):
    store, found = await _conversation(request, conversation_id)
    metadata = _checked_metadata(body.metadata)
    _still_stored(
        await asyncio.to_thread(conversations.set_metadata, store, conversation_id, metadata), conversation_id
    )
    return {**found.info, "metadata": metadata}


@router.delete("/v1/conversations/{conversation_id}")
async def delete_conversation(conversation_id: str, request: Request):
    store = _store(request)
    if not await asyncio.to_thread(store.delete_conversation, conversation_id):
        raise ApiError(404, f"no stored conversation {conversation_id[:64]!r}", None)
    return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}


@router.post("/v1/conversations/{conversation_id}/items")
async def add_items(conversation_id: str, body: ItemsCreate, request: Request):
    store, _ = await _conversation(request, conversation_id)
    items = with_ids(body.items)
    _still_stored(await asyncio.to_thread(conversations.add_items, store, conversation_id, items), conversation_id)
    return {"object": "list", "data": items, "first_id": items[0]["id"], "last_id": items[-1]["id"], "has_more": False}


@router.get("/v1/conversations/{conversation_id}/items")
async def list_items(conversation_id: str, request: Request, query: Annotated[PageQuery, Depends()]):
    """The conversation's items (OpenAI's list: newest first by default)."""
    _, found = await _conversation(request, conversation_id)
    return query.page(found.items, f"conversation {conversation_id[:64]!r}")


def _item(found: Conversation, item_id: str) -> dict:
    item = found.item(item_id)
    if item is None:
        raise ApiError(404, f"no item {item_id[:64]!r} in conversation {found.info['id']!r}", None)
    return item


@router.get("/v1/conversations/{conversation_id}/items/{item_id}")
async def get_item(conversation_id: str, item_id: str, request: Request):
    return _item((await _conversation(request, conversation_id))[1], item_id)


@router.delete("/v1/conversations/{conversation_id}/items/{item_id}")
async def delete_item(conversation_id: str, item_id: str, request: Request):
    """Remove an item; returns the conversation (as OpenAI does)."""
    store, found = await _conversation(request, conversation_id)
    _item(found, item_id)
    _still_stored(await asyncio.to_thread(conversations.delete_item, store, conversation_id, item_id), conversation_id)
    return found.info
