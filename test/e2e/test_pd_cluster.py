"""Two prefill and two decode nodes as real processes on 127.0.0.1 behind one pd_master (tiny Qwen3.5 with its MTP
head, fp32, 2 drafts; every node in another state mode: prefill native and replay, decode compact and replay).

Greedy text and logprobs equal a monolithic engine's, each node serving its share; 32 concurrent requests, a
random third of them dropped by their client at a random point, leave every pool on every node empty (more
requests than the decode nodes take: the rest wait in the master's queue); when every decode node is full a
request waits, then gets 503 with the reason, and nothing hangs; a prefill node killed with SIGKILL fails the
requests routed to it within the node timeout, the master drops it and routes the next requests to the other, and
a restarted prefill node registers and serves.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time

import httpx
import openai
import pytest

from lightllm.engine.sampling_params import SamplingParams
from lightllm.server.llm import LLM
from lightllm.tools.make_tiny_model import tiny_model_dir
from unit_tests.server.conftest import wait_for
from unit_tests.server.pd_cluster import Master, start_node, stop

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ARCH = "qwen3_5"
MAX_RUNNING = 2
# a decode node's room in the master: running + queued
MAX_QUEUE = 2
KV_TOKENS = 2048
NODE_FLAGS = [
    "--device",
    "cpu",
    "--mtp_step",
    "2",
    "--max_running_requests",
    str(MAX_RUNNING),
    "--max_queue_len",
    str(MAX_QUEUE),
    "--max_total_token_num",
    str(KV_TOKENS),
    "--chunked_prefill_size",
    "16",
]
NODE_MODES = {"prefill": ("native", "replay"), "decode": ("compact", "replay")}
NODE_TIMEOUT_S = 3.0
PROMPTS = [
    [5, 9, 13, 2, 7, 8, 1, 3, 22, 41, 17, 6, 5, 4, 3, 2, 1, 9, 9, 30, 31],
    [11, 12, 13, 14, 15],
    [7, 7, 7],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57],
]


@pytest.fixture(scope="module")
def cluster():
    model_dir = str(tiny_model_dir(ARCH))
    master = Master(model_dir, NODE_TIMEOUT_S, queue_timeout_s=30.0)
    procs = {
        (role, mode): start_node(master, model_dir, role, *NODE_FLAGS, "--ssm_state_mode", mode)
        for role, modes in NODE_MODES.items()
        for mode in modes
    }
    try:
        wait_for(lambda: len(master.nodes("prefill")) == len(master.nodes("decode")) == 2, 180, "4 nodes registered")
        yield master, model_dir, procs
    finally:
        for proc in procs.values():
            stop(proc)
        master.close()


@pytest.fixture(scope="module")
def expected(cluster):
    _, model_dir, _ = cluster
    reference = LLM(
        model_dir,
        device="cpu",
        mtp_step=2,
        max_running_requests=4,
        max_total_token_num=KV_TOKENS,
        chunked_prefill_size=16,
    )
    return reference.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, logprobs=1, ignore_eos=True))


def _async_client(master: Master) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{master.url}/v1", api_key="unused", max_retries=0, timeout=120)


async def _complete(client, master: Master, prompt, max_tokens=10):
    return await client.completions.create(
        model=master.args.served_model_name,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=1,
        extra_body={"ignore_eos": True},
    )


def _assert_equal(choice, want) -> None:
    assert choice.text == want.outputs[0].text
    found = choice.logprobs.token_logprobs
    assert len(found) == 10 and max(abs(a - b[0]) for a, b in zip(found, want.outputs[0].logprobs)) < 1e-5


def _pools_empty(master: Master, num_nodes: int = 4) -> bool:
    nodes = master.nodes("prefill") + master.nodes("decode")
    return len(nodes) == num_nodes and all(
        n["num_requests"] == 0
        and n["stats"]["num_running"] == 0
        and n["stats"]["num_waiting"] == 0
        and n["stats"]["num_free_state_slots"] == MAX_RUNNING
        for n in nodes
    )


def _steps(master: Master) -> dict[str, int]:
    return {n["node_id"]: n["stats"]["num_steps"] for n in master.nodes("prefill") + master.nodes("decode")}


def test_every_node_serves_and_equals_a_monolithic_engine(cluster, expected):
    master, _, _ = cluster

    async def run():
        client = _async_client(master)
        # twice the prompts at once: the least-loaded choice spreads them over both nodes of each kind
        results = await asyncio.gather(*[_complete(client, master, p) for p in PROMPTS + PROMPTS])
        await client.close()
        return results

    before = _steps(master)
    results = asyncio.run(run())
    for r, want in zip(results, expected + expected):
        _assert_equal(r.choices[0], want)
        assert r.usage.completion_tokens == 10
    wait_for(lambda: all(_steps(master)[k] > v for k, v in before.items()), 10, "every node stepped")
    wait_for(lambda: _pools_empty(master), 20, "every pool empty")


def test_32_concurrent_requests_with_random_drops_leave_every_pool_empty(cluster):
    master, _, _ = cluster
    rng = random.Random()
    model = master.args.served_model_name

    async def one(k: int):
        client = _async_client(master)
        prompt = rng.choice(PROMPTS)
        try:
            if rng.random() < 1 / 3:
                # dropped by its client after a random number of streamed chunks (0: before the first)
                stream = await client.completions.create(
                    model=model,
                    prompt=prompt,
                    max_tokens=40,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                cut = rng.randint(0, 8)
                if cut:
                    async for _ in stream:
                        cut -= 1
                        if not cut:
                            break
                await stream.close()
                return None
            r = await client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=rng.randint(2, 24),
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            return r.usage.completion_tokens, r.choices[0].finish_reason
        finally:
            await client.close()

    async def run():
        return await asyncio.gather(*[one(k) for k in range(32)])

    results = asyncio.run(run())
    assert all(r[1] == "length" for r in results if r is not None)
    wait_for(lambda: _pools_empty(master), 30, "every pool on every node empty")


def test_full_decode_nodes_queue_then_503_with_the_reason(cluster):
    master, _, _ = cluster
    model = master.args.served_model_name
    room = 2 * (MAX_RUNNING + MAX_QUEUE)
    master.router.queue_timeout_s = 1.0

    def decode_load() -> int:
        return sum(n["num_requests"] for n in master.nodes("decode"))

    async def endless(client):
        stream = await client.completions.create(
            model=model, prompt=PROMPTS[1], max_tokens=2000, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        async for _ in stream:
            pass

    async def run():
        client = _async_client(master)
        # every decode node's room (running and queued) taken by long streams, then two more requests
        streams = [asyncio.create_task(endless(client)) for _ in range(room)]
        await asyncio.to_thread(wait_for, lambda: decode_load() == room, 30, "the decode nodes full")
        start = time.monotonic()
        extra = await asyncio.gather(*[_complete(client, master, PROMPTS[2]) for _ in range(2)], return_exceptions=True)
        waited = time.monotonic() - start
        assert not any(s.done() for s in streams)
        for s in streams:
            s.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        await client.close()
        return extra, waited

    try:
        extra, waited = asyncio.run(run())
    finally:
        master.router.queue_timeout_s = 30.0
    for exc in extra:
        assert isinstance(exc, openai.APIStatusError) and exc.status_code == 503
        assert "every decode node is full (waited 1 s for room); retry later" in exc.message
    assert 1.0 <= waited < 10
    wait_for(lambda: _pools_empty(master), 30, "every pool empty after the streams were dropped")


def test_a_killed_prefill_node_fails_its_requests_and_a_restarted_one_registers(cluster, expected):
    master, model_dir, procs = cluster
    victim = procs["prefill", "native"]
    victim_id = next(n["node_id"] for n in master.nodes("prefill") if n["pid"] == victim.pid)
    victim.send_signal(signal.SIGKILL)
    victim.wait()

    async def run():
        client = _async_client(master)
        results = await asyncio.gather(*[_complete(client, master, p) for p in PROMPTS], return_exceptions=True)
        await client.close()
        return results

    start = time.monotonic()
    results = asyncio.run(run())
    assert time.monotonic() - start < NODE_TIMEOUT_S + 10
    failed = [r for r in results if isinstance(r, Exception)]
    # the master still counted the dead node until its timeout: what it sent there (half, least-loaded) failed
    assert 1 <= len(failed) < len(PROMPTS)
    for exc in failed:
        assert isinstance(exc, openai.APIError) and "stopped responding" in exc.message
    for r, want in zip(results, expected):
        if not isinstance(r, Exception):
            _assert_equal(r.choices[0], want)
    wait_for(lambda: len(master.nodes("prefill")) == 1, NODE_TIMEOUT_S + 5, "the dead prefill node dropped")
    assert victim_id not in [n["node_id"] for n in master.nodes("prefill")]
    assert httpx.get(f"{master.url}/pd/ready").status_code == 200
    # now every request goes to the live prefill node
    for r, want in zip(asyncio.run(run()), expected):
        _assert_equal(r.choices[0], want)

    survivor = {n["node_id"] for n in master.nodes("prefill")}
    procs["prefill", "native"] = start_node(master, model_dir, "prefill", *NODE_FLAGS, "--ssm_state_mode", "native")
    wait_for(lambda: len(master.nodes("prefill")) == 2, 120, "the restarted prefill node registered")
    # a node takes requests once the master has heard from it
    wait_for(lambda: all(n["healthy"] for n in master.nodes("prefill")), 30, "the restarted prefill node heard")
    (restarted,) = {n["node_id"] for n in master.nodes("prefill")} - survivor
    for r, want in zip(asyncio.run(run()), expected):
        _assert_equal(r.choices[0], want)
    wait_for(lambda: _steps(master)[restarted] > 0, 10, "the restarted node prefilled")
    wait_for(lambda: _pools_empty(master), 20, "every pool empty")
