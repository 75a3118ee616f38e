"""`priority` over HTTP and offline. Under `--scheduling_policy priority` (one running request, slow steps) a request
of a better priority sent while a long one holds the only slot preempts it and finishes first, on both routes, and
the preempted one still returns its whole output; at equal priority it waits (twin). Under fcfs a non-zero
priority is refused with 400 naming it. The offline `LLM` admits its prompts by their priorities."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from lightllm import LLM, SamplingParams
from unit_tests.engine.fake_runner import FakeRunner
from unit_tests.server.live_server import FAKE_RUNNER, LiveServer, slow_server

LONG, SHORT = 80, 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = slow_server(
        tmp_path_factory.mktemp("slow"), max_running_requests=1, max_total_token_num=1024, scheduling_policy="priority"
    )
    yield s
    s.close()


async def _finish_times(server, late_priority: int, route: str) -> dict[str, float]:
    """A long completion at priority 5; once its first tokens stream, a short request at `late_priority` on
    `route`. When each finished (seconds from the start)."""
    start = time.monotonic()
    done: dict[str, float] = {}
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:

        async def long():
            body = {"model": server.model, "prompt": [1, 2, 3], "max_tokens": LONG, "ignore_eos": True}
            body |= {"temperature": 0, "priority": 5, "stream": True}
            text = ""
            async with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        text += json.loads(line[6:])["choices"][0]["text"]
                        started.set()
            done["long"] = time.monotonic() - start
            assert text == server.tokenizer.decode(FakeRunner(server.info.vocab_size).greedy([1, 2, 3], LONG))

        async def short():
            await started.wait()
            body = {"model": server.model, "max_tokens": SHORT, "ignore_eos": True, "priority": late_priority}
            if route == "chat":
                body["messages"] = [{"role": "user", "content": "quick"}]
            else:
                body["prompt"] = [4, 5]
            r = await client.post(f"/v1/{'chat/completions' if route == 'chat' else 'completions'}", json=body)
            assert r.status_code == 200, r.text
            done["short"] = time.monotonic() - start

        started = asyncio.Event()
        await asyncio.gather(long(), short())
    return done


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_better_priority_finishes_first_and_an_equal_one_waits(server, route):
    first = asyncio.run(_finish_times(server, 0, route))
    assert first["short"] < first["long"], first
    equal = asyncio.run(_finish_times(server, 5, route))
    assert equal["short"] > equal["long"], equal


def test_fcfs_refuses_a_priority(tmp_path):
    s = LiveServer(device="cpu", max_total_token_num=512)
    try:
        for route, extra in (
            ("completions", {"prompt": "x"}),
            ("chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ):
            body = {"model": s.model, "max_tokens": 2, **extra}
            r = httpx.post(f"{s.base_url}/v1/{route}", json={**body, "priority": 1})
            assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
            assert "--scheduling_policy" in r.json()["error"]["message"]
            assert httpx.post(f"{s.base_url}/v1/{route}", json={**body, "priority": 0}).status_code == 200
    finally:
        s.close()


def test_offline_llm_admits_prompts_by_priority():
    """One running request at a time: the prompts finish in priority order (arrival order without priorities)."""
    llm = LLM(runner_factory=FAKE_RUNNER, device="cpu", max_running_requests=1, scheduling_policy="priority")
    finished: list[int] = []
    step = llm.engine.step

    def recording_step():
        outputs = step()
        finished.extend(int(o.req_id.split("-")[1]) for o in outputs if type(o).__name__ == "Finished")
        return outputs

    llm.engine.step = recording_step
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompts = [[1, 2], [3, 4], [5, 6], [7, 8]]
    outs = llm.generate(prompts, params, priority=[3, 0, 9, 1])
    assert finished == [1, 3, 0, 2]
    assert [o.outputs[0].token_ids for o in outs] == [FakeRunner(llm.info.vocab_size).greedy(p, 3) for p in prompts]
    finished.clear()
    llm.generate(prompts, params)
    assert finished == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="one integer per prompt"):
        llm.generate(prompts, params, priority=[1])
    llm.close()
    fcfs = LLM(runner_factory=FAKE_RUNNER, device="cpu")
    with pytest.raises(ValueError, match='scheduling_policy="priority"'):
        fcfs.generate([[1, 2]], params, priority=[2])
    fcfs.close()
