"""Serving benchmark over the OpenAI HTTP API of a running server (in the manner of `vllm bench serve`).

    python -m lightllm.tools.bench_serving --base_url http://127.0.0.1:8000 --dataset random \
        --num_prompts 256 --max_concurrency 64 --input_len 256 --output_len 128 [--request_rate 8] \
        [--result_file out.json] [--plot out.png] [--num_workers 4]
    python -m lightllm.tools.bench_serving --dataset multi_turn --num_prompts 32 --num_turns 4 ...

`random`: prompts of `--input_len` random token ids (completions API, exact lengths). `multi_turn`: chat
conversations; each turn sends the whole conversation so far (system prompt, earlier questions and the model's
answers) plus a new question, so a prefix cache can serve everything but the new turn. Every request streams
with `ignore_eos` and a fixed `max_tokens`, so output lengths are exact. Prints TTFT, TPOT and ITL (mean, median,
p99), request and token throughput, and the mean accepted length of speculative windows read from `/metrics`
before and after the run; writes every request's timings as JSON and a PNG of latencies over the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import random
import ssl
import time
from dataclasses import asdict, dataclass, field

import httpx
import msgspec
import numpy as np
from tqdm import tqdm

from lightllm.tools.png_plot import scatter_png


@dataclass
class RequestResult:
    start_s: float
    ok: bool
    ttft_s: float = 0.0
    latency_s: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    # gaps between consecutive streamed chunks after the first
    itl_s: list[float] = field(default_factory=list)
    error: str = ""
    # tokens the server reports as served from its prefix cache, when it reports them
    cached_tokens: int = 0


_JSON = msgspec.json.Decoder()


async def _sse_data(response: httpx.Response):
    """The `data:` payload of each server-sent event, as bytes. Lines end at LF, CRLF or CR (the SSE grammar;
    httpx's `aiter_lines` also ends them at U+2028 and friends inside the JSON). Parsed from raw chunks, without a
    str per line: the client's CPU per streamed event must stay well below the server's, or the client's own
    backlog shows up as the server's latency."""
    pending = b""
    async for chunk in response.aiter_bytes():
        lines = (pending + chunk).replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        pending = lines.pop()
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].lstrip(b" ")
    if pending.startswith(b"data:"):
        yield pending[5:].lstrip(b" ")


