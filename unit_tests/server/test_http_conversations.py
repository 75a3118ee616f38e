"""The Conversations API over HTTP (the fake runner behind a tiny checkpoint's tokenizer and template), through the
openai SDK: a conversation is created with items and metadata, read, updated, listed in pages, its items added,
read and deleted; a response that names it is served exactly as the conversation sent whole and adds its turn to
it; what cannot be done is refused by name."""

from __future__ import annotations

import httpx
import openai
import pytest

from unit_tests.server.live_server import LiveServer, tiny_checkpoint_server


@pytest.fixture(scope="module")
def server():
    s = tiny_checkpoint_server("qwen3_5", "think")
    yield s
    s.close()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _respond(client, server, **fields):
    return client.responses.create(**{"model": server.model, "max_output_tokens": 12, "temperature": 0.0, **fields})


def _items(client, conversation_id: str) -> list[dict]:
    """Every item of the conversation, oldest first, read in pages of two through the SDK's paging."""
    page = client.conversations.items.list(conversation_id, order="asc", limit=2)
    return [item.model_dump(exclude_none=True) for item in page.iter_pages() for item in item.data]


def test_a_conversation_is_created_read_updated_and_deleted(client):
    created = client.conversations.create(
        items=[{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "Hi."}],
        metadata={"topic": "greetings"},
    )
    assert (
        created.id.startswith("conv_")
        and created.object == "conversation"
        and created.metadata == {"topic": "greetings"}
    )
    assert client.conversations.retrieve(created.id) == created
    updated = client.conversations.update(created.id, metadata={"topic": "farewells"})
    assert updated.metadata == {"topic": "farewells"} and client.conversations.retrieve(created.id) == updated
    items = _items(client, created.id)
    assert [(i["role"], i["content"]) for i in items] == [
        ("developer", [{"type": "input_text", "text": "Be terse."}]),
        ("user", [{"type": "input_text", "text": "Hi."}]),
    ]
    assert all(i["status"] == "completed" and i["id"].startswith("msg_") for i in items)
    deleted = client.conversations.delete(created.id)
    assert deleted.deleted and deleted.id == created.id
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(created.id)
    # the twin: another conversation is untouched
    other = client.conversations.create()
    assert client.conversations.retrieve(other.id).metadata == {} and _items(client, other.id) == []


def test_items_are_added_listed_read_and_deleted(client):
    conversation = client.conversations.create(items=[{"role": "user", "content": "one"}])
    added = client.conversations.items.create(
        conversation.id,
        items=[{"role": "user", "content": word} for word in ("two", "three", "four", "five")],
    )
    assert [i.content[0].text for i in added.data] == ["two", "three", "four", "five"]
    items = _items(client, conversation.id)
    assert [i["content"][0]["text"] for i in items] == ["one", "two", "three", "four", "five"]
    newest = client.conversations.items.list(conversation.id).data
    assert [i.id for i in newest] == [i["id"] for i in items][::-1]
    after = client.conversations.items.list(conversation.id, order="asc", after=items[1]["id"], limit=2)
    assert [i.id for i in after.data] == [items[2]["id"], items[3]["id"]] and after.has_more
    third = client.conversations.items.retrieve(items[2]["id"], conversation_id=conversation.id)
    assert third.model_dump(exclude_none=True) == items[2]
    back = client.conversations.items.delete(items[2]["id"], conversation_id=conversation.id)
    assert back.id == conversation.id
    assert [i["content"][0]["text"] for i in _items(client, conversation.id)] == ["one", "two", "four", "five"]
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(items[2]["id"], conversation_id=conversation.id)
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.delete(items[2]["id"], conversation_id=conversation.id)


