"""Prefill/decode disaggregation as deployed: a pd_master (HTTP front and router, in this process) and a prefill
and a decode node as real processes on 127.0.0.1 (tiny Qwen3.5 with its MTP head, fp32; prefill native, decode
replay, 2 drafts). Through the official openai client: greedy text and logprobs equal a monolithic engine's;
streaming and usage work through the master; concurrent requests with a client disconnect leave every pool on
every node empty; a node with another transfer header is refused (exit 2, the differing field named); a decode
node killed with a request in flight fails it within the transfer timeout while a decode node that joined the
running cluster (compact state mode) serves the other with the monolithic engine's text and logprobs, the prefill node
frees its slot and the master drops the dead node."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import openai
import pytest

from lightllm.engine.sampling_params import SamplingParams
from lightllm.server.llm import LLM
from lightllm.tools.make_tiny_model import tiny_model_dir
from unit_tests.server.conftest import scrape, wait_for
from unit_tests.server.pd_cluster import Master, node_log, stop
from unit_tests.server.pd_cluster import start_node as start_pd_node

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ARCH = "qwen3_5"
MAX_RUNNING = 4
KV_TOKENS = 1024
NODE_FLAGS = [
    "--device",
    "cpu",
    "--mtp_step",
    "2",
    "--max_running_requests",
    str(MAX_RUNNING),
    "--max_total_token_num",
    str(KV_TOKENS),
    "--chunked_prefill_size",
    "16",
]
PROMPTS = [[5, 9, 13, 2, 7, 8, 1, 3, 22, 41, 17, 6, 5, 4, 3, 2, 1, 9, 9, 30, 31], [11, 12, 13, 14, 15]]
# the prefill node gives up on a transfer before the master notices a dead node: its timeout path is the one tested
NODE_TIMEOUT_S = 6.0
TRANSFER_TIMEOUT_S = 2.0


def start_node(master: Master, model_dir: str, role: str, *flags: str):
    return start_pd_node(master, model_dir, role, *NODE_FLAGS, *flags)


@pytest.fixture(scope="module")
def cluster():
    model_dir = str(tiny_model_dir(ARCH))
    master = Master(model_dir, NODE_TIMEOUT_S)
    prefill = start_node(master, model_dir, "prefill", "--pd_transfer_timeout_s", str(TRANSFER_TIMEOUT_S))
    decode = start_node(master, model_dir, "decode", "--ssm_state_mode", "replay")
    procs = [prefill, decode]
    try:
        assert httpx.get(f"{master.url}/pd/ready").status_code == 503
        wait_for(lambda: httpx.get(f"{master.url}/pd/ready").status_code == 200, 120, "both nodes registered")
        yield master, model_dir, procs
    finally:
        for proc in procs:
            stop(proc)
        master.close()


def _client(master: Master) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{master.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _pools_empty(master: Master) -> bool:
    nodes = master.nodes("prefill") + master.nodes("decode")
    return len(nodes) >= 2 and all(
        n["num_requests"] == 0 and n["stats"]["num_running"] == 0 and n["stats"]["num_free_state_slots"] == MAX_RUNNING
        for n in nodes
    )


@pytest.fixture(scope="module")
def expected(cluster):
    """A monolithic engine's greedy outputs (10 tokens, logprobs) for PROMPTS."""
    _, model_dir, _ = cluster
    reference = LLM(
        model_dir,
        device="cpu",
        mtp_step=2,
        max_running_requests=MAX_RUNNING,
        max_total_token_num=KV_TOKENS,
        chunked_prefill_size=16,
    )
    return reference.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, logprobs=1, ignore_eos=True))


def _assert_equal(choice, want) -> None:
    assert choice.text == want.outputs[0].text
    found = choice.logprobs.token_logprobs
    assert len(found) == 10 and max(abs(a - b[0]) for a, b in zip(found, want.outputs[0].logprobs)) < 1e-5


def test_greedy_text_and_logprobs_equal_a_monolithic_engine(cluster, expected):
    master, _, _ = cluster
    client = _client(master)
    for prompt, want in zip(PROMPTS, expected):
        r = client.completions.create(
            model=master.args.served_model_name,
            prompt=prompt,
            max_tokens=10,
            temperature=0,
            logprobs=1,
            extra_body={"ignore_eos": True},
        )
        choice = r.choices[0]
        _assert_equal(choice, want)
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), 10)
        assert choice.finish_reason == "length"
    # one token: the request ends on the prefill node, nothing is transferred
    r = client.completions.create(
        model=master.args.served_model_name, prompt=PROMPTS[0], max_tokens=1, temperature=0, logprobs=1
    )
    assert abs(r.choices[0].logprobs.token_logprobs[0] - expected[0].outputs[0].logprobs[0][0]) < 1e-5
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "length"


