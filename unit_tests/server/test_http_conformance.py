"""OpenAI conformance against the live server (fake runner), judged by the official openai client: usage, logprobs
bytes and keys, echo with prompt logprobs (against the fake model), /v1/models, docs off by default, and vLLM's
/tokenize, /detokenize, /version."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
import torch

import lightllm
from unit_tests.engine.fake_runner import FakeRunner
from unit_tests.server.live_server import LiveServer

MESSAGES = [{"role": "user", "content": "name the request"}]


@pytest.fixture(scope="module")
def server():
    s = LiveServer(device="cpu", max_running_requests=8, max_total_token_num=2048, chunked_prefill_size=64)
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_completion_usage_counts_each_prompt_once(server, client, n):
    ids = server.tokenizer.encode("count me once")
    r = client.completions.create(
        model=server.model, prompt="count me once", max_tokens=4, n=n, seed=1, extra_body={"ignore_eos": True}
    )
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 4 * n)
    two = client.completions.create(model=server.model, prompt=["count me once", "and me"], max_tokens=2, n=n)
    # twin: a second prompt does add its tokens
    assert two.usage.prompt_tokens == len(ids) + len(server.tokenizer.encode("and me"))


def _fragment(text: str) -> bool:
    return text.startswith("bytes:")


def test_chat_logprobs_carry_each_tokens_own_bytes(server, client):
    r = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "bytes please"}],
        max_tokens=24,
        temperature=0,
        logprobs=True,
        top_logprobs=20,
        # special tokens rendered too, so the text is exactly the tokens' bytes
        extra_body={"ignore_eos": True, "skip_special_tokens": False},
    )
    content = r.choices[0].logprobs.content
    items = [*content, *(alt for c in content for alt in c.top_logprobs)]
    for item in items:
        raw = bytes(item.bytes)
        if _fragment(item.token):
            assert item.token == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        else:
            assert raw.decode("utf-8") == item.token
    fragments = [i for i in items if _fragment(i.token)]
    assert fragments, "no fragment token among the alternatives: the check above proved nothing"
    assert all(bytes(i.bytes) != "\ufffd".encode() for i in fragments)
    # the chosen tokens' bytes are the reply
    joined = b"".join(bytes(c.bytes) for c in content).decode("utf-8", errors="replace")
    assert joined == r.choices[0].message.content
    assert joined != r.choices[0].message.content + "x"


def test_completion_top_logprobs_keep_every_alternative(server, client):
    r = client.completions.create(
        model=server.model,
        prompt="many keys",
        max_tokens=16,
        temperature=0,
        logprobs=20,
        extra_body={"ignore_eos": True},
    )
    tops = r.choices[0].logprobs.top_logprobs
    # fragments are spelled by their bytes, so 20 alternatives are 20 keys
    assert [len(t) for t in tops] == [20] * 16
    assert any(_fragment(k) for t in tops for k in t)


def _prompt_scores(server, ids: list[int], shift: int = 0) -> list[tuple[float, dict[str, float]] | None]:
    """The fake model's log-probability of each prompt token given the tokens before it (of the logits one position
    later with `shift`), and its top 2 alternatives keyed by token text; None for the first token."""
    ref, tok = FakeRunner(server.info.vocab_size), server.tokenizer
    scores: list[tuple[float, dict[str, float]] | None] = [None]
    for p in range(1, len(ids)):
        logp = torch.log_softmax(ref.next_logits(ids[: min(p + shift, len(ids))]), dim=-1)
        top = torch.topk(logp, 2)
        scores.append(
            (float(logp[ids[p]]), {tok.token_text(t): v for t, v in zip(top.indices.tolist(), top.values.tolist())})
        )
    return scores


def _scores_match(token_logprobs, top_logprobs, expected) -> bool:
    for lp, top, exp in zip(token_logprobs, top_logprobs, expected, strict=True):
        if exp is None:
            if lp is not None or top is not None:
                return False
        elif abs(lp - exp[0]) > 1e-5 or top.keys() != exp[1].keys():
            return False
        elif any(abs(top[k] - v) > 1e-5 for k, v in exp[1].items()):
            return False
    return True


def test_echo_with_logprobs_scores_the_prompt(server, client):
    prompt = "echo this prompt back"
    ids = server.tokenizer.encode(prompt)
    assert len(ids) >= 3
    kw = dict(model=server.model, prompt=prompt, max_tokens=5, temperature=0, echo=True, logprobs=2)
    r = client.completions.create(**kw, extra_body={"ignore_eos": True})
    choice = r.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(prompt)
    assert len(lp.tokens) == len(ids) + 5
    n = len(ids)
    assert _scores_match(lp.token_logprobs[:n], lp.top_logprobs[:n], _prompt_scores(server, ids))
    # twin: the scores of the position after each token are not its scores
    assert not _scores_match(lp.token_logprobs[:n], lp.top_logprobs[:n], _prompt_scores(server, ids, shift=1))
    assert all(isinstance(v, float) for v in lp.token_logprobs[n:])
    assert lp.text_offset[0] == 0 and lp.text_offset[n] == len(prompt)
    assert lp.text_offset == sorted(lp.text_offset)
    assert "".join(lp.tokens[:n]) == prompt
    # streamed, with two sequences: each choice opens with the echo and the same prompt scores
    streamed = list(client.completions.create(stream=True, n=2, seed=3, **kw, extra_body={"ignore_eos": True}))
    events = [c.choices[0] for c in streamed if c.choices]
    for index in (0, 1):
        mine = [e for e in events if e.index == index]
        assert mine[0].text == prompt
        assert mine[0].logprobs.token_logprobs == lp.token_logprobs[:n]
        assert mine[0].logprobs.top_logprobs == lp.top_logprobs[:n]
        assert mine[1].logprobs.text_offset[0] == len(prompt)
        assert "".join(e.text for e in mine) == choice.text
    # twin: without echo, offsets start at 0 and no prompt entries come back
    plain = client.completions.create(**{**kw, "echo": False}, extra_body={"ignore_eos": True}).choices[0].logprobs
    assert plain.text_offset[0] == 0 and len(plain.tokens) == 5
    assert plain.token_logprobs == lp.token_logprobs[n:]


def _ranked_reference(server, ids: list[int], num_top: int, shift: int = 0) -> list[dict | None]:
    """vLLM's prompt_logprobs for `ids` under the fake model (the logits one position later with `shift`): the rank is
    the token's place in the descending sort."""
    ref, tok = FakeRunner(server.info.vocab_size), server.tokenizer
    out: list[dict | None] = [None]
    for p in range(1, len(ids)):
        logp = torch.log_softmax(ref.next_logits(ids[: min(p + shift, len(ids))]), dim=-1)
        order = torch.argsort(logp, descending=True).tolist()
        entry = {str(ids[p]): (float(logp[ids[p]]), order.index(ids[p]) + 1, tok.token_text(ids[p]))}
        entry.update((str(t), (float(logp[t]), r + 1, tok.token_text(t))) for r, t in enumerate(order[:num_top]))
        out.append(entry)
    return out


