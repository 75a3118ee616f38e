"""A throughput line in the log every few seconds while the server has work: running, waiting, tokens/s."""

from __future__ import annotations

import asyncio
import logging
import time

from lightllm.server.http.engine_client import EngineClient
from lightllm.server.http.metrics import Metrics

logger = logging.getLogger("lightllm.server.stats")


async def log_stats(client: EngineClient, metrics: Metrics, interval_s: float) -> None:
    """Runs until cancelled; silent while idle so an idle server's log stays quiet."""
    last_time, last_prompt, last_gen = time.monotonic(), metrics.num_prompt_tokens, metrics.num_generation_tokens
    while True:
        await asyncio.sleep(interval_s)
        now = time.monotonic()
        prompt, gen = metrics.num_prompt_tokens, metrics.num_generation_tokens
        stats = client.stats
        busy = client.num_in_flight or stats.num_running or stats.num_waiting or gen != last_gen
        if busy:
            elapsed = max(now - last_time, 1e-9)
            logger.info(
                "running %d, waiting %d, in flight %d sequences; prompt %.1f tokens/s, generation %.1f tokens/s; "
                "free KV tokens %d",
                stats.num_running,
                stats.num_waiting,
                client.num_in_flight,
                (prompt - last_prompt) / elapsed,
                (gen - last_gen) / elapsed,
                stats.num_free_kv_tokens,
            )
        last_time, last_prompt, last_gen = now, prompt, gen
