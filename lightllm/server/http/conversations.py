"""Stored conversations (OpenAI's Conversations API): a conversation is the records of its log in the response store
folded in order: the conversation object first, then items added, metadata replaced and items deleted. Each change
is one record appended in one write, so HTTP processes changing one conversation at once lose none of the changes.

A response that names a conversation (`conversation` on `POST /v1/responses`) answers its items followed by the
request's input, and once it has ended (`completed` or `incomplete`) its input items and then its output items are
added to the conversation as one change (`ConversationTurn`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

from lightllm.server.http.response_store import ResponseStore, new_conversation_id

logger = logging.getLogger(__name__)

# OpenAI's bound on the items one call creates a conversation with or adds to it
MAX_ITEMS_PER_CALL = 20


@dataclass
class Conversation:
    info: dict  # the conversation object: id, object, created_at, metadata
    items: list[dict]  # as listed, oldest first

    def item(self, item_id: str) -> dict | None:
        return next((item for item in self.items if item.get("id") == item_id), None)


def _line(record: dict) -> bytes:
    # JSON escapes every line break a byte reader splits at
    return json.dumps(record, ensure_ascii=False).encode()


def create(store: ResponseStore, metadata: dict, items: list[dict]) -> Conversation:
    """A new conversation holding `items` (each with its id)."""
    info = {"id": new_conversation_id(), "object": "conversation", "created_at": int(time.time()), "metadata": metadata}
    store.create_conversation(
        info["id"], [_line({"conversation": info}), *([_line({"items": items})] if items else [])]
    )
    return Conversation(info, list(items))


def load(store: ResponseStore, conversation_id: str) -> Conversation | None:
    """The conversation as its records leave it; None where it is not stored."""
    lines = store.read_conversation(conversation_id)
    if not lines:
        return None
    first = json.loads(lines[0])
    if "conversation" not in first:
        return None
    info, items = dict(first["conversation"]), {}
    for line in lines[1:]:
        record = json.loads(line)
        if "items" in record:
            items.update((item["id"], item) for item in record["items"])
        elif "metadata" in record:
            info["metadata"] = record["metadata"]
        elif "deleted" in record:
            items.pop(record["deleted"], None)
    return Conversation(info, list(items.values()))


def add_items(store: ResponseStore, conversation_id: str, items: list[dict]) -> bool:
    """Add `items` (each with its id) after the conversation's; False where it is not stored."""
    return store.append_conversation(conversation_id, [_line({"items": items})])


def set_metadata(store: ResponseStore, conversation_id: str, metadata: dict) -> bool:
    return store.append_conversation(conversation_id, [_line({"metadata": metadata})])


def delete_item(store: ResponseStore, conversation_id: str, item_id: str) -> bool:
    return store.append_conversation(conversation_id, [_line({"deleted": item_id})])


@dataclass
class ConversationTurn:
    """A response's turn in a stored conversation: its input items (with their ids), added with its output once
    the response has ended."""

    store: ResponseStore
    conversation_id: str
    input_items: list[dict]

    async def add(self, output: list[dict]) -> None:
        try:
            added = await asyncio.to_thread(add_items, self.store, self.conversation_id, [*self.input_items, *output])
        except OSError as exc:
            logger.warning("conversation %s: the response's turn was not added: %s", self.conversation_id, exc)
            return
        if not added:
            logger.warning(
                "conversation %s is no longer stored: the response's turn was not added", self.conversation_id
            )
