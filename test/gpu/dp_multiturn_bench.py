"""Data parallelism on one GPU: two replicas (`--dp 2`, each with half of `--mem_fraction`) serving a multi-turn
workload, cache-aware routing against round robin: prefix hit rate and throughput.

    python test/gpu/dp_multiturn_bench.py                          # H200: the serving checkpoint, 64 x 4 turns
    python test/gpu/dp_multiturn_bench.py --tiny --device cpu      # a dry run of this script without a GPU

Per balancer (`--balancers`) one HTTP server `--dp 2 --dp_balancer B` (every other flag at its default, state
mode `--serving_mode`) serves `python -m lightllm.tools.bench_serving --dataset multi_turn`: `--conversations`
conversations of `--turns` turns, all at once, each turn sending its whole history (a shared system prompt of
`--system_words` words, earlier questions and answers) and a new question, `--output_len` tokens per answer. A
warm-up round of other conversations runs first. Rows give request and token throughput, TTFT, the hit rate the
clients saw (cached / prompt tokens of `usage`) and, from `GET /dp/replicas`, each replica's routed requests and
hit rate per cache tier (`device`: its own prefix cache; `host`: the host tier the replicas share, unless
`--server_flags='--host_tier_gb 0'` turns it off). The last line gives cache_aware's throughput and hit rate
over round robin's (same run, same GPU). Without a CUDA device (and without `--device cpu`) it prints that it skipped and exits 0.

Checkpoint: the serving benchmark's random-weight Qwen3.5 at real width (`SERVING_BENCH_SIZES` of
`lightllm.tools.bench_throughput`), built once and cached; `--model_dir` serves another.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (HERE.parents[1], HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import httpx  # noqa: E402
import torch  # noqa: E402
from prefix_cache_ttft import bench_multiturn, checkpoint  # noqa: E402
from smoke_serving_gpu import log_tail, start_server, stop_server, wait_healthy  # noqa: E402

# seconds for the replicas' last stats snapshots to arrive after a run
STATS_WAIT_S = 1.5
# sizes of the --tiny dry run (the tiny checkpoint on the CPU)
TINY = dict(conversations=4, turns=2, system_words=40, output_len=6, interval=32, state_bytes=1 << 22)


def server_flags(a, balancer: str) -> list[str]:
    flags = ["--dp", "2", "--dp_balancer", balancer, "--ssm_state_mode", a.serving_mode]
    flags += ["--max_running_requests", str(max(a.conversations, 4))]
    if a.mem_fraction:
        flags += ["--mem_fraction", str(a.mem_fraction)]
    if a.interval:
        flags += ["--prefix_cache_checkpoint_interval", str(a.interval)]
    if a.state_bytes:
        flags += ["--prefix_cache_state_bytes", str(a.state_bytes)]
    return flags + a.server_flags.split()


def replica_rows(port: int) -> list[dict]:
    return httpx.get(f"http://127.0.0.1:{port}/dp/replicas", timeout=10).json()["replicas"]


def balancer_row(model_dir: str, device: str, a, balancer: str) -> dict:
    log = os.path.join(a.log_dir, f"server-{balancer}.log")
    t0 = time.perf_counter()
    proc, port = start_server(model_dir, device, server_flags(a, balancer), log)
    row: dict = {"balancer": balancer}
    try:
        wait_healthy(proc, port, a.start_timeout)
        row["start_s"] = time.perf_counter() - t0
        with (
            open(os.path.join(a.log_dir, f"bench-{balancer}.txt"), "w") as out,
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(out),
        ):
            # kernels a fresh server compiles on first use must not land in the measured run
            bench_multiturn(port, a, max(a.conversations // 4, 1), a.seed + 1)
            before = replica_rows(port)
            summary = bench_multiturn(port, a, a.conversations, a.seed)
        # the engines report their counters every half second
        time.sleep(STATS_WAIT_S)
        after = replica_rows(port)
        row["summary"] = summary
        row["replicas"] = [_replica_delta(b, c) for b, c in zip(before, after)]
    except Exception as exc:  # noqa: BLE001 - the row reports it, the run goes on
        row["error"] = f"{exc!r}; server log tail: {log_tail(log)}"
    finally:
        stop_server(proc, 60)
    return row


def _replica_delta(before: dict, after: dict) -> dict:
    """A replica's routed requests, lookups and hits per cache tier during the measured run."""
    hits = after["prefix_cache_hit_tokens"]
    return {
        "routed": after["num_routed"] - before["num_routed"],
        "queried_tokens": after["prefix_cache_queried_tokens"] - before["prefix_cache_queried_tokens"],
        "hit_tokens": {tier: n - before["prefix_cache_hit_tokens"].get(tier, 0) for tier, n in hits.items()},
        "alive": after["alive"],
    }


