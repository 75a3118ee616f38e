"""The HTTP server over real 127.0.0.1 with the official openai client, engine = fake runner.

The fake model's greedy continuation is known exactly (`FakeRunner.greedy`), so every text can be checked
against a reference computed one request at a time.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from unit_tests.engine.fake_runner import FakeRunner
from unit_tests.server.conftest import scrape, wait_for
from unit_tests.server.live_server import LiveServer

MAX_RUNNING = 6
KV_TOKENS = 1024


@pytest.fixture(scope="module")
def server():
    s = LiveServer(
        device="cpu",
        spec_ngram=3,
        max_running_requests=MAX_RUNNING,
        max_total_token_num=KV_TOKENS,
        chunked_prefill_size=32,
    )
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _expected(server, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], str]:
    ids = FakeRunner(server.info.vocab_size).greedy(prompt_ids, max_tokens)
    return ids, server.tokenizer.decode(ids)


def _prompt(i: int) -> str:
    return " ".join(["word"] * (i % 5 + 1)) + f" number {i} " + "x" * (i * 7 % 40)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [server.model]
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}


def test_completion_greedy_matches_reference(server, client):
    prompt = "The quick brown fox"
    ids = server.tokenizer.encode(prompt)
    expected_ids, expected_text = _expected(server, ids, 30)
    r = client.completions.create(
        model=server.model, prompt=prompt, max_tokens=30, temperature=0, extra_body={"ignore_eos": True}, logprobs=0
    )
    assert r.choices[0].text == expected_text
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 30)
    assert len(r.choices[0].logprobs.token_logprobs) == 30


def test_completion_token_id_prompt(server, client):
    ids = [5, 6, 7, 8]
    _, expected_text = _expected(server, ids, 10)
    r = client.completions.create(
        model=server.model, prompt=ids, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == expected_text


def test_logit_bias_changes_greedy_text_as_the_biased_reference(server, client):
    """The openai client's `logit_bias` (string ids) on completions and streamed chat: the greedy text is the
    fake model's greedy over the biased logits (n-gram drafts verified against them), not the unbiased one."""
    runner = FakeRunner(server.info.vocab_size)
    ids = [5, 6, 7, 8]
    plain = runner.greedy(ids, 12)
    bias = {plain[0]: -100.0, plain[1]: -100.0, (plain[2] + 1) % server.info.vocab_size: 1.5}
    expected = runner.greedy(ids, 12, bias)
    assert expected != plain
    wire = {str(t): v for t, v in bias.items()}
    kwargs = dict(model=server.model, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    r = client.completions.create(prompt=ids, logit_bias=wire, **kwargs)
    assert r.choices[0].text == server.tokenizer.decode(expected)
    unbiased = client.completions.create(prompt=ids, **kwargs)
    assert unbiased.choices[0].text == server.tokenizer.decode(plain)
    messages = [{"role": "user", "content": "bias me"}]
    chat_ids = server.tokenizer.encode_chat(messages)
    chat_bias = {str(runner.greedy(chat_ids, 1)[0]): -100}
    expected_chat = runner.greedy(chat_ids, 12, {int(t): v for t, v in chat_bias.items()})
    chunks = client.chat.completions.create(messages=messages, logit_bias=chat_bias, stream=True, **kwargs)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == server.tokenizer.decode(
        expected_chat
    )


def test_min_tokens_holds_stop_tokens_back_as_the_reference(server, client):
    """min_tokens with stop_token_ids: the fake model's greedy with the stop tokens banned from the first
    min_tokens positions, ending on the first one after (twin: without min_tokens it ends at the first)."""
    runner = FakeRunner(server.info.vocab_size)
    ids = [7, 3, 9]
    free = runner.greedy(ids, 20)
    stops = [free[1], free[4]]
    out = list(ids)
    while len(out) - len(ids) < 20 and (len(out) - len(ids) < 6 or out[-1] not in stops):
        logits = runner.next_logits(out)
        if len(out) - len(ids) < 6:
            logits[stops] = float("-inf")
        out.append(int(logits.argmax()))
    expected = out[len(ids) :]
    kwargs = dict(model=server.model, prompt=ids, max_tokens=20, temperature=0)
    extra = {"ignore_eos": True, "stop_token_ids": stops}
    r = client.completions.create(**kwargs, extra_body={**extra, "min_tokens": 6}, logprobs=0)
    assert len(r.choices[0].logprobs.token_logprobs) == len(expected) > 6
    assert r.choices[0].text == server.tokenizer.decode([t for t in expected if t not in stops])
    early = client.completions.create(**kwargs, extra_body=extra)
    assert early.usage.completion_tokens == 2 and early.choices[0].finish_reason == "stop"


def test_chat_greedy_matches_reference_and_stream(server, client):
    messages = [{"role": "user", "content": "Tell me about 你好 and 😀"}]
    prompt_ids = server.tokenizer.encode_chat(messages)
    _, expected_text = _expected(server, prompt_ids, 25)
    kwargs = dict(model=server.model, messages=messages, max_tokens=25, temperature=0, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kwargs)
    assert r.choices[0].message.content == expected_text
    assert r.usage.prompt_tokens == len(prompt_ids)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected_text
    assert (
        "\ufffd" not in "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        or "\ufffd" in expected_text
    )
    assert chunks[-1].usage.completion_tokens == 25
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_eos_stops_and_is_not_rendered(server, client):
    prompt_ids = [9, 10, 11]
    eos = set(server.tokenizer.eos_token_ids)
    ids = FakeRunner(server.info.vocab_size).greedy(prompt_ids, 200)
    stop_at = next((i for i, t in enumerate(ids) if t in eos), None)
    r = client.completions.create(model=server.model, prompt=prompt_ids, max_tokens=200, temperature=0)
    if stop_at is None:
        assert r.choices[0].finish_reason == "length"
    else:
        assert r.choices[0].finish_reason == "stop"
        assert r.usage.completion_tokens == stop_at + 1
        assert r.choices[0].text == server.tokenizer.decode(ids[:stop_at])


def test_stop_string(server, client):
    prompt = "stop string test"
    _, full = _expected(server, server.tokenizer.encode(prompt), 40)
    stop = full[12:15]
    kwargs = dict(
        model=server.model, prompt=prompt, max_tokens=40, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    r = client.completions.create(**kwargs)
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    assert streamed == full[: full.index(stop)]
    # include_stop_str_in_output: the text ends with the stop string (the twin above ends before it)
    kwargs["extra_body"] = {"ignore_eos": True, "include_stop_str_in_output": True}
    with_stop = full[: full.index(stop) + len(stop)]
    assert client.completions.create(**kwargs).choices[0].text == with_stop
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    assert streamed == with_stop


def test_n_choices_seeded_reproducible(server, client):
    kwargs = dict(
        model=server.model,
        prompt="sample me",
        max_tokens=12,
        temperature=1.0,
        n=3,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert a.usage.completion_tokens == 36


def test_concurrent_streams_equal_one_by_one(server):
    prompts = [_prompt(i) for i in range(16)]
    lengths = [5 + (i * 13) % 50 for i in range(16)]
    expected = [_expected(server, server.tokenizer.encode(p), n)[1] for p, n in zip(prompts, lengths)]
    aclient = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)

    async def one(prompt: str, n: int) -> str:
        stream = await aclient.completions.create(
            model=server.model, prompt=prompt, max_tokens=n, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_at_once():
        return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths)))

    assert asyncio.run(all_at_once()) == expected
    wait_for(lambda: scrape(server.base_url, "lightllm_free_state_slots") == MAX_RUNNING, what="slots returned")
    assert scrape(server.base_url, "lightllm_free_kv_tokens") == KV_TOKENS


