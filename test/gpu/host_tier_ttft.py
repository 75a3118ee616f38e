"""Host tier timing on one GPU: two data-parallel replicas (engines) on one device sharing one host tier, the
second request of a shared prefix forced to the other replica.

    python test/gpu/host_tier_ttft.py                          # the serving checkpoint on one GPU
    python test/gpu/host_tier_ttft.py --modes native,replay --prefix_len 8192
    python test/gpu/host_tier_ttft.py --tiny --device cpu      # a dry run of this script without a GPU

The checkpoint is the serving benchmark's random-weight Qwen3.5 at real width (`serving_model_dir` of
`lightllm.tools.bench_throughput`), built once and cached. Two engines (replica 0 and replica 1) are built in
this process on the same device, each with `--max_total_token_num` tokens of KV (the same split `--dp 2` makes of
one GPU: half the KV each), both attached to one host-tier arena in /dev/shm, the one a `--dp 2` server creates.

`ttft` (per state mode; `MODE+mtp` adds `--mtp_step 2`; replica 1 runs `--reader_mode` when given, else the same
mode): each repeat draws a fresh `--prefix_len`-token prefix (8192) and sends it with a `--suffix_len`-token suffix
(100) to replica 0 (cold: nothing cached anywhere), then the prefix with another suffix to replica 0 (device hit),
then with a third suffix to replica 1 (host hit: its device cache never saw the prefix). Time to first token is
from `add_request` to the step that emits the token, alone in the engine; medians over `--repeats` after one
untimed round. Targets: host hit within 2x of the device hit, and at least 5x faster than cold.

`http` (per state mode): the same three requests over HTTP to a real `--dp 2` server (two engine processes on the
GPU, each with half of `--mem_fraction`, one host tier) with `--dp_balancer round_robin`, which alternates the
replicas: cold on one replica, host hit on the other, device hit on the first again. Time to first token is to the
first streamed chunk; the cached tokens come from the stream's usage.

`bandwidth`: for prefixes of `--bandwidth_lens` tokens, the bytes of one host entry (KV of the prefix + the
state checkpoint), the seconds to write it (device -> shared memory, `RunnerHostTier.save`) and to resume a
request from it (lookup, copy out, import into the device: `add_request`), as GB/s.

Rows print as they finish; `--result_file` gets every row as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (HERE.parents[1], HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402
from prefix_cache_ttft import checkpoint, parse_mode, time_to_first_token  # noqa: E402
from smoke_serving_gpu import start_server, stop_server, wait_healthy  # noqa: E402

RUNNER = "lightllm.server.runner_factory:create_runner"
TINY = dict(
    prefix_len=128, suffix_len=12, interval=32, chunk=128, kv_tokens=2048, state_bytes=1 << 22, bandwidth_lens="64,128"
)


def ttft_row(part: str, mode: str, reader: str, a, cold, device, host, cached) -> dict:
    """One row of medians (ms) of the three requests' time to first token over the timed repeats, and their
    ratios."""
    row = {
        "part": part,
        "mode": mode,
        "reader_mode": reader,
        "prefix_len": a.prefix_len,
        "suffix_len": a.suffix_len,
        "cold_ms": 1e3 * statistics.median(cold),
        "device_hit_ms": 1e3 * statistics.median(device),
        "host_hit_ms": 1e3 * statistics.median(host),
        "host_cached_tokens": min(cached),
    }
    row["host_vs_device"] = row["host_hit_ms"] / row["device_hit_ms"]
    row["cold_vs_host"] = row["cold_ms"] / row["host_hit_ms"]
    return row


def build(model_dir: str, a, arena_name: str, **mode):
    from lightllm.server.args import load_server_args
    from lightllm.server.engine_process import build_engine

    flags = dict(
        model_dir=model_dir,
        max_running_requests=4,
        max_req_total_len=max(a.prefix_len + a.suffix_len, *a.lens) + 16,
        max_total_token_num=a.kv_tokens,
        # room for every checkpoint of a round: the device hit must find the prefix's on the device
        prefix_cache_state_bytes=a.state_bytes,
        host_tier_name=arena_name,
        **mode,
    )
    if a.device != "auto":
        flags["device"] = a.device
    if a.interval:
        flags["prefix_cache_checkpoint_interval"] = a.interval
    if a.chunk:
        flags["chunked_prefill_size"] = a.chunk
    args, info = load_server_args([], **flags)
    return build_engine(args, info, RUNNER), info.vocab_size


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def ttft_rows(model_dir: str, a, arena, emit) -> None:
    rng = random.Random(a.seed)
    for mode in a.modes.split(","):
        reader = a.reader_mode or mode
        replicas = [build(model_dir, a, arena.name, **parse_mode(m))[0] for m in (mode, reader)]
        vocab = replicas[0].runner.vocab_size

        def tokens(n: int, vocab: int = vocab) -> list[int]:
            return [rng.randrange(1, vocab) for _ in range(n)]

        cold, device, host, cached = [], [], [], []
        for r in range(a.repeats + 1):
            prefix = tokens(a.prefix_len)
            c, _ = time_to_first_token(replicas[0], f"c{r}", prefix + tokens(a.suffix_len))
            host_before = replicas[0].runner.prefix_cache_stats()["host_hit_tokens"]
            d, m = time_to_first_token(replicas[0], f"d{r}", prefix + tokens(a.suffix_len))
            if m == 0 or replicas[0].runner.prefix_cache_stats()["host_hit_tokens"] != host_before:
                raise RuntimeError(f"the same-replica request was no device hit ({m} cached): raise --state_bytes")
            h, n = time_to_first_token(replicas[1], f"h{r}", prefix + tokens(a.suffix_len))
            if r:
                cold.append(c)
                device.append(d)
                host.append(h)
                cached.append(n)
        emit(ttft_row("ttft", mode, reader, a, cold, device, host, cached))
        del replicas
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def stream_ttft(port: int, model: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first streamed chunk of a one-token completion, and the cached tokens of its usage."""
    import httpx

    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start, first, cached = time.perf_counter(), None, 0
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if first is None and chunk.get("choices"):
                first = time.perf_counter() - start
            usage = chunk.get("usage")
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return first, cached


