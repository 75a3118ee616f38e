"""The prefix cache through the real server (HTTP process + engine process + real runner, tiny Qwen3.5 with MTP,
replay mode): a 4-turn chat resumes each turn from the conversation so far and answers exactly as a cold offline
engine (cache disabled) does, with `usage.prompt_tokens_details.cached_tokens` telling how much was resumed;
completions (plain and streamed) report it too, and /metrics counts the hits."""

from __future__ import annotations

import random

import numpy as np
import openai
import pytest

from lightllm.engine.sampling_params import SamplingParams
from lightllm.server.llm import LLM
from lightllm.tools.make_tiny_model import tiny_model_dir
from unit_tests.server.conftest import scrape, wait_for
from unit_tests.server.live_server import LiveServer

REAL_RUNNER = "lightllm.server.runner_factory:create_runner"
FLAGS = dict(
    device="cpu",
    ssm_state_mode="replay",
    mtp_step=2,
    max_running_requests=4,
    max_total_token_num=1024,
    chunked_prefill_size=16,
    prefix_cache_checkpoint_interval=32,
)


@pytest.fixture(scope="module")
def served():
    server = LiveServer(
        REAL_RUNNER, model_dir=str(tiny_model_dir("qwen3_5")), prefix_cache_state_bytes=64 * 20_000, **FLAGS
    )
    cold = LLM(str(tiny_model_dir("qwen3_5")), disable_prefix_cache=True, **FLAGS)
    yield server, cold
    server.close()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_four_turn_chat_resumes_every_turn_and_equals_the_cold_run(served):
    server, cold = served
    rng = random.Random(3)
    words = "state token cache prefix linear attention replay native compact decode verify fold".split()
    messages = [{"role": "system", "content": "You answer in one short line."}]
    previous_history = 0
    for turn in range(4):
        messages.append({"role": "user", "content": " ".join(rng.choice(words) for _ in range(6))})
        r = _client(server).chat.completions.create(
            model=server.model, messages=messages, max_tokens=8, temperature=0, logprobs=True
        )
        (want,) = cold.chat(messages, SamplingParams(temperature=0, max_tokens=8, logprobs=0))
        assert want.num_cached_tokens == 0
        assert r.choices[0].message.content == want.outputs[0].text
        np.testing.assert_allclose(
            [c.logprob for c in r.choices[0].logprobs.content], [lp for lp, _ in want.outputs[0].logprobs], atol=1e-5
        )
        # each turn resumes where the conversation before its opened assistant turn ended, one turn earlier (the
        # template renders a past answer without the opened turn's reasoning block, so that is the shared prefix)
        assert r.usage.prompt_tokens_details.cached_tokens == previous_history
        ids = server.tokenizer.encode_chat(messages)
        previous_history = server.tokenizer.history_len(messages, ids)
        assert (turn == 0 or previous_history > 0) and previous_history < len(ids)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    assert previous_history > 60, "the conversation should have grown"


def test_completions_report_cached_tokens_plain_and_streamed(served):
    """An exact repeat resumes before its last token (the second occurrence already hits); the next turn (prompt +
    answer + new tokens) resumes at the answer's end but its last token, which was sampled and never fed; a prompt
    extending that turn by one token resumes after the turn's last token (a hit with a short rest prefills it)."""
    server, cold = served
    rng = random.Random(8)
    prompt = [rng.randrange(1, 500) for _ in range(40)]
    client = _client(server)
    params = SamplingParams(temperature=0, max_tokens=3)
    answer = cold.generate([prompt], params)[0].outputs[0].token_ids
    before = scrape(server.base_url, "lightllm_prefix_cache_hit_tokens_total")
    first = client.completions.create(model=server.model, prompt=prompt, max_tokens=3, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    repeat = client.completions.create(model=server.model, prompt=prompt, max_tokens=3, temperature=0)
    assert repeat.usage.prompt_tokens_details.cached_tokens == 39
    assert repeat.choices[0].text == first.choices[0].text == cold.generate([prompt], params)[0].outputs[0].text
    turn = prompt + answer + [7, 8, 9]
    second = client.completions.create(model=server.model, prompt=turn, max_tokens=3, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens == 40 + 3 - 1
    assert second.choices[0].text == cold.generate([turn], params)[0].outputs[0].text
    stream = client.completions.create(
        model=server.model,
        prompt=turn + [10],
        max_tokens=3,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    # the previous request's prefill end: it resumed with a short rest, so it fed all its 46 tokens in its prefill
    assert len(usage) == 1 and usage[0].prompt_tokens_details.cached_tokens == 46
    # engine statistics reach /metrics shortly after the requests finish
    wait_for(
        lambda: scrape(server.base_url, "lightllm_prefix_cache_hit_tokens_total") >= before + 39 + 42 + 46,
        what="the hit tokens on /metrics",
    )
    assert scrape(server.base_url, "lightllm_prefix_cache_checkpoints_stored_total") > 0
    assert scrape(server.base_url, "lightllm_prefix_cache_checkpoint_bytes") > 0


def test_offline_request_output_reports_cached_tokens():
    llm = LLM(str(tiny_model_dir("qwen3_5")), prefix_cache_state_bytes=16 * 20_000, **FLAGS)
    prompt = [random.Random(4).randrange(1, 500) for _ in range(30)]
    params = SamplingParams(temperature=0, max_tokens=3)
    first, repeat = llm.generate([prompt], params)[0], llm.generate([prompt], params)[0]
    turn = prompt + first.outputs[0].token_ids + [5, 6]
    second = llm.generate([turn], params)[0]
    assert (first.num_cached_tokens, repeat.num_cached_tokens, second.num_cached_tokens) == (0, 29, 32)
    assert repeat.outputs[0].token_ids == first.outputs[0].token_ids
    assert "prefix cache:" in llm.engine.capacity_report()