def test_streamed_chat_with_usage_equals_the_plain_answer(cluster):
    master, _, _ = cluster
    client = _client(master)
    messages = [{"role": "user", "content": "Say something about state spaces."}]
    plain = client.chat.completions.create(
        model=master.args.served_model_name, messages=messages, max_tokens=12, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=master.args.served_model_name,
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens > 0
    assert httpx.get(f"{master.url}/health").json() == {"status": "ok"}
    assert [m["id"] for m in httpx.get(f"{master.url}/v1/models").json()["data"]] == [master.args.served_model_name]
    assert "lightllm_requests_total" in httpx.get(f"{master.url}/metrics").text


def test_concurrent_requests_and_a_disconnect_leave_every_pool_empty(cluster):
    master, _, _ = cluster

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{master.url}/v1", api_key="unused", max_retries=0)
        model = master.args.served_model_name

        async def full(prompt):
            r = await client.completions.create(
                model=model, prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
            )
            return r.usage.completion_tokens

        async def cut():
            stream = await client.completions.create(
                model=model,
                prompt=PROMPTS[0],
                max_tokens=200,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            async for _ in stream:
                break
            await stream.close()

        results = await asyncio.gather(full(PROMPTS[0]), full(PROMPTS[1]), full([7, 7, 7]), cut())
        await client.close()
        return results

    aborted = 'lightllm_requests_total{finish_reason="abort"}'
    before = scrape(master.url, aborted) if aborted in httpx.get(f"{master.url}/metrics").text else 0.0
    assert asyncio.run(run())[:3] == [24, 24, 24]
    wait_for(lambda: _pools_empty(master), 20, "every pool on every node empty")
    # the disconnected stream was aborted on its nodes, not run to its 200 tokens
    assert scrape(master.url, aborted) == before + 1


def test_a_node_with_another_header_is_refused(cluster):
    master, model_dir, _ = cluster
    proc = start_node(master, model_dir, "decode", "--linear_att_ssm_data_type", "bfloat16")
    proc.wait(timeout=120)
    stderr = node_log(proc)
    assert proc.returncode == 2
    assert "refusing to start" in stderr and "state_dtype: float32 (registered nodes) vs bfloat16 (this node)" in stderr
    assert len(master.nodes("decode")) == 1


def test_a_killed_decode_node_fails_its_request_while_the_others_serve(cluster, expected):
    master, model_dir, procs = cluster
    model = master.args.served_model_name
    # a second decode node joins the running cluster, in compact mode (native -> compact transfers)
    procs.append(start_node(master, model_dir, "decode", "--ssm_state_mode", "compact"))
    # registered and heard from: the master routes to it
    wait_for(lambda: httpx.get(f"{master.url}/pd/ready").json()["decode"] == 2, 120, "a second decode node serving")
    victim = procs[1]
    victim.send_signal(signal.SIGKILL)
    victim.wait()

    async def two_requests():
        # both decode nodes are idle: the first request goes to the first registered (dead) one, the second to
        # the other
        client = openai.AsyncOpenAI(base_url=f"{master.url}/v1", api_key="unused", max_retries=0)
        calls = [
            client.completions.create(
                model=model, prompt=p, max_tokens=10, temperature=0, logprobs=1, extra_body={"ignore_eos": True}
            )
            for p in PROMPTS
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        await client.close()
        return results

    start = time.monotonic()
    results = asyncio.run(two_requests())
    assert time.monotonic() - start < TRANSFER_TIMEOUT_S + 5
    failed = [r for r in results if isinstance(r, Exception)]
    served = [r for r in results if not isinstance(r, Exception)]
    assert len(failed) == 1 and isinstance(failed[0], openai.APIError)
    assert "the decode node did not confirm the transfer within 2 s" in failed[0].message
    assert len(served) == 1 and served[0].usage.completion_tokens == 10
    _assert_equal(served[0].choices[0], expected[results.index(served[0])])
    wait_for(lambda: len(master.nodes("decode")) == 1, NODE_TIMEOUT_S + 5, "the dead decode node dropped")
    assert httpx.get(f"{master.url}/pd/ready").status_code == 200
    wait_for(lambda: _pools_empty(master), 20, "the prefill slot freed, every pool empty")
    for prompt, want in zip(PROMPTS, expected):
        r = _client(master).completions.create(
            model=model, prompt=prompt, max_tokens=10, temperature=0, logprobs=1, extra_body={"ignore_eos": True}
        )
        _assert_equal(r.choices[0], want)


def test_without_nodes_a_request_gets_503_with_the_reason():
    master = Master(str(tiny_model_dir(ARCH)), NODE_TIMEOUT_S, queue_timeout_s=0.5)
    try:
        body = {"model": master.args.served_model_name, "prompt": [1, 2, 3], "max_tokens": 4}
        r = httpx.post(f"{master.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 503
        assert (
            "no prefill and decode node is registered with the pd_master (waited 0.5 s)" in r.json()["error"]["message"]
        )
        assert r.headers["retry-after"] == "1"
        # the master's health says what it can serve: nothing without nodes
        health = httpx.get(f"{master.url}/health")
        assert health.status_code == 503 and health.json() == {
            "status": "no healthy prefill and no healthy decode node"
        }
    finally:
        master.close()