def http_rows(model_dir: str, a, emit) -> None:
    import tempfile

    import httpx

    rng = random.Random(a.seed + 2)
    log_dir = tempfile.mkdtemp(prefix="host-tier-http-")
    for mode in a.modes.split(","):
        flags = [
            "--dp",
            "2",
            "--dp_balancer",
            "round_robin",
            "--max_req_total_len",
            str(a.prefix_len + a.suffix_len + 16),
        ]
        flags += [f"--{k}={v}" for k, v in parse_mode(mode).items()]
        if a.interval:
            flags += ["--prefix_cache_checkpoint_interval", str(a.interval)]
        if a.chunk:
            flags += ["--chunked_prefill_size", str(a.chunk)]
        if a.tiny:
            flags += ["--max_total_token_num", str(a.kv_tokens), "--host_tier_gb", str(a.host_tier_gb)]
        device = "cuda" if a.device == "auto" else a.device
        proc, port = start_server(model_dir, device, flags, f"{log_dir}/{mode}.log")
        try:
            wait_healthy(proc, port, a.start_timeout)
            model = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()["data"][0]["id"]
            vocab = a.vocab
            cold, host, device_hit, cached = [], [], [], []
            for r in range(a.repeats + 1):
                prefix = [rng.randrange(1, vocab) for _ in range(a.prefix_len)]
                # round robin: replica x, then the other one, then x again
                c, _ = stream_ttft(port, model, prefix + [rng.randrange(1, vocab) for _ in range(a.suffix_len)])
                h, n = stream_ttft(port, model, prefix + [rng.randrange(1, vocab) for _ in range(a.suffix_len)])
                d, _ = stream_ttft(port, model, prefix + [rng.randrange(1, vocab) for _ in range(a.suffix_len)])
                if r:
                    cold.append(c)
                    host.append(h)
                    device_hit.append(d)
                    cached.append(n)
            emit(ttft_row("http", mode, mode, a, cold, device_hit, host, cached))
        finally:
            stop_server(proc)


def bandwidth_rows(model_dir: str, a, arena, emit) -> None:
    from lightllm.cache.host_tier.slots import free_record

    rng = random.Random(a.seed + 1)
    mode = parse_mode(a.modes.split(",")[0])
    writer, vocab = build(model_dir, a, arena.name, **mode)
    reader, _ = build(model_dir, a, arena.name, **mode)
    for n in a.lens:
        writes, reads, nbytes = [], [], 0
        for r in range(a.repeats + 1):
            prompt = [rng.randrange(1, vocab) for _ in range(n + 1)]
            time_to_first_token(writer, f"w{n}-{r}", prompt)
            cache = writer.runner.prefix_cache
            node, depth = cache.cache.tree.deepest(torch.tensor(prompt[:n]).numpy(), lambda x: x.checkpoint is not None)
            assert depth == n, f"no checkpoint at {n} tokens (at {depth})"
            tier = cache.host.tier
            # rewrite the entry the publish wrote, timed
            with arena.locked():
                for index in range(arena.max_entries):
                    if int(arena.entries[index]["num_tokens"]) == n and int(arena.entries[index]["state"]):
                        free_record(arena, index)
            sync()
            t0 = time.perf_counter()
            assert cache.host.save(node)
            sync()
            write_s = time.perf_counter() - t0
            ticket = tier.lookup(prompt[:n], n - 1)
            nbytes = ticket.shard_bytes
            t0 = time.perf_counter()
            handle = reader.runner.add_request(prompt)
            sync()
            read_s = time.perf_counter() - t0
            assert reader.runner.num_tokens(handle) == n, "the reader did not resume from the host tier"
            reader.runner.free_request(handle)
            reader.runner.evict_prefix_cache()
            if r:
                writes.append(write_s)
                reads.append(read_s)
        w, rd = statistics.median(writes), statistics.median(reads)
        emit(
            {
                "part": "bandwidth",
                "tokens": n,
                "entry_mib": nbytes / 2**20,
                "write_ms": 1e3 * w,
                "read_ms": 1e3 * rd,
                "write_gb_s": nbytes / w / 1e9,
                "read_gb_s": nbytes / rd / 1e9,
            }
        )


