"""The periodic throughput line: written while there is work (running, waiting, tokens/s), silent when idle."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

from lightllm.engine.messages import EngineStats
from lightllm.server.http.stats_log import log_stats


def _run(client, metrics, produce, caplog) -> list[str]:
    async def main():
        task = asyncio.create_task(log_stats(client, metrics, 0.05))
        for _ in range(4):
            await asyncio.sleep(0.05)
            produce()
        await asyncio.sleep(0.03)
        task.cancel()

    with caplog.at_level(logging.INFO, logger="lightllm.server.stats"):
        asyncio.run(main())
    return [r.getMessage() for r in caplog.records if r.name == "lightllm.server.stats"]


def test_busy_server_logs_running_waiting_and_throughput(caplog):
    client = SimpleNamespace(num_in_flight=3, stats=EngineStats(num_running=2, num_waiting=1, num_free_kv_tokens=77))
    metrics = SimpleNamespace(num_prompt_tokens=0, num_generation_tokens=0)

    def produce():
        metrics.num_generation_tokens += 10

    lines = _run(client, metrics, produce, caplog)
    assert lines and all(line.startswith("running 2, waiting 1, in flight 3 sequences") for line in lines)
    assert "free KV tokens 77" in lines[-1]
    rate = float(lines[-1].split("generation ")[1].split(" tokens/s")[0])
    assert rate > 0


def test_idle_server_logs_nothing(caplog):
    client = SimpleNamespace(num_in_flight=0, stats=EngineStats())
    metrics = SimpleNamespace(num_prompt_tokens=0, num_generation_tokens=0)
    assert _run(client, metrics, lambda: None, caplog) == []
