"""The full server (HTTP process + engine process + real ModelRunner) on tiny checkpoints, through the official
openai client on 127.0.0.1: greedy text equals transformers' greedy; streaming and concurrency change nothing; a
forced tool call, its result and the answer to it (transformers' greedy over the rendered history)."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import torch

from lightllm.tools.make_tiny_model import tiny_model_dir
from unit_tests.helpers.asserts import ranks_match
from unit_tests.server.conftest import scrape, wait_for
from unit_tests.server.live_server import LiveServer
from unit_tests.server.test_http_tools import NO_THINKING, TOOLS

REAL_RUNNER = "lightllm.server.runner_factory:create_runner"
CONFIGS = [
    ("qwen3_5", {"ssm_state_mode": "replay", "mtp_step": 2}),
    ("qwen3_next", {"ssm_state_mode": "compact", "spec_ngram": 3}),
    ("kimi_linear", {"ssm_state_mode": "native"}),
]
MAX_RUNNING = 6


@pytest.fixture(scope="module", params=CONFIGS, ids=["-".join([a, *(str(v) for v in f.values())]) for a, f in CONFIGS])
def served(request, hf_oracle):
    arch, flags = request.param
    model_dir = str(tiny_model_dir(arch))
    server = LiveServer(
        REAL_RUNNER,
        model_dir=model_dir,
        device="cpu",
        max_running_requests=MAX_RUNNING,
        max_total_token_num=1024,
        chunked_prefill_size=16,
        **flags,
    )
    yield server, hf_oracle(model_dir)
    server.close()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_chat_greedy_matches_transformers(served):
    server, oracle = served
    messages = [{"role": "user", "content": "What is a linear attention layer?"}]
    ids = server.tokenizer.encode_chat(messages)
    eos = list(server.tokenizer.eos_token_ids)
    expected = oracle.greedy(ids, 16, eos_token_id=eos)
    r = _client(server).chat.completions.create(model=server.model, messages=messages, max_tokens=16, temperature=0)
    hidden = [t for t in expected if t not in eos]
    assert r.choices[0].message.content == server.tokenizer.decode(hidden)
    assert r.usage.completion_tokens == len(expected)
    assert r.choices[0].finish_reason == ("stop" if expected[-1] in eos else "length")


def test_completion_stream_equals_transformers(served):
    server, oracle = served
    prompt = "Hybrid models mix"
    expected = oracle.greedy(server.tokenizer.encode(prompt), 20)
    stream = _client(server).completions.create(
        model=server.model, prompt=prompt, max_tokens=20, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == server.tokenizer.decode(expected)


def test_concurrent_streams_equal_one_by_one(served):
    server, _ = served
    prompts = [f"request {i}: " + "tokens " * (i % 7) for i in range(16)]
    lengths = [3 + (i * 5) % 10 for i in range(16)]
    client = _client(server)
    kwargs = dict(model=server.model, temperature=0, extra_body={"ignore_eos": True})
    one_by_one = [
        client.completions.create(prompt=p, max_tokens=n, **kwargs).choices[0].text for p, n in zip(prompts, lengths)
    ]
    aclient = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)

    async def one(prompt: str, n: int) -> str:
        stream = await aclient.completions.create(prompt=prompt, max_tokens=n, stream=True, **kwargs)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def together():
        return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths)))

    assert asyncio.run(together()) == one_by_one
    wait_for(lambda: scrape(server.base_url, "lightllm_free_state_slots") == MAX_RUNNING, what="slots returned")
    assert scrape(server.base_url, "lightllm_free_kv_tokens") == 1024
    mode = server.args.ssm_state_mode
    assert f'lightllm_state_pool_bytes{{mode="{mode}"}}' in httpx.get(f"{server.base_url}/metrics").text


def test_echo_logprobs_score_the_prompt_like_transformers(served):
    """`echo` + `logprobs` on a prompt longer than a prefill chunk: each prompt token's log-probability given the
    tokens before it equals log_softmax of transformers' logits; the first is null."""
    server, oracle = served
    prompt = "Linear attention layers keep a fixed-size state, so a long prompt costs no more memory than a short one."
    ids = server.tokenizer.encode(prompt)
    assert len(ids) > 16, "the prompt must span several prefill chunks (chunked_prefill_size=16)"
    r = _client(server).completions.create(
        model=server.model,
        prompt=prompt,
        max_tokens=2,
        temperature=0,
        echo=True,
        logprobs=3,
        extra_body={"prompt_logprobs": 1},
    )
    lp = r.choices[0].logprobs
    logp = torch.log_softmax(oracle.prefill_logits(ids)[0], dim=-1)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    # vLLM's prompt_logprobs beside the echo: each token's rank there, and the most likely token ranked 1
    ranked = r.choices[0].model_extra["prompt_logprobs"]
    assert ranked[0] is None and len(ranked) == len(ids)
    ranks = [None] + [entry[str(t)]["rank"] for entry, t in zip(ranked[1:], ids[1:])]
    assert ranks_match(ranks, ids, logp) and not ranks_match(ranks, ids, logp, shift=1)
    assert all(entry[str(int(row.argmax()))]["rank"] == 1 for entry, row in zip(ranked[1:], logp))

    def error(shift: int) -> float:
        rows = logp[torch.arange(len(ids) - 1) + shift]
        got = torch.tensor(lp.token_logprobs[1 : len(ids)], dtype=torch.float32)
        tops = [{server.tokenizer.token_text(t) for t in row.topk(3).indices.tolist()} for row in rows]
        if tops != [set(top) for top in lp.top_logprobs[1 : len(ids)]]:
            return float("inf")
        return float((got - rows[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]).abs().max())

    assert error(0) < 1e-4
    # twin: scored against the logits one position later
    assert error(1) > 1e-2