def print_row(row: dict) -> None:
    if row["part"] in ("ttft", "http"):
        print(
            f"{row['part']} {row['mode']:>12} -> {row['reader_mode']:<12} prefix {row['prefix_len']} + {row['suffix_len']}: "
            f"cold {row['cold_ms']:.1f} ms, device hit {row['device_hit_ms']:.1f} ms, host hit "
            f"{row['host_hit_ms']:.1f} ms ({row['host_cached_tokens']} cached) | host/device "
            f"{row['host_vs_device']:.2f}x (target <= 2), cold/host {row['cold_vs_host']:.1f}x (target >= 5)",
            flush=True,
        )
    else:
        print(
            f"bandwidth {row['tokens']:>6} tokens, entry {row['entry_mib']:.1f} MiB: write {row['write_ms']:.2f} ms "
            f"({row['write_gb_s']:.1f} GB/s), resume {row['read_ms']:.2f} ms ({row['read_gb_s']:.1f} GB/s)",
            flush=True,
        )


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="ttft,http,bandwidth", help="comma-separated: ttft, http, bandwidth")
    p.add_argument("--modes", default="native,replay,compact+mtp", help="state modes of replica 0 (the writer)")
    p.add_argument("--reader_mode", default=None, help="state mode of replica 1 (default: the writer's)")
    p.add_argument("--prefix_len", type=int, default=8192)
    p.add_argument("--suffix_len", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--interval", type=int, default=0, help="--prefix_cache_checkpoint_interval (0: the default)")
    p.add_argument("--chunk", type=int, default=0, help="--chunked_prefill_size (0: the default)")
    p.add_argument("--kv_tokens", type=int, default=65536, help="--max_total_token_num of each replica")
    p.add_argument("--state_bytes", type=int, default=1 << 30, help="--prefix_cache_state_bytes of each replica")
    p.add_argument("--bandwidth_lens", default="1024,2048,4096,8192,16384")
    p.add_argument("--host_tier_gb", type=float, default=16)
    p.add_argument("--tiny", action="store_true", help="the tiny checkpoint at tiny sizes (a dry run)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--model_dir", default=None)
    p.add_argument("--cache_dir", default=None, help="where the built checkpoint is cached")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start_timeout", type=float, default=600, help="seconds for the http part's server to start")
    p.add_argument("--result_file", default=None)
    a = p.parse_args(argv)
    if a.tiny:
        for k, v in TINY.items():
            setattr(a, k, v)
        a.host_tier_gb = min(a.host_tier_gb, 0.25)
        a.repeats = min(a.repeats, 1)
    a.lens = [int(x) for x in a.bandwidth_lens.split(",")]
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.device in ("auto", "cuda") and not torch.cuda.is_available() and not a.tiny:
        print("host_tier_ttft: no CUDA device (use --tiny --device cpu for a dry run); skipped")
        return 0
    from lightllm.cache.host_tier import HostArena

    model_dir = checkpoint(a)
    arena = HostArena.create(f"lightllm-bench-{uuid.uuid4().hex[:8]}", int(a.host_tier_gb * 2**30))
    rows = []

    def emit(row: dict) -> None:
        rows.append(row)
        print_row(row)

    try:
        parts = a.parts.split(",")
        if "ttft" in parts:
            ttft_rows(model_dir, a, arena, emit)
        if "http" in parts:
            from lightllm.server.model_info import read_model_info

            a.vocab = read_model_info(model_dir).vocab_size
            http_rows(model_dir, a, emit)
        if "bandwidth" in parts:
            bandwidth_rows(model_dir, a, arena, emit)
    finally:
        arena.unlink()
    if a.result_file:
        Path(a.result_file).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
