"""Stored Responses API responses over HTTP (the fake runner behind a tiny checkpoint's tokenizer and template): a
continuation (`previous_response_id`) is served exactly as the same conversation sent whole; GET returns the
response as it was returned, plain or streamed; input_items lists the conversation in OpenAI's pages; DELETE and
`store: false` leave nothing to continue; a server that keeps no responses refuses continuations by name."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from unit_tests.server.live_server import LiveServer, tiny_checkpoint_server


@pytest.fixture(scope="module", params=[("qwen3_5", "think"), ("kimi_linear", "none")])
def server(request):
    s = tiny_checkpoint_server(*request.param)
    yield s
    s.close()


def _post(server, **fields) -> dict:
    body = {"model": server.model, "max_output_tokens": 12, "temperature": 0.0, **fields}
    r = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _get(server, path: str, **params) -> httpx.Response:
    return httpx.get(f"{server.base_url}/v1/responses/{path}", params=params, timeout=30)


def _as_input(output: list[dict]) -> list[dict]:
    # what a client sends back of an output, as OpenAI's SDKs do: the items whole, ids and statuses included
    return [dict(item) for item in output]


def test_a_continuation_is_the_conversation_sent_whole(server, prompts_sent):
    """Two continuations in a chain give the prompt (and greedy answer) of the three turns sent as one input,
    without the first turn's instructions; the twin continues another response and sees another prompt."""
    first = _post(server, input="Name a prime.", instructions="Answer briefly.")
    second = _post(server, input="And a larger one?", previous_response_id=first["id"])
    third = _post(server, input="Their sum?", previous_response_id=second["id"])
    assert second["previous_response_id"] == first["id"] and third["store"] is True
    whole = [
        {"role": "user", "content": "Name a prime."},
        *_as_input(first["output"]),
        {"role": "user", "content": "And a larger one?"},
        *_as_input(second["output"]),
        {"role": "user", "content": "Their sum?"},
    ]
    explicit = _post(server, input=whole, store=False)
    assert prompts_sent[2] == prompts_sent[3]
    assert explicit["output"][-1]["content"] == third["output"][-1]["content"]
    assert third["usage"]["input_tokens"] == explicit["usage"]["input_tokens"] == len(prompts_sent[3])
    # the first turn's instructions are its own: sent whole with them, the prompt differs
    _post(server, input=whole, instructions="Answer briefly.", store=False)
    assert prompts_sent[4] != prompts_sent[2]
    # the twin: continuing the first response instead of the second drops a turn
    _post(server, input="Their sum?", previous_response_id=first["id"])
    assert prompts_sent[5] != prompts_sent[2] and len(prompts_sent[5]) < len(prompts_sent[2])


def test_get_returns_the_response_as_returned_plain_and_streamed(server):
    plain = _post(server, input="Hello there.")
    r = _get(server, plain["id"])
    assert r.status_code == 200 and r.json() == plain
    body = {"model": server.model, "input": "Hello again.", "max_output_tokens": 12, "temperature": 0.0, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/responses", json=body, timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    done = events[-1]["response"]
    assert events[-1]["type"] in ("response.completed", "response.incomplete") and done["store"] is True
    assert _get(server, done["id"]).json() == done
    # the twin: another response's id gives another response
    assert _get(server, plain["id"]).json() != done


def test_input_items_list_the_conversation_in_pages(server):
    first = _post(server, input=[{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "Hi."}])
    second = _post(server, input="Bye.", previous_response_id=first["id"])
    page = _get(server, f"{second['id']}/input_items", order="asc").json()
    items = page["data"]
    assert page["object"] == "list" and page["has_more"] is False
    assert [i["type"] for i in items[:2]] == ["message", "message"]
    assert items[1]["content"] == [{"type": "input_text", "text": "Hi."}]
    assert items[2 : 2 + len(first["output"])] == first["output"]
    assert items[-1]["content"] == [{"type": "input_text", "text": "Bye."}] and items[-1]["role"] == "user"
    ids = [i["id"] for i in items]
    assert len(set(ids)) == len(ids) and (page["first_id"], page["last_id"]) == (ids[0], ids[-1])
    # newest first by default; pages of two follow `after`
    newest = _get(server, f"{second['id']}/input_items").json()["data"]
    assert [i["id"] for i in newest] == ids[::-1]
    paged, after = [], None
    while True:
        params = {"order": "asc", "limit": 2, **({"after": after} if after else {})}
        page = _get(server, f"{second['id']}/input_items", **params).json()
        paged += [i["id"] for i in page["data"]]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert paged == ids
    r = _get(server, f"{second['id']}/input_items", after="msg_nowhere")
    assert r.status_code == 400 and r.json()["error"]["param"] == "after"


def test_delete_and_store_false_leave_nothing_to_continue(server):
    kept = _post(server, input="Keep this.")
    unkept = _post(server, input="Forget this.", store=False)
    assert unkept["store"] is False and _get(server, unkept["id"]).status_code == 404
    r = httpx.delete(f"{server.base_url}/v1/responses/{kept['id']}", timeout=30)
    assert r.status_code == 200 and r.json() == {"id": kept["id"], "object": "response", "deleted": True}
    assert _get(server, kept["id"]).status_code == 404
    assert httpx.delete(f"{server.base_url}/v1/responses/{kept['id']}", timeout=30).status_code == 404
    for gone in (kept["id"], unkept["id"], "resp_../../etc/passwd"):
        body = {"model": server.model, "input": "More.", "previous_response_id": gone}
        r = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=60)
        assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id", r.text
    # the twin: a response still stored is continued
    assert _post(server, input="More.", previous_response_id=_post(server, input="Again.")["id"])["store"] is True