def test_cache_salt_keeps_cached_prefixes_to_its_own_requests(served):
    """A prompt cached under one cache_salt is recomputed for another salt and without a salt (no cached tokens
    reported), and resumed under its own, on completions, chat and responses alike; the text is the same."""
    server, _ = served
    url, salt = f"{server.base_url}/v1", f"salt-{server.args.ssm_state_mode}"
    prompt = "A salted prompt long enough to span several prefill chunks of sixteen tokens, and then some more."
    body = {"model": server.model, "prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True}

    def cached(**extra) -> tuple[int, str]:
        r = httpx.post(f"{url}/completions", json={**body, **extra}, timeout=120).json()
        return r["usage"]["prompt_tokens_details"]["cached_tokens"], r["choices"][0]["text"]

    first = cached(cache_salt=salt)
    other, plain = cached(cache_salt=salt + "-other"), cached()
    assert first[0] == other[0] == plain[0] == 0
    if cached()[0] == 0:
        pytest.skip("this server's checkpoint pool holds no checkpoint (prefix cache off)")
    again = cached(cache_salt=salt)
    assert again[0] > 0 and first[1] == other[1] == plain[1] == again[1]
    messages = [{"role": "user", "content": prompt}]
    chat = {"model": server.model, "messages": messages, "max_tokens": 2, "temperature": 0, **NO_THINKING}
    httpx.post(f"{url}/chat/completions", json={**chat, "cache_salt": salt}, timeout=120).raise_for_status()
    r = httpx.post(f"{url}/chat/completions", json={**chat, "cache_salt": salt}, timeout=120).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    r = httpx.post(f"{url}/chat/completions", json={**chat, "cache_salt": salt + "-chat"}, timeout=120).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    responses = {"model": server.model, "input": prompt, "max_output_tokens": 2, "reasoning": {"effort": "none"}}
    r = httpx.post(f"{url}/responses", json={**responses, "cache_salt": salt + "-responses"}, timeout=120).json()
    assert r["usage"]["input_tokens_details"]["cached_tokens"] == 0
    r = httpx.post(f"{url}/responses", json={**responses, "cache_salt": salt + "-responses"}, timeout=120).json()
    assert r["usage"]["input_tokens_details"]["cached_tokens"] > 0
    bad = httpx.post(f"{url}/completions", json={**body, "cache_salt": ""}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"


def test_tool_call_flow_with_the_real_model(served):
    """The agent flow through the real runner: a forced call (its grammar masks the model's own logits, drafts
    included), the tool's result sent back, and a greedy answer equal to transformers' greedy continuation of the
    chat template's rendering of the whole history."""
    server, oracle = served
    client, tok = _client(server), server.tokenizer
    messages = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    first = client.chat.completions.create(
        model=server.model,
        messages=messages,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=96,
        temperature=0,
        extra_body=NO_THINKING,
    )
    assert first.choices[0].finish_reason == "tool_calls"
    (call,) = first.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and args["city"] in ("Paris", "Oslo") and 1 <= args["days"] <= 7

    result = {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]}, result]
    final = client.chat.completions.create(
        model=server.model,
        messages=messages,
        max_tokens=12,
        temperature=0,
        extra_body={**NO_THINKING, "ignore_eos": True},
    )
    rendered_call = {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": args}}
    history = [messages[0], {"role": "assistant", "content": "", "tool_calls": [rendered_call]}, result]
    ids = tok.encode_rendered(tok.render_chat(history, enable_thinking=False))
    expected = oracle.greedy(ids, 12)
    assert final.usage.prompt_tokens == len(ids)
    assert final.choices[0].message.content == tok.decode(expected)
    # twin: the model's answer to the question alone (no call, no result) is another text
    alone = tok.encode_rendered(tok.render_chat(messages[:1], enable_thinking=False))
    assert tok.decode(oracle.greedy(alone, 12)) != final.choices[0].message.content