async def _stream(client: httpx.AsyncClient, url: str, body: dict, start: float) -> tuple[RequestResult, str]:
    """One streamed request; returns its timings and the generated text."""
    result, text, last = RequestResult(start_s=start, ok=False), [], None
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return result, ""
            async for data in _sse_data(r):
                if data == b"[DONE]":
                    continue
                chunk = _JSON.decode(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message"))
                    return result, ""
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    result.prompt_tokens = usage["prompt_tokens"]
                    result.output_tokens = usage["completion_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens") or 0
                for choice in chunk.get("choices", []):
                    piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    now = time.perf_counter()
                    if last is None:
                        result.ttft_s = now - t0
                    else:
                        result.itl_s.append(now - last)
                    last = now
                    text.append(piece)
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result, ""
    result.latency_s = time.perf_counter() - t0
    result.ok = last is not None
    return result, "".join(text)


WORDS = "the a state model token cache prefix linear attention replay native compact decode verify fold".split()


def _random_jobs(a, token_pool: list[int]) -> list[list[dict]]:
    """Prompts of exactly `input_len` token ids drawn from `token_pool` (ids the server's tokenizer produced)."""
    rng = np.random.default_rng(a.seed)
    pool = np.asarray(token_pool)
    return [[{"prompt": rng.choice(pool, size=a.input_len).tolist()}] for _ in range(a.num_prompts)]


def _token_pool(base_url: str, model: str, seed: int) -> list[int]:
    rnd = random.Random(seed)
    text = " ".join(rnd.choice(WORDS) + str(rnd.randrange(1000)) for _ in range(400))
    r = httpx.post(f"{base_url}/tokenize", json={"model": model, "prompt": text}, timeout=60)
    r.raise_for_status()
    return sorted(set(r.json()["tokens"]))


def _multi_turn_jobs(a) -> list[list[dict]]:
    rnd = random.Random(a.seed)
    words = WORDS
    system = " ".join(rnd.choice(words) for _ in range(a.input_len))
    jobs = []
    for _ in range(a.num_prompts):
        turns = [" ".join(rnd.choice(words) for _ in range(max(4, a.input_len // 8))) for _ in range(a.num_turns)]
        jobs.append([{"system": system, "question": q} for q in turns])
    return jobs


async def _conversation(client, a, model: str, turns: list[dict], start: float, out: list, bar) -> None:
    """Run one job's turns in order (a random job has one turn)."""
    messages = []
    for turn in turns:
        common = {
            "model": model,
            "max_tokens": a.output_len,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if "prompt" in turn:
            url, body = f"{a.base_url}/v1/completions", {**common, "prompt": turn["prompt"]}
        else:
            if not messages:
                messages.append({"role": "system", "content": turn["system"]})
            messages.append({"role": "user", "content": turn["question"]})
            url, body = f"{a.base_url}/v1/chat/completions", {**common, "messages": list(messages)}
        result, text = await _stream(client, url, body, time.perf_counter() - start)
        out.append(result)
        bar.update(1)
        if not result.ok:
            return
        messages.append({"role": "assistant", "content": text})


async def _run(
    a, model: str, jobs: list[list[dict]], concurrency: int, rate: float, start_at: float | None = None, bar=True
) -> tuple[list[RequestResult], float]:
    """Run `jobs` with at most `concurrency` in flight (arrivals at `rate` per second; 0: all at once). Times are
    relative to the wall-clock `start_at` (waited for; default now), which the workers of one run share."""
    results: list[RequestResult] = []
    rng = np.random.default_rng(a.seed)
    progress = tqdm(total=sum(len(j) for j in jobs), desc="requests", unit="req", disable=not bar)
    # one client (one kept-alive connection) per slot of the concurrency: httpcore assigns a pool's requests to its
    # connections by scanning all of both, which cost ~13 ms of the client's CPU per request at 64 connections
    # in one pool, enough to spread the first 256 requests of a run over a second; they share one TLS context
    # (loading the CA store takes ~25 ms)
    tls = ssl.create_default_context()
    slots: asyncio.Queue[httpx.AsyncClient] = asyncio.Queue()
    for _ in range(concurrency):
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        slots.put_nowait(httpx.AsyncClient(timeout=httpx.Timeout(a.timeout_s), limits=limits, verify=tls))
    try:
        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.time()))
        # perf_counter's reading at the shared start
        start = time.perf_counter() - (0.0 if start_at is None else time.time() - start_at)

        async def one(turns):
            client = await slots.get()
            try:
                await _conversation(client, a, model, turns, start, results, progress)
            finally:
                slots.put_nowait(client)

        tasks = []
        for turns in jobs:
            tasks.append(asyncio.create_task(one(turns)))
            if rate > 0:
                # Poisson arrivals at the given rate (requests or conversations per second)
                await asyncio.sleep(float(rng.exponential(1.0 / rate)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    finally:
        while not slots.empty():
            await slots.get_nowait().aclose()
    progress.close()
    return results, elapsed


def _worker(a, index: int, model: str, jobs: list[list[dict]], concurrency: int, start_at: float, conn) -> None:
    """Client process `index` of `--num_workers`: its share of the jobs, concurrency and arrival rate (its own
    arrival times)."""
    a = argparse.Namespace(**{**vars(a), "seed": a.seed + index})
    results, elapsed = asyncio.run(
        _run(a, model, jobs, concurrency, a.request_rate / a.num_workers, start_at, bar=False)
    )
    conn.send(([asdict(r) for r in results], elapsed))
    conn.close()


def _run_workers(a, model: str, jobs: list[list[dict]]) -> tuple[list[RequestResult], float]:
    """The jobs dealt round-robin to `--num_workers` client processes (one Python client parses a few thousand
    streamed events a second: at high concurrency one process would measure itself), started together."""
    n = a.num_workers
    ctx = mp.get_context("spawn")
    start_at = time.time() + 3.0 + 0.5 * n
    procs, pipes = [], []
    for i in range(n):
        share = a.max_concurrency // n + (i < a.max_concurrency % n)
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_worker, args=(a, i, model, jobs[i::n], max(share, 1), start_at, send), daemon=True)
        proc.start()
        procs.append(proc)
        pipes.append(recv)
    results, elapsed = [], 0.0
    for proc, recv in zip(procs, pipes):
        rows, worker_elapsed = recv.recv()
        results += [RequestResult(**r) for r in rows]
        elapsed = max(elapsed, worker_elapsed)
        proc.join()
    return results, elapsed


def _spec_counters(base_url: str) -> tuple[float, float]:
    """(drafted windows, accepted draft tokens) from the server's /metrics; zeros when absent."""
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return 0.0, 0.0
    values = {}
    for line in text.splitlines():
        if line.startswith(("lightllm_spec_windows_total ", "lightllm_spec_accepted_tokens_total ")):
            name, value = line.split()
            values[name] = float(value)
    return values.get("lightllm_spec_windows_total", 0.0), values.get("lightllm_spec_accepted_tokens_total", 0.0)


def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean_ms": None, "median_ms": None, "p99_ms": None}
    arr = np.asarray(values) * 1000
    return {"mean_ms": float(arr.mean()), "median_ms": float(np.median(arr)), "p99_ms": float(np.percentile(arr, 99))}


# a gap between streamed events longer than this many median TPOTs counts as a stall (the serving target's bound)
STALL_TPOTS = 4
# the run is cut into this many equal windows to say when the stalls happened
STALL_WINDOWS = 10


def itl_stalls(results: list[RequestResult], elapsed_s: float, tpot_median_s: float) -> dict:
    """The gaps between streamed events longer than `STALL_TPOTS` median TPOTs: how many, their share of all gaps,
    and how many ended in each tenth of the run (a tail made by the first wave of prefills sits in the first
    windows; one spread over the run is the steady state's)."""
    bound = STALL_TPOTS * tpot_median_s
    windows = [0] * STALL_WINDOWS
    num_gaps = num_stalls = 0
    for r in results:
        at = r.start_s + r.ttft_s
        for gap in r.itl_s:
            at += gap
            num_gaps += 1
            if gap > bound:
                num_stalls += 1
                windows[min(int(at / max(elapsed_s, 1e-9) * STALL_WINDOWS), STALL_WINDOWS - 1)] += 1
    return {
        "bound_ms": bound * 1000,
        "num_stalls": num_stalls,
        "share": num_stalls / num_gaps if num_gaps else 0.0,
        "by_window": windows,
    }


def summarize(results: list[RequestResult], elapsed_s: float, spec_before, spec_after) -> dict:
    ok = [r for r in results if r.ok]
    tpot = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    windows = spec_after[0] - spec_before[0]
    accepted = spec_after[1] - spec_before[1]
    return {
        "num_requests": len(results),
        "num_failed": len(results) - len(ok),
        "duration_s": elapsed_s,
        "request_throughput": len(ok) / elapsed_s,
        "output_token_throughput": sum(r.output_tokens for r in ok) / elapsed_s,
        "total_token_throughput": sum(r.output_tokens + r.prompt_tokens for r in ok) / elapsed_s,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
        "ttft": _stats([r.ttft_s for r in ok]),
        "tpot": _stats(tpot),
        "itl": _stats([g for r in ok for g in r.itl_s]),
        "itl_stalls": itl_stalls(ok, elapsed_s, float(np.median(tpot)) if tpot else 0.0),
        # ITL is the gap between streamed events; a token whose text is empty (or held back) streams none
        "tokens_per_event": sum(r.output_tokens for r in ok) / max(sum(len(r.itl_s) + 1 for r in ok), 1),
        "mean_accepted_len": 1.0 + accepted / windows if windows else None,
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m lightllm.tools.bench_serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--base_url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    p.add_argument("--dataset", default="random", choices=("random", "multi_turn"))
    p.add_argument("--num_prompts", type=int, default=64, help="requests (random) or conversations (multi_turn)")
    p.add_argument("--num_turns", type=int, default=4)
    p.add_argument("--input_len", type=int, default=256)
    p.add_argument("--output_len", type=int, default=128)
    p.add_argument("--max_concurrency", type=int, default=64)
    p.add_argument("--request_rate", type=float, default=0.0, help="arrivals per second (0: all at once)")
    p.add_argument("--timeout_s", type=float, default=600.0)
    p.add_argument(
        "--num_workers", type=int, default=1, help="client processes sharing the requests (for high concurrency)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result_file", default=None, help="JSON with the summary and every request")
    p.add_argument("--plot", default=None, help="PNG of TTFT and TPOT over the run")
    a = p.parse_args(argv)
    if a.num_workers < 1:
        p.error(f"--num_workers must be >= 1, got {a.num_workers}")
    return a


def _print(s: dict) -> None:
    print(f"requests {s['num_requests']} (failed {s['num_failed']}) in {s['duration_s']:.2f} s")
    print(
        f"request throughput {s['request_throughput']:.2f} req/s; output {s['output_token_throughput']:.1f} tok/s; "
        f"total {s['total_token_throughput']:.1f} tok/s; cached prompt tokens {s['cached_prompt_tokens']}"
        f" of {s['prompt_tokens']}"
    )
    print("| metric | mean ms | median ms | p99 ms |\n|---|---|---|---|")
    for name in ("ttft", "tpot", "itl"):
        v = s[name]
        cells = ["-" if v[k] is None else f"{v[k]:.2f}" for k in ("mean_ms", "median_ms", "p99_ms")]
        print(f"| {name.upper()} | {' | '.join(cells)} |")
    print(f"output tokens per streamed event: {s['tokens_per_event']:.2f}")
    st = s["itl_stalls"]
    print(
        f"ITL gaps over {STALL_TPOTS}x TPOT median ({st['bound_ms']:.1f} ms): {st['num_stalls']} "
        f"({100 * st['share']:.2f}%), by tenth of the run: {' '.join(map(str, st['by_window']))}"
    )
    accepted = s["mean_accepted_len"]
    print(f"mean accepted length: {'-' if accepted is None else f'{accepted:.3f}'}")
    for e in s["errors"]:
        print(f"error: {e}")


def main(argv: list[str] | None = None) -> dict:
    a = _parse(argv)
    cards = httpx.get(f"{a.base_url}/v1/models", timeout=30).json()["data"]
    model = a.model or cards[0]["id"]
    if a.dataset == "random":
        jobs = _random_jobs(a, _token_pool(a.base_url, model, a.seed))
    else:
        jobs = _multi_turn_jobs(a)
    before = _spec_counters(a.base_url)
    if a.num_workers > 1:
        results, elapsed = _run_workers(a, model, jobs)
    else:
        results, elapsed = asyncio.run(_run(a, model, jobs, a.max_concurrency, a.request_rate))
    summary = summarize(results, elapsed, before, _spec_counters(a.base_url))
    _print(summary)
    if a.result_file:
        with open(a.result_file, "w") as f:
            json.dump({"args": vars(a), "summary": summary, "requests": [asdict(r) for r in results]}, f, indent=1)
    if a.plot:
        ok = [r for r in results if r.ok]
        scatter_png(
            a.plot,
            [
                ("TTFT", [(r.start_s, r.ttft_s * 1000) for r in ok], (220, 60, 40)),
                (
                    "TPOT",
                    [(r.start_s, (r.latency_s - r.ttft_s) / max(r.output_tokens - 1, 1) * 1000) for r in ok],
                    (40, 90, 220),
                ),
            ],
        )
    return summary


if __name__ == "__main__":
    main()