def test_cancel_names_what_can_be_cancelled(server):
    stored = _post(server, input="Hi.")
    r = httpx.post(f"{server.base_url}/v1/responses/{stored['id']}/cancel", timeout=30)
    assert r.status_code == 400 and "background" in r.json()["error"]["message"]
    r = httpx.post(f"{server.base_url}/v1/responses/resp_{'0' * 32}/cancel", timeout=30)
    assert r.status_code == 404


def test_the_openai_client_continues_and_reads_back(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    first = client.responses.create(model=server.model, input="Hi", max_output_tokens=8, temperature=0)
    second = client.responses.create(
        model=server.model, input="Go on", previous_response_id=first.id, max_output_tokens=8, temperature=0
    )
    assert client.responses.retrieve(second.id).output_text == second.output_text
    listed = client.responses.input_items.list(second.id, order="asc")
    assert [item.type for item in listed.data][-1] == "message" and len(listed.data) == 2 + len(first.output)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_a_server_that_keeps_nothing_refuses_continuations_by_name():
    from lightllm.tools.make_tiny_model import tiny_model_dir

    s = LiveServer(
        model_dir=str(tiny_model_dir("qwen3_5")),
        device="cpu",
        max_running_requests=2,
        max_total_token_num=1024,
        responses_store_mb=0,
    )
    try:
        response = _post(s, input="Hi.")
        assert response["store"] is False and _get(s, response["id"]).status_code == 404
        body = {"model": s.model, "input": "More.", "previous_response_id": response["id"]}
        r = httpx.post(f"{s.base_url}/v1/responses", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
        assert "--responses_store_mb" in r.json()["error"]["message"]
    finally:
        s.close()


def test_truncation_auto_serves_the_turns_that_fit(server, prompts_sent):
    """A conversation longer than the context: refused as it is; with truncation auto, served exactly as its latest
    turns sent alone (the earliest cut that fits beside max_output_tokens); the twin with a longer answer budget
    keeps fewer turns."""
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    turns = []
    for t in range(24):
        text = " ".join(words[(t + i) % len(words)] for i in range(40))
        turns += [{"role": "user", "content": f"{t}: {text}"}, {"role": "assistant", "content": text[::-1]}]
    turns.append({"role": "user", "content": "Sum it up."})
    body = {"model": server.model, "input": turns, "max_output_tokens": 8, "temperature": 0.0, "store": False}
    r = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, "the conversation must be too long for this test"
    prompts_sent.clear()
    truncated = _post(server, **{**body, "truncation": "auto"})
    assert truncated["truncation"] == "auto"
    prompt = prompts_sent[-1]
    assert len(prompt) + 8 <= server.args.max_req_total_len
    # the same prompt as the tail sent alone, from one of the user turns
    starts = [i for i, item in enumerate(turns) if item["role"] == "user"]
    tails = {}
    for cut in starts[::-1]:
        r = httpx.post(f"{server.base_url}/v1/responses", json={**body, "input": turns[cut:]}, timeout=60)
        if r.status_code != 200:
            break
        tails[cut] = prompts_sent[-1]
    earliest = min(tails)
    assert prompt == tails[earliest] and earliest > 0
    # the twin: room for a longer answer leaves fewer turns
    _post(server, **{**body, "truncation": "auto", "max_output_tokens": 400})
    assert len(prompts_sent[-1]) < len(prompt)


def _poll(server, response_id: str, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        response = _get(server, response_id).json()
        if response["status"] not in ("queued", "in_progress") or time.monotonic() > deadline:
            return response
        time.sleep(0.05)


def _running(server) -> float:
    for line in httpx.get(f"{server.base_url}/metrics", timeout=30).text.splitlines():
        if line.startswith("lightllm_num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no lightllm_num_requests_running in /metrics")


def test_a_background_response_is_polled_to_the_answer_a_foreground_one_gives(server):
    queued = _post(server, input="Name a prime.", background=True)
    assert queued["status"] == "queued" and queued["background"] is True and queued["output"] == []
    done = _poll(server, queued["id"])
    foreground = _post(server, input="Name a prime.", store=False)
    assert done["status"] == foreground["status"] != "queued"
    assert [i["content"] for i in done["output"]] == [i["content"] for i in foreground["output"]]
    assert done["usage"] == foreground["usage"]
    # the twin: another question's background answer differs
    other = _poll(server, _post(server, input="Name a composite.", background=True)["id"])
    assert [i["content"] for i in other["output"]] != [i["content"] for i in done["output"]]
    # a finished background response is continued like any other
    assert _post(server, input="Another?", previous_response_id=done["id"])["store"] is True


# an answer that cannot end before max_output_tokens: a JSON string of at least 1000 characters, no reasoning first
LONG = {
    "text": {
        "format": {
            "type": "json_schema",
            "name": "long",
            "schema": {"type": "object", "properties": {"a": {"type": "string", "minLength": 1000}}, "required": ["a"]},
        }
    },
    "reasoning": {"effort": "none"},
}


def test_cancel_stops_a_background_response_and_its_sequences(server):
    body = {"input": "Count slowly.", "background": True, "max_output_tokens": 1500, **LONG}
    queued = _post(server, **body)
    # a response still running cannot be continued yet
    more = {"model": server.model, "input": "More.", "previous_response_id": queued["id"]}
    r = httpx.post(f"{server.base_url}/v1/responses", json=more, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id", r.text
    r = httpx.post(f"{server.base_url}/v1/responses/{queued['id']}/cancel", timeout=30)
    assert r.status_code == 200, r.text
    cancelled = r.json()
    assert cancelled["status"] == "cancelled" and _get(server, queued["id"]).json() == cancelled
    written = sum(len(part["text"]) for item in cancelled["output"] for part in item.get("content", []))
    # the engine stopped it: nothing left running, and far fewer tokens than asked for
    deadline = time.monotonic() + 30
    while _running(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _running(server) == 0 and written < 1500
    # cancelling what has ended answers with it as it is
    again = httpx.post(f"{server.base_url}/v1/responses/{queued['id']}/cancel", timeout=30).json()
    assert again == cancelled
    # the twin: the same request left alone runs to its end
    finished = _poll(server, _post(server, **{**body, "max_output_tokens": 40})["id"])
    assert finished["status"] == "incomplete" and finished["usage"]["output_tokens"] == 40
    # only background responses can be cancelled
    foreground = _post(server, input="Hi.")
    r = httpx.post(f"{server.base_url}/v1/responses/{foreground['id']}/cancel", timeout=30)
    assert r.status_code == 400 and "background" in r.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_background_needs_a_stored_response(server, stream):
    body = {"model": server.model, "input": "Hi.", "background": True, "store": False, "stream": stream}
    r = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "background", r.text


def test_a_store_that_outlives_the_server_keeps_no_running_response(tmp_path):
    """--responses_store_dir: the responses are there after the server stops, and one still running when it
    stopped is marked failed, not left in progress; a finished one is as it was."""
    from lightllm.server.http.response_store import ResponseStore
    from lightllm.tools.make_tiny_model import tiny_model_dir

    s = LiveServer(
        model_dir=str(tiny_model_dir("kimi_linear")),
        device="cpu",
        max_running_requests=2,
        max_total_token_num=4096,
        responses_store_dir=str(tmp_path),
    )
    try:
        finished = _post(s, input="Hi.")
        running = _post(s, input="Count.", background=True, max_output_tokens=1500, **LONG)
        assert _get(s, running["id"]).json()["status"] in ("queued", "in_progress")
    finally:
        s.close()
    store = ResponseStore(str(tmp_path), 2**30)
    assert store.get(finished["id"]).response == finished
    stopped = store.get(running["id"]).response
    assert stopped["status"] == "failed" and "stopped" in stopped["error"]["message"]


def test_input_tokens_counts_the_prompt_a_request_is_served_with(server, prompts_sent):
    """POST /v1/responses/input_tokens (the openai SDK's responses.input_tokens.count): the length of the prompt
    the same request is served with, a continuation's stored conversation included."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    fields = {"input": "Weather in Oslo?", "instructions": "Be brief.", "tools": tools}
    counted = client.responses.input_tokens.count(model=server.model, **fields)
    assert counted.object == "response.input_tokens"
    first = _post(server, **fields)
    assert counted.input_tokens == len(prompts_sent[-1])
    more = {"input": "And in Paris?", "previous_response_id": first["id"]}
    counted_more = client.responses.input_tokens.count(**more)
    _post(server, **more)
    assert counted_more.input_tokens == len(prompts_sent[-1])
    # the twin: without the tools the prompt is shorter
    assert (
        client.responses.input_tokens.count(input=fields["input"], instructions="Be brief.").input_tokens
        < counted.input_tokens
    )
    r = httpx.post(f"{server.base_url}/v1/responses/input_tokens", json={"model": "other", "input": "Hi."}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