def test_a_response_in_a_conversation_is_the_conversation_sent_whole_and_adds_its_turn(client, server, prompts_sent):
    conversation = client.conversations.create(items=[{"role": "developer", "content": "Count things."}])
    first = _respond(client, server, input="Two apples.", conversation=conversation.id, instructions="Be brief.")
    assert first.conversation.id == conversation.id
    second = _respond(
        client, server, input="And pears?", conversation={"id": conversation.id}, instructions="Be brief."
    )
    items = _items(client, conversation.id)
    turns = [(i["type"], i.get("role")) for i in items]
    outputs = [o.model_dump(exclude_none=True) for o in first.output]
    # the conversation's items, then each turn: its input, then its output
    assert turns[:2] == [("message", "developer"), ("message", "user")]
    assert items[2 : 2 + len(outputs)] == outputs
    assert items[2 + len(outputs)]["content"] == [{"type": "input_text", "text": "And pears?"}]
    assert len(items) == 3 + len(outputs) + len(second.output)
    # the second response saw exactly the conversation before it, sent whole
    whole = _as_input(items[: 3 + len(outputs)])
    _respond(client, server, input=whole, instructions="Be brief.", store=False)
    assert prompts_sent[1] == prompts_sent[2]
    # an item deleted from the conversation is gone from the next turn's prompt
    client.conversations.items.delete(items[1]["id"], conversation_id=conversation.id)
    remaining = _as_input(_items(client, conversation.id))
    _respond(client, server, input=[], conversation=conversation.id, instructions="Be brief.")
    _respond(client, server, input=remaining, instructions="Be brief.", store=False)
    assert prompts_sent[3] == prompts_sent[4]
    # the twin: with it back, the prompt differs
    _respond(client, server, input=[remaining[0], whole[1], *remaining[1:]], instructions="Be brief.", store=False)
    assert prompts_sent[5] != prompts_sent[3]


def _as_input(items: list[dict]) -> list[dict]:
    # what a client sends back of listed items
    return [{k: v for k, v in i.items() if k not in ("id", "status")} for i in items]


def test_what_cannot_be_done_is_refused_by_name(client, server):
    conversation = client.conversations.create()
    previous = _respond(client, server, input="Hi.")
    body = {"model": server.model, "input": "Hi.", "conversation": conversation.id, "previous_response_id": previous.id}
    r = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "conversation", r.text
    body = {"model": server.model, "input": "Hi.", "conversation": "conv_" + "0" * 32}
    r = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "conversation", r.text
    too_many = [{"role": "user", "content": str(i)} for i in range(21)]
    with pytest.raises(openai.BadRequestError):
        client.conversations.create(items=too_many)
    with pytest.raises(openai.BadRequestError):
        client.conversations.items.create(conversation.id, items=too_many)
    with pytest.raises(openai.BadRequestError, match="metadata"):
        client.conversations.update(conversation.id, metadata={"k": "v" * 513})
    for path in ("../x", "conv_" + "A" * 32, "resp_" + "0" * 32):
        assert httpx.get(f"{server.base_url}/v1/conversations/{path}", timeout=30).status_code == 404
    # the twin: the conversation alone is served
    assert _respond(client, server, input="Hi.", conversation=conversation.id).conversation.id == conversation.id


def test_a_server_that_keeps_nothing_refuses_conversations_by_name():
    from lightllm.tools.make_tiny_model import tiny_model_dir

    s = LiveServer(model_dir=str(tiny_model_dir("qwen3_5")), device="cpu", max_running_requests=2, responses_store_mb=0)
    try:
        r = httpx.post(f"{s.base_url}/v1/conversations", json={}, timeout=30)
        assert r.status_code == 400 and "--responses_store_mb" in r.text, r.text
        body = {"model": s.model, "input": "Hi.", "conversation": "conv_" + "0" * 32, "max_output_tokens": 2}
        r = httpx.post(f"{s.base_url}/v1/responses", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "conversation", r.text
    finally:
        s.close()


def test_a_background_response_adds_its_turn_when_it_ends(client, server):
    conversation = client.conversations.create(items=[{"role": "user", "content": "Hi."}])
    fields = {"reasoning": {"effort": "none"}, "background": True, "conversation": conversation.id}
    queued = _respond(client, server, input="Count.", **fields)
    assert queued.status == "queued" and queued.conversation.id == conversation.id
    done = client.responses.retrieve(queued.id)
    for _ in range(600):
        if done.status not in ("queued", "in_progress"):
            break
        done = client.responses.retrieve(queued.id)
    assert done.status in ("completed", "incomplete")
    texts = [part.get("text") for item in _items(client, conversation.id) for part in item.get("content", [])]
    assert texts[:2] == ["Hi.", "Count."] and texts[2:] == [part.text for item in done.output for part in item.content]
    # the twin: a cancelled one adds nothing
    long = {
        "text": {"format": {"type": "json_schema", "name": "long", "schema": {"type": "string", "minLength": 5000}}}
    }
    queued = _respond(client, server, input="More.", **{**fields, "max_output_tokens": 1500}, **long)
    client.responses.cancel(queued.id)
    assert len(_items(client, conversation.id)) == 2 + len(done.output)