def hit_rate(summary: dict) -> float:
    return summary["cached_prompt_tokens"] / max(summary["prompt_tokens"], 1)


def print_row(row: dict) -> None:
    if "error" in row:
        print(f"| {row['balancer']} | FAIL {row['error'][:600]} |", flush=True)
        return
    s = row["summary"]
    replicas = "; ".join(
        f"{r['routed']} req, "
        + ", ".join(f"{tier} {100 * n / max(r['queried_tokens'], 1):.1f}%" for tier, n in r["hit_tokens"].items())
        for r in row["replicas"]
    )
    print(
        f"| {row['balancer']} | {s['num_requests']} ({s['num_failed']} failed) | {s['request_throughput']:.2f} "
        f"| {s['output_token_throughput']:.1f} | {s['total_token_throughput']:.1f} "
        f"| {s['ttft']['mean_ms']:.1f} / {s['ttft']['median_ms']:.1f} | {s['cached_prompt_tokens']} / "
        f"{s['prompt_tokens']} ({100 * hit_rate(s):.1f}%) | {replicas} | {row['start_s']:.0f} |",
        flush=True,
    )


def print_ratio(rows: list[dict]) -> None:
    by = {r["balancer"]: r["summary"] for r in rows if "summary" in r}
    if {"cache_aware", "round_robin"} <= by.keys():
        ca, rr = by["cache_aware"], by["round_robin"]
        print(
            f"cache_aware / round_robin: total token throughput {ca['total_token_throughput'] / rr['total_token_throughput']:.2f}x, "
            f"request throughput {ca['request_throughput'] / rr['request_throughput']:.2f}x, hit rate "
            f"{100 * hit_rate(ca):.1f}% vs {100 * hit_rate(rr):.1f}%",
            flush=True,
        )


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--balancers", default="cache_aware,round_robin")
    p.add_argument("--serving_mode", default="native", help="--ssm_state_mode of the servers")
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system_words", type=int, default=1024, help="words of the shared system prompt")
    p.add_argument("--output_len", type=int, default=64)
    p.add_argument("--mem_fraction", type=float, default=0.0, help="--mem_fraction of the server (0: the default)")
    p.add_argument("--interval", type=int, default=0, help="--prefix_cache_checkpoint_interval (0: the default)")
    p.add_argument("--state_bytes", type=int, default=0, help="--prefix_cache_state_bytes (0: the default)")
    p.add_argument(
        "--server_flags", default="", help="more flags for both servers, e.g. --server_flags='--host_tier_gb 0'"
    )
    p.add_argument("--tiny", action="store_true", help="the tiny checkpoint at tiny sizes (a dry run)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--model_dir", default=None)
    p.add_argument("--cache_dir", default=None, help="where the built checkpoint is cached")
    p.add_argument("--log_dir", default=None, help="server logs (default: a temporary folder)")
    p.add_argument("--start_timeout", type=float, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result_file", default=None)
    a = p.parse_args(argv)
    if a.tiny:
        for key, value in TINY.items():
            if p.get_default(key) == getattr(a, key):
                setattr(a, key, value)
    a.log_dir = a.log_dir or tempfile.mkdtemp(prefix="lightllm_dp_bench_")
    os.makedirs(a.log_dir, exist_ok=True)
    return a


def main(argv: list[str] | None = None) -> list[dict]:
    a = parse(argv)
    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "")
    if not device or (device == "cuda" and not torch.cuda.is_available()):
        print("no CUDA device: skipped (use --tiny --device cpu for a dry run)")
        return []
    model_dir = checkpoint(a)
    print(
        f"--dp 2 on {device}: {a.conversations} conversations x {a.turns} turns, system prompt {a.system_words} "
        f"words, {a.output_len} tokens per answer, state mode {a.serving_mode}"
    )
    print(
        "| balancer | requests | req/s | output tok/s | total tok/s | TTFT mean / median ms | cached / prompt tokens "
        "| per replica: routed, hit rate by tier | server start s |"
    )
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for balancer in a.balancers.split(","):
        rows.append(balancer_row(model_dir, device, a, balancer))
        print_row(rows[-1])
        if a.result_file:
            with open(a.result_file, "w") as f:
                json.dump(rows, f, indent=1)
    print_ratio(rows)
    return rows


if __name__ == "__main__":
    main()