@pytest.mark.parametrize(
    "path, body, param, fragment",
    [
        ("completions", {"model": "other", "prompt": "x"}, "model", "not served here"),
        ("completions", {"model": "M", "prompt": "x", "max_tokens": -3}, "max_tokens", "greater than or equal to 1"),
        ("completions", {"model": "M", "prompt": "x", "temperature": "hot"}, "temperature", "valid number"),
        ("completions", {"model": "M", "prompt": "x", "top_p": 0}, "top_p", "greater than 0"),
        ("completions", {"model": "M", "prompt": [100000]}, "prompt", "token ids must be in"),
        ("completions", {"model": "M", "prompt": "a " * 1100}, "prompt", "max_req_total_len"),
        ("completions", {"model": "M", "prompt": "x", "max_tokens": 5000}, "max_tokens", "exceeds max_req_total_len"),
        ("completions", {"model": "M", "prompt": ""}, "prompt", "empty"),
        ("completions", {"prompt": "x"}, "model", "Field required"),
        ("chat/completions", {"model": "M", "messages": []}, "messages", "at least 1"),
        (
            "chat/completions",
            {"model": "M", "messages": [{"role": "wizard", "content": "x"}]},
            "messages.0.role",
            "Input should be",
        ),
        (
            "chat/completions",
            {"model": "M", "messages": [{"role": "user", "content": "x"}], "n": 100},
            "n",
            "less than",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) and " " in v else None,
)
def test_bad_requests_get_400_with_field(server, path, body, param, fragment):
    body = {k: (server.model if v == "M" else v) for k, v in body.items()}
    r = httpx.post(f"{server.base_url}/v1/{path}", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and fragment in error["message"]


@pytest.mark.parametrize(
    "raw, fragment",
    [(b'{"model": "x", "prompt": ', "not valid JSON"), (b'{"model": "\xff\xfe"}', "UTF-8"), (b"[1, 2]", "JSON object")],
    ids=["truncated-json", "invalid-utf8", "not-an-object"],
)
def test_malformed_bodies_get_400(server, raw, fragment):
    r = httpx.post(f"{server.base_url}/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and fragment in r.json()["error"]["message"]


def test_server_still_serves_after_bad_requests(server, client):
    r = client.completions.create(model=server.model, prompt="still alive", max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_metrics_report_requests_tokens_and_speculation(server):
    text = httpx.get(f"{server.base_url}/metrics").text
    for name in [
        "lightllm_requests_total",
        "lightllm_generation_tokens_total",
        "lightllm_time_to_first_token_seconds_bucket",
        "lightllm_inter_token_latency_seconds_bucket",
        "lightllm_num_requests_waiting",
        "lightllm_spec_acceptance_length_windows",
    ]:
        assert name in text
    assert scrape(server.base_url, "lightllm_spec_draft_tokens_total") > 0


def test_logprobs_chat_format(server, client):
    r = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert json.dumps(r.model_dump())


def test_allowed_token_ids_keep_greedy_text_to_them(server, client):
    """vLLM's allowed_token_ids on completions and chat: the fake model's greedy over the allowed tokens alone
    (n-gram drafts verified against them); twin: without the field the text leaves the set."""
    runner = FakeRunner(server.info.vocab_size)
    ids = [5, 6, 7, 8]
    plain = runner.greedy(ids, 12)
    allowed = sorted(set(plain[1:]) | set(range(3, server.info.vocab_size, 7)) - {plain[0]})
    outside = {t: -1e9 for t in range(server.info.vocab_size) if t not in allowed}
    expected = runner.greedy(ids, 12, outside)
    assert expected != plain and set(expected) <= set(allowed)
    kwargs = dict(model=server.model, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    r = client.completions.create(
        prompt=ids,
        extra_body={"ignore_eos": True, "allowed_token_ids": allowed},
        **{k: v for k, v in kwargs.items() if k != "extra_body"},
    )
    assert r.choices[0].text == server.tokenizer.decode(expected)
    assert client.completions.create(prompt=ids, **kwargs).choices[0].text == server.tokenizer.decode(plain)


def _spellings(server, word: str) -> list[list[int]]:
    return [server.tokenizer.encode_rendered(t) for t in (word, " " + word)]


def test_bad_words_never_end_the_output_and_change_only_what_they_ban(server, client):
    """A word of the greedy continuation, sent as bad_words: the output follows the fake model's greedy with each
    spelling's last token banned where the output ends with the rest, so the word's tokens never appear; twin:
    without bad_words they do."""
    runner = FakeRunner(server.info.vocab_size)
    ids = [9, 4, 4, 1]
    plain = runner.greedy(ids, 16)
    word = server.tokenizer.decode(plain[3:5]).strip()
    assert word, plain
    spellings = _spellings(server, word)
    out: list[int] = []
    for _ in range(16):
        bias = {
            s[-1]: -1e9
            for s in spellings
            if len(s) == 1 or (len(out) >= len(s) - 1 and out[len(out) - len(s) + 1 :] == s[:-1])
        }
        out.append(runner.greedy(ids + out, 1, bias)[0])
    assert out != plain
    kwargs = dict(model=server.model, max_tokens=16, temperature=0)
    r = client.completions.create(prompt=ids, extra_body={"ignore_eos": True, "bad_words": [word]}, **kwargs)
    assert r.choices[0].text == server.tokenizer.decode(out)
    for s in spellings:
        assert not any(out[i : i + len(s)] == s for i in range(len(out)))
    free = client.completions.create(prompt=ids, extra_body={"ignore_eos": True}, **kwargs)
    assert free.choices[0].text == server.tokenizer.decode(plain)


@pytest.mark.parametrize(
    "extra, field, message",
    [
        ({"allowed_token_ids": [1, 10**6]}, "allowed_token_ids", "allowed_token_ids must be in [0,"),
        ({"allowed_token_ids": []}, "allowed_token_ids", "at least 1"),
        ({"bad_words": ["  "]}, "bad_words.0", "pattern"),
        ({"bad_words": ["ab " * 200]}, "bad_words", "tokens long; at most 64"),
        (
            {"allowed_token_ids": [3, 4], "response_format": {"type": "json_object"}},
            "allowed_token_ids",
            "cannot be combined with constrained output",
        ),
    ],
)
def test_bad_token_rules_get_400_naming_the_field(server, extra, field, message):
    body = {"model": server.model, "prompt": "hi", "max_tokens": 4, **extra}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and message in error["message"], error


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(server, client):
    """vLLM's return_tokens_as_token_ids: completion (with echo) and chat logprobs name every token, alternatives
    included, `token_id:{id}` (the fake model's greedy ids); the text and offsets are unchanged. Twin: without the
    field the tokens are texts."""
    runner = FakeRunner(server.info.vocab_size)
    ids = [5, 6, 7, 8]
    expected = runner.greedy(ids, 6)
    kw = dict(model=server.model, prompt=ids, max_tokens=6, temperature=0, logprobs=2, echo=True)
    plain = client.completions.create(extra_body={"ignore_eos": True}, **kw).choices[0]
    named = client.completions.create(extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}, **kw)
    named = named.choices[0]
    assert named.logprobs.tokens == [f"token_id:{t}" for t in ids + expected]
    assert named.text == plain.text and named.logprobs.text_offset == plain.logprobs.text_offset
    assert named.logprobs.token_logprobs == plain.logprobs.token_logprobs
    assert all(k.startswith("token_id:") for top in named.logprobs.top_logprobs[1:] for k in top)
    assert plain.logprobs.tokens != named.logprobs.tokens
    messages = [{"role": "user", "content": "name them"}]
    chat_ids = runner.greedy(server.tokenizer.encode_chat(messages), 5)
    for stream in (False, True):
        r = client.chat.completions.create(
            model=server.model,
            messages=messages,
            max_tokens=5,
            temperature=0,
            logprobs=True,
            top_logprobs=1,
            stream=stream,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        )
        content = (
            r.choices[0].logprobs.content
            if not stream
            else [e for c in r if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        )
        assert [e.token for e in content] == [f"token_id:{t}" for t in chat_ids]
        assert [bytes(e.bytes) for e in content] == [server.tokenizer.token_bytes(t) for t in chat_ids]