def _ranked_match(got: list, expected: list) -> bool:
    if len(got) != len(expected):
        return False
    for g, e in zip(got, expected):
        if (g is None) != (e is None):
            return False
        if e is None:
            continue
        if list(g) != list(e):
            return False
        for key, (logprob, rank, text) in e.items():
            item = g[key]
            if abs(item["logprob"] - logprob) > 1e-5 or item["rank"] != rank or item["decoded_token"] != text:
                return False
    return True


def test_prompt_logprobs_as_vllm_returns_them(server):
    """`prompt_logprobs: k` on both routes: per prompt token its log-probability, rank and decoded text, and the k
    most likely tokens ranked 1..k, against the fake model; an echo with fewer logprobs keeps its own count; with
    stream it is refused."""
    url, tok = f"{server.base_url}/v1", server.tokenizer
    prompts = ["score every token of this", "and of this one"]
    kw = dict(model=server.model, max_tokens=3, temperature=0, ignore_eos=True)
    r = httpx.post(f"{url}/completions", json={**kw, "prompt": prompts, "n": 2, "prompt_logprobs": 3}, timeout=60)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 4
    for choice in choices:
        ids = tok.encode(prompts[choice["index"] // 2])
        assert _ranked_match(choice["prompt_logprobs"], _ranked_reference(server, ids, 3))
        # twin: the logits one position later
        assert not _ranked_match(choice["prompt_logprobs"], _ranked_reference(server, ids, 3, shift=1))
    # at least one prompt token is not its position's most likely: the ranks are read, not assumed
    assert any(e[str(t)]["rank"] > 1 for e, t in zip(choices[0]["prompt_logprobs"][1:], tok.encode(prompts[0])[1:]))
    # an echo with one alternative beside three ranked ones: each keeps its own count
    echo = httpx.post(
        f"{url}/completions",
        json={**kw, "prompt": prompts[0], "echo": True, "logprobs": 1, "prompt_logprobs": 3},
        timeout=60,
    ).json()["choices"][0]
    ids = tok.encode(prompts[0])
    assert [len(t) for t in echo["logprobs"]["top_logprobs"][1 : len(ids)]] == [1] * (len(ids) - 1)
    assert _ranked_match(echo["prompt_logprobs"], _ranked_reference(server, ids, 3))
    messages = [{"role": "user", "content": "rank my prompt"}]
    chat = httpx.post(f"{url}/chat/completions", json={**kw, "messages": messages, "prompt_logprobs": 0}, timeout=60)
    assert chat.status_code == 200, chat.text
    ids = tok.encode_chat(messages)
    assert _ranked_match(chat.json()["prompt_logprobs"], _ranked_reference(server, ids, 0))
    # without the field, no key
    assert "prompt_logprobs" not in httpx.post(f"{url}/chat/completions", json={**kw, "messages": messages}).json()
    for route, body in (("completions", {"prompt": "x"}), ("chat/completions", {"messages": messages})):
        bad = httpx.post(f"{url}/{route}", json={**kw, **body, "prompt_logprobs": 2, "stream": True}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs", bad.text
        too_many = httpx.post(f"{url}/{route}", json={**kw, **body, "prompt_logprobs": 21}, timeout=60)
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt_logprobs"


def _sse_chunks(server, route: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.base_url}/v1/{route}", json={**body, "stream": True}, timeout=60) as r:
        lines = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_return_token_ids_as_vllm_returns_them(server):
    """`return_token_ids`: the prompt's ids (per completion choice; at the top of a chat response) and each choice's
    generated ids, the fake model's greedy tokens; streamed, the prompt's ids in the first chunk only and each
    chunk's own tokens, which add up to the plain response's. Twin: without the field, no ids."""
    url, tok, ref = f"{server.base_url}/v1", server.tokenizer, FakeRunner(server.info.vocab_size)
    prompts = ["give me tokens", "and more of them"]
    body = {"model": server.model, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    plain = httpx.post(f"{url}/completions", json={**body, "prompt": prompts, "n": 2}, timeout=60).json()["choices"]
    for choice in plain:
        ids = tok.encode(prompts[choice["index"] // 2])
        assert choice["prompt_token_ids"] == ids and choice["token_ids"] == ref.greedy(ids, 6)
        assert choice["text"] == tok.decode(choice["token_ids"])
    chunks = _sse_chunks(server, "completions", {**body, "prompt": prompts, "n": 2})
    for choice in plain:
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == choice["index"]]
        assert mine[0]["prompt_token_ids"] == choice["prompt_token_ids"]
        assert all("prompt_token_ids" not in c for c in mine[1:])
        assert [t for c in mine for t in c["token_ids"]] == choice["token_ids"]
    messages = [{"role": "user", "content": "ids please"}]
    chat_body = {**body, "messages": messages}
    chat = httpx.post(f"{url}/chat/completions", json=chat_body, timeout=60).json()
    ids = tok.encode_chat(messages)
    assert chat["prompt_token_ids"] == ids and chat["choices"][0]["token_ids"] == ref.greedy(ids, 6)
    chunks = _sse_chunks(server, "chat/completions", chat_body)
    assert chunks[0]["prompt_token_ids"] == ids and all("prompt_token_ids" not in c for c in chunks[1:])
    streamed = [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids", [])]
    assert streamed == chat["choices"][0]["token_ids"]
    off = {**body, "return_token_ids": False}
    assert "token_ids" not in httpx.post(f"{url}/completions", json={**off, "prompt": "x"}).json()["choices"][0]
    assert "prompt_token_ids" not in httpx.post(f"{url}/chat/completions", json={**off, "messages": messages}).json()


def test_request_id_names_the_response(server, client):
    """vLLM's `request_id` makes the response's id (every chunk's too); without it each response gets a fresh one."""
    kw = dict(model=server.model, max_tokens=2, temperature=0)
    r = client.completions.create(prompt="x", extra_body={"request_id": "job-7"}, **kw)
    assert r.id == "cmpl-job-7"
    chunks = list(
        client.chat.completions.create(messages=MESSAGES, stream=True, extra_body={"request_id": "job-8"}, **kw)
    )
    assert {c.id for c in chunks} == {"chatcmpl-job-8"}
    ids = {client.completions.create(prompt="x", **kw).id for _ in range(2)}
    assert len(ids) == 2 and all(i.startswith("cmpl-") and "job" not in i for i in ids)


def test_echo_without_logprobs_streams_the_prompt_first(server, client):
    prompt = "echo this prompt back"
    kw = dict(model=server.model, prompt=prompt, max_tokens=3, temperature=0, echo=True)
    streamed = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    assert streamed[0].text == prompt and streamed[0].logprobs is None
    assert all(c.logprobs is None for c in streamed)
    assert client.completions.create(**kw).choices[0].text == "".join(c.text for c in streamed)


def test_models_created_is_the_start_time(server):
    first = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["created"]
    time.sleep(1.1)
    again = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["created"]
    assert first == again and first <= time.time()


def test_a_model_is_retrieved_by_its_served_name_and_no_other(server, client):
    listed = client.models.list().data[0]
    retrieved = client.models.retrieve(server.model)
    assert retrieved.model_dump() == listed.model_dump() and retrieved.id == server.model
    r = httpx.get(f"{server.base_url}/v1/models/{server.model}-not")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert httpx.get(f"{server.base_url}/v1/models/org/{server.model}").status_code == 404


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json"])
def test_docs_are_off_by_default(server, path):
    assert httpx.get(f"{server.base_url}{path}").status_code == 404
    assert httpx.get(f"{server.base_url}/version").status_code == 200


def test_tokenize_detokenize_version(server):
    base = server.base_url
    r = httpx.post(f"{base}/tokenize", json={"model": server.model, "prompt": "hello tokens"}).json()
    assert r["tokens"] == server.tokenizer.encode("hello tokens") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == server.args.max_req_total_len
    assert r["tokens"] != httpx.post(f"{base}/tokenize", json={"prompt": "hello token"}).json()["tokens"]
    messages = [{"role": "user", "content": "hi"}]
    chat = httpx.post(f"{base}/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == server.tokenizer.encode_chat(messages)
    text = httpx.post(f"{base}/detokenize", json={"tokens": r["tokens"]}).json()["prompt"]
    assert text == "hello tokens"
    bad = httpx.post(f"{base}/detokenize", json={"tokens": [2**40]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(f"{base}/tokenize", json={"prompt": "x", "messages": messages})
    assert both.status_code == 400
    assert httpx.get(f"{base}/version").json() == {"version": lightllm.__version__}


def test_error_bodies_are_openai_shaped(server):
    r = httpx.post(f"{server.base_url}/v1/completions", json={"model": server.model, "prompt": "x", "n": "2"})
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == 400
    assert "Traceback" not in json.dumps(error)


# fields OpenAI's API marks nullable, sent as null by clients that mean "not set"
NULLED = {"n": None, "stream": None, "stream_options": None, "logprobs": None, "max_tokens": None, "seed": None}


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_null_fields_take_their_defaults(server, route):
    body = {"model": server.model, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    if route == "chat":
        url, body["messages"], extra = "chat/completions", [{"role": "user", "content": "nulls"}], {"echo": None}
        extra |= {"parallel_tool_calls": None, "add_generation_prompt": None, "top_logprobs": None}
    else:
        url, body["prompt"], extra = "completions", "nulls", {"echo": None, "suffix": None}

    def text(r: httpx.Response) -> str:
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert len(choices) == 1
        return choices[0]["message"]["content"] if route == "chat" else choices[0]["text"]

    plain = text(httpx.post(f"{server.base_url}/v1/{url}", json=body))
    nulled = {**body, **extra, **{k: v for k, v in NULLED.items() if k != "max_tokens"}}
    assert text(httpx.post(f"{server.base_url}/v1/{url}", json=nulled)) == plain
    # max_tokens: null is "no limit here" (the context's room), not the 6 above
    unbounded = httpx.post(f"{server.base_url}/v1/{url}", json={**nulled, "max_tokens": None}).json()
    assert unbounded["usage"]["completion_tokens"] > 6
    # twin: a required field's null is still refused, naming it
    for required in ("model", "messages" if route == "chat" else "prompt"):
        r = httpx.post(f"{server.base_url}/v1/{url}", json={**body, required: None})
        assert r.status_code == 400 and r.json()["error"]["param"] == required, (required, r.text)
