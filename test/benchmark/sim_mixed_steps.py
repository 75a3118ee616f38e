"""The HTTP benchmark's workload through the real scheduler and engine on a CPU, with each step's time taken from a
cost model instead of a GPU: what the mixed-step cap (`--max_mixed_prefill_tokens`) does to time to first token,
inter-token gaps and throughput, before a GPU measures it.

    python test/benchmark/sim_mixed_steps.py [--caps 8192,4096,2048,1024] [--num_prompts 512] [--concurrency 256]

A closed loop like `bench_serving --max_concurrency C`: C requests of `--input_len` random tokens arrive at time 0,
each finished one is replaced at its finish time, until `--num_prompts` have run; every request generates
`--output_len` tokens (the fake runner's model, EOS ignored). The engine runs synchronous steps on a `FakeRunner`
with the server's defaults for a GPU (budget 8192, prefix cache checkpoints every 2048 tokens, a capped step's prompt
chunks at most 1024 tokens); a step with D decode
rows and P prompt tokens costs `--step_ms + D * --decode_row_ms + P * --prefill_token_ms` of GPU time, and a step
whose prompts run eagerly (more than the runner's `GRAPHED_PREFILL_ROWS`, or one longer than
`--prefill_graph_max_tokens`) at least `--eager_step_ms`, its launches on the host (defaults fitted to the
serving checkpoint: a decode step of 256 rows 2.5 ms, 8192 prompt tokens 29 ms, an eager step of two or eight
1024-token prompts beside ~243 decode rows 37-46 ms, the same two prompts through the prefill graph 13.8 ms, as
`test/gpu/closed_loop.py` measured them on an H200 and an H100). No HTTP, no overlap: a model of the engine's
schedule only, not a measurement.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightllm.engine.engine import Engine  # noqa: E402
from lightllm.engine.messages import Finished, NewRequest, TokenChunk  # noqa: E402
from lightllm.engine.sampling_params import SamplingParams  # noqa: E402
from lightllm.worker.runner import GRAPHED_PREFILL_ROWS  # noqa: E402
from unit_tests.engine.fake_runner import FakeRunner  # noqa: E402


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def simulate(cap: int, opts) -> dict[str, float]:
    rng = random.Random(opts.seed)
    runner = FakeRunner(
        vocab_size=64,
        max_requests=opts.concurrency,
        kv_tokens=opts.concurrency * (opts.input_len + opts.output_len + 64),
    )
    engine = Engine(
        runner,
        max_running_requests=opts.concurrency,
        chunked_prefill_size=opts.budget,
        max_num_batched_tokens=opts.budget,
        max_mixed_prefill_tokens=cap,
        mixed_prefill_chunk=opts.mixed_prefill_chunk,
        max_req_total_len=opts.input_len + opts.output_len + 8,
        prefix_cache_checkpoint_interval=2048,
    )
    params = SamplingParams(temperature=0, max_tokens=opts.output_len, ignore_eos=True)
    now, sent, done = 0.0, 0, 0
    arrival, last, ttft, gaps = {}, {}, [], []

    def submit() -> None:
        nonlocal sent
        rid = f"r{sent}"
        # distinct first tokens: no prefix is shared between requests
        ids = [sent % 60 + 1] + [rng.randrange(1, 64) for _ in range(opts.input_len - 1)]
        engine.add_request(NewRequest(rid, ids, params))
        arrival[rid] = now
        sent += 1

    for _ in range(min(opts.concurrency, opts.num_prompts)):
        submit()
    while done < opts.num_prompts:
        seen = len(runner.batches)
        outputs = engine.step()
        for batch in runner.batches[seen:]:
            decode_rows = batch.num_rows - batch.num_prefill_rows
            prompts = batch.query_lens[: batch.num_prefill_rows]
            cost = opts.step_ms + decode_rows * opts.decode_row_ms + sum(prompts) * opts.prefill_token_ms
            eager = len(prompts) > GRAPHED_PREFILL_ROWS or any(q > opts.prefill_graph_max_tokens for q in prompts)
            if eager:
                cost = max(cost, opts.eager_step_ms)
            now += cost / 1000
        for out in outputs:
            if isinstance(out, TokenChunk) and out.token_ids:
                rid = out.req_id
                if rid in last:
                    gaps.append(now - last[rid])
                else:
                    ttft.append(now - arrival[rid])
                last[rid] = now
        for _ in [out for out in outputs if isinstance(out, Finished)]:
            done += 1
            if sent < opts.num_prompts:
                submit()
    tpot = statistics.median(gaps)
    return {
        "cap": cap,
        "output tok/s": opts.num_prompts * opts.output_len / now,
        "TTFT p50 ms": 1000 * statistics.median(ttft),
        "TTFT p99 ms": 1000 * percentile(ttft, 99),
        "ITL p50 ms": 1000 * tpot,
        "ITL p99 ms": 1000 * percentile(gaps, 99),
        "ITL p99 / p50": percentile(gaps, 99) / tpot,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--caps", default="8192,4096,2048,1024", help="--max_mixed_prefill_tokens values (8192: off)")
    p.add_argument("--num_prompts", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--input_len", type=int, default=1024)
    p.add_argument("--output_len", type=int, default=256)
    p.add_argument("--budget", type=int, default=8192, help="--max_num_batched_tokens")
    p.add_argument("--step_ms", type=float, default=1.0)
    p.add_argument("--decode_row_ms", type=float, default=0.006)
    p.add_argument("--prefill_token_ms", type=float, default=0.00345)
    p.add_argument("--prefill_graph_max_tokens", type=int, default=1024, help="the server flag")
    p.add_argument(
        "--mixed_prefill_chunk",
        type=int,
        default=1024,
        help="longest prompt chunk of a capped step (the server's: --prefill_graph_max_tokens on CUDA; 0: none)",
    )
    p.add_argument("--eager_step_ms", type=float, default=40.0, help="least time of a step whose prompts run eagerly")
    p.add_argument("--seed", type=int, default=0)
    opts = p.parse_args(argv)
    keys = None
    for cap in (int(c) for c in opts.caps.split(",")):
        row = simulate(cap, opts)
        if keys is None:
            keys = list(row)
            print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys), flush=True)
        print(
            "| " + " | ".join(f"{row[k]:.4g}" if isinstance(row[k], float) else str(row[k]) for k in keys) + " |",
            flush=True,
        )


if __name__ == "__main__":
    main()
