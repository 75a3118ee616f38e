"""Prefix-cache timing on one GPU: time to first token cold vs resumed, and a multi-turn serving run with and
without the cache.

    python test/gpu/prefix_cache_ttft.py                          # H200: the serving checkpoint, ~4 min
    python test/gpu/prefix_cache_ttft.py --parts ttft --modes native,replay
    python test/gpu/prefix_cache_ttft.py --tiny --device cpu      # a dry run of this script without a GPU

The checkpoint is the serving benchmark's random-weight Qwen3.5 at real width (`SERVING_BENCH_SIZES` of
`lightllm.tools.bench_throughput`: hidden 2048, 8 layers, bf16, fp32 state), built once and cached.

`ttft` (offline engine, one per state mode; `MODE+mtp` adds `--mtp_step 2`, `MODE+eager` sets
`--prefill_graph_max_tokens 0`: short prefills run eagerly instead of through their CUDA graphs, and a hit's last
prompt token runs as a decode step of its own): each repeat draws a fresh random prefix of `--prefix_len` tokens
(8192) and sends it with a random `--suffix_len`-token suffix (100), cache on but nothing cached (cold), then the
same prefix with another suffix (hit: it resumes the checkpoint at the prefix end, where the cold request's first
prefill chunk ended at an interval boundary, and prefills the suffix), then the cold prompt again (exact repeat:
it resumes before its last token and feeds only that one). Time to first token is from `add_request` to the step
that emits the token, alone in the engine; the table gives the median over `--repeats` after one untimed warm-up round, the
hit's speed-up and the cached tokens each request reported. A last row runs the cold request with the cache disabled.

`multiturn`: the HTTP server (`--serving_mode`, every other flag at its default) with the cache, then with
`--disable_prefix_cache`, each serving `python -m lightllm.tools.bench_serving --dataset multi_turn`: every
conversation sends its whole history each turn (a shared system prompt of `--system_words` words, `--turns`
turns, `--output_len` tokens per answer). Rows give request and token throughput, TTFT and the hit rate (cached /
prompt tokens from `usage.prompt_tokens_details`).

Rows print as they finish; `--result_file` gets every row as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (HERE.parents[1], HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402
from smoke_serving_gpu import log_tail, start_server, stop_server, wait_healthy  # noqa: E402

RUNNER = "lightllm.server.runner_factory:create_runner"
# sizes of the --tiny dry run (the tiny checkpoint on the CPU): checkpoints every 32 tokens, a prefix of 4 intervals
TINY = dict(
    prefix_len=128,
    suffix_len=12,
    interval=32,
    chunk=128,
    state_bytes=1 << 22,
    conversations=3,
    system_words=40,
    output_len=6,
)


def parse_mode(mode: str) -> dict:
    """`MODE[+mtp][+eager]` -> engine flags (`+eager`: short prefills run eagerly, no prefill graphs)."""
    state, *extras = mode.split("+")
    if not set(extras) <= {"mtp", "eager"}:
        raise ValueError(f"mode {mode!r}: expected STATE_MODE[+mtp][+eager]")
    flags = {"ssm_state_mode": state, "mtp_step": 2 if "mtp" in extras else 0}
    if "eager" in extras:
        flags["prefill_graph_max_tokens"] = 0
    return flags


def checkpoint(a) -> str:
    if a.model_dir:
        return a.model_dir
    if a.tiny:
        from lightllm.tools.make_tiny_model import tiny_model_dir

        return str(tiny_model_dir("qwen3_5", cache_dir=a.cache_dir))
    from lightllm.tools.bench_throughput import serving_model_dir

    return serving_model_dir(a.cache_dir)


# ttft ---------------------------------------------------------------------------------------------------------
def build(model_dir: str, a, cache: bool, **mode):
    from lightllm.server.args import load_server_args
    from lightllm.server.engine_process import build_engine

    flags = dict(
        model_dir=model_dir,
        max_running_requests=4,
        max_req_total_len=a.prefix_len + a.suffix_len + 16,
        disable_prefix_cache=not cache,
        **mode,
    )
    if a.device != "auto":
        flags["device"] = a.device
    if a.interval:
        flags["prefix_cache_checkpoint_interval"] = a.interval
    if a.chunk:
        flags["chunked_prefill_size"] = a.chunk
    if a.state_bytes and cache:
        flags["prefix_cache_state_bytes"] = a.state_bytes
    args, info = load_server_args([], **flags)
    return build_engine(args, info, RUNNER), info.vocab_size


def time_to_first_token(engine, req_id: str, prompt: list[int], steps: list | None = None) -> tuple[float, int]:
    """Seconds from `add_request` to the step that emits the request's first token (then run to its end), and the
    cached tokens it reported; `steps` gets the seconds of each step up to that token."""
    from lightllm.engine.messages import Finished, NewRequest, TokenChunk
    from lightllm.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    assert engine.add_request(NewRequest(req_id, prompt, params)) == []
    first = None
    while first is None:
        if not engine.has_work():
            raise RuntimeError(f"{req_id} finished without a token")
        step_start = time.perf_counter()
        outputs = engine.step()
        if steps is not None:
            steps.append(time.perf_counter() - step_start)
        first = next((o for o in outputs if isinstance(o, TokenChunk) and o.req_id == req_id), None)
        failed = next((o for o in outputs if isinstance(o, Finished) and o.error), None)
        if failed is not None:
            raise RuntimeError(f"{req_id} failed: {failed.error}")
    seconds = time.perf_counter() - start
    while engine.has_work():
        engine.step()
    return seconds, first.num_cached_tokens or 0


def profile_hit(engine, prompt: list[int], mode: str) -> None:
    """One more hit under the PyTorch profiler: the steps it took, then the ops with the most host time and the
    most device time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    steps: list[float] = []
    with profile(activities=activities) as prof:
        seconds, cached = time_to_first_token(engine, "profiled-hit", prompt, steps)
    print(
        f"\nprofiled hit ({mode}): TTFT {1e3 * seconds:.1f} ms (under the profiler), {cached} cached tokens, "
        f"steps ms: {' / '.join(f'{1e3 * t:.1f}' for t in steps)}"
    )
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    if torch.cuda.is_available():
        device_key = (
            "self_device_time_total" if hasattr(averages[0], "self_device_time_total") else "self_cuda_time_total"
        )
        print(averages.table(sort_by=device_key, row_limit=25, max_name_column_width=60), flush=True)


def ttft_rows(model_dir: str, a, emit) -> None:
    rng = random.Random(a.seed)
    cases = [(mode, True) for mode in a.modes.split(",")] + [(a.modes.split(",")[0], False)]
    for mode, cache in cases:
        t0 = time.perf_counter()
        engine, vocab = build(model_dir, a, cache, **parse_mode(mode))
        build_s = time.perf_counter() - t0

        def tokens(n: int, vocab: int = vocab) -> list[int]:
            return [rng.randrange(1, vocab) for _ in range(n)]

        cold, hit, cached, repeat, repeat_cached = [], [], [], [], []
        # the first round is untimed: kernel compilation and autotuning at these shapes
        for r in range(a.repeats + 1):
            prefix = tokens(a.prefix_len)
            prompt = prefix + tokens(a.suffix_len)
            c, _ = time_to_first_token(engine, f"c{r}", prompt)
            if cache:
                h, n = time_to_first_token(engine, f"h{r}", prefix + tokens(a.suffix_len))
                e, m = time_to_first_token(engine, f"e{r}", prompt)
            if r:
                cold.append(c)
                if cache:
                    hit.append(h)
                    cached.append(n)
                    repeat.append(e)
                    repeat_cached.append(m)
        if cache and a.profile_hit:
            profile_hit(engine, prefix + tokens(a.suffix_len), mode)
            a.profile_hit = False  # the first mode only
        row = {
            "part": "ttft",
            "mode": mode,
            "cache": cache,
            "prefix_len": a.prefix_len,
            "suffix_len": a.suffix_len,
            "cold_ms": 1e3 * statistics.median(cold),
            "build_s": build_s,
        }
        if cache:
            row.update(
                hit_ms=1e3 * statistics.median(hit),
                speedup=statistics.median(cold) / statistics.median(hit),
                cached_tokens=min(cached),
                repeat_ms=1e3 * statistics.median(repeat),
                repeat_cached_tokens=min(repeat_cached),
            )
        emit(row)
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def print_ttft(row: dict) -> None:
    if row["cache"]:
        cells = [
            f"{row['hit_ms']:.1f}",
            f"{row['speedup']:.1f}x",
            str(row["cached_tokens"]),
            f"{row['repeat_ms']:.1f} ({row['repeat_cached_tokens']})",
        ]
    else:
        cells = ["-", "-", "cache off", "-"]
    print(
        f"| {row['mode']} | {row['prefix_len']}+{row['suffix_len']} | {row['cold_ms']:.1f} | {' | '.join(cells)} "
        f"| {row['build_s']:.0f} |",
        flush=True,
    )


# multiturn ----------------------------------------------------------------------------------------------------
def multiturn_rows(model_dir: str, a, emit) -> None:

    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    for cache in (True, False):
        flags = ["--ssm_state_mode", a.serving_mode, "--max_running_requests", str(max(a.conversations, 4))]
        if a.interval:
            flags += ["--prefix_cache_checkpoint_interval", str(a.interval)]
        if not cache:
            flags.append("--disable_prefix_cache")
        elif a.state_bytes:
            flags += ["--prefix_cache_state_bytes", str(a.state_bytes)]
        log = os.path.join(a.log_dir, f"server-{'cache' if cache else 'nocache'}.log")
        t0 = time.perf_counter()
        proc, port = start_server(model_dir, device, flags, log)
        row = {"part": "multiturn", "mode": a.serving_mode, "cache": cache}
        try:
            wait_healthy(proc, port, a.start_timeout)
            row["start_s"] = time.perf_counter() - t0
            # the benchmark's own report and progress bar go to the log folder; the row below sums it up
            with (
                open(os.path.join(a.log_dir, f"bench-{'cache' if cache else 'nocache'}.txt"), "w") as out,
                contextlib.redirect_stdout(out),
                contextlib.redirect_stderr(out),
            ):
                # a warm-up round with other conversations first: kernels a fresh server compiles on first use
                # (shapes the start-up warm-up does not reach) must not land in the measured run
                bench_multiturn(port, a, max(a.conversations // 4, 1), a.seed + 1)
                summary = bench_multiturn(port, a, a.conversations, a.seed)
            row.update(summary=summary)
        except Exception as exc:  # noqa: BLE001 - the row reports it, the run goes on
            row["error"] = f"{exc!r}; server log tail: {log_tail(log)}"
        finally:
            stop_server(proc, 60)
        emit(row)


def bench_multiturn(port: int, a, num_conversations: int, seed: int) -> dict:
    from lightllm.tools import bench_serving

    return bench_serving.main(
        [
            "--base_url",
            f"http://127.0.0.1:{port}",
            "--dataset",
            "multi_turn",
            "--num_prompts",
            str(num_conversations),
            "--num_turns",
            str(a.turns),
            "--input_len",
            str(a.system_words),
            "--output_len",
            str(a.output_len),
            "--max_concurrency",
            str(num_conversations),
            "--seed",
            str(seed),
        ]
    )


def print_multiturn(row: dict) -> None:
    if "error" in row:
        print(f"| {row['mode']} | {'on' if row['cache'] else 'off'} | FAIL {row['error'][:600]} |", flush=True)
        return
    s = row["summary"]
    rate = s["cached_prompt_tokens"] / max(s["prompt_tokens"], 1)
    print(
        f"| {row['mode']} | {'on' if row['cache'] else 'off'} | {s['num_requests']} ({s['num_failed']} failed) "
        f"| {s['request_throughput']:.2f} | {s['output_token_throughput']:.1f} | {s['total_token_throughput']:.1f} "
        f"| {s['ttft']['mean_ms']:.1f} / {s['ttft']['median_ms']:.1f} | {s['cached_prompt_tokens']} / "
        f"{s['prompt_tokens']} ({100 * rate:.1f}%) | {row['start_s']:.0f} |",
        flush=True,
    )


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="ttft,multiturn", help="comma-separated: ttft, multiturn")
    p.add_argument("--modes", default="native,replay,compact+mtp", help="state modes of the ttft part")
    p.add_argument("--serving_mode", default="native", help="state mode of the multiturn part's servers")
    p.add_argument("--prefix_len", type=int, default=8192)
    p.add_argument("--suffix_len", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--interval", type=int, default=0, help="--prefix_cache_checkpoint_interval (0: the default)")
    p.add_argument("--state_bytes", type=int, default=0, help="--prefix_cache_state_bytes (0: the default)")
    p.add_argument("--chunk", type=int, default=0, help="--chunked_prefill_size of the ttft part (0: the default)")
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system_words", type=int, default=1024, help="words of the shared system prompt")
    p.add_argument("--output_len", type=int, default=64)
    p.add_argument("--tiny", action="store_true", help="the tiny checkpoint at tiny sizes (a dry run)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--model_dir", default=None)
    p.add_argument("--cache_dir", default=None, help="where the built checkpoint is cached")
    p.add_argument("--log_dir", default=None, help="server logs (default: a temporary folder)")
    p.add_argument("--start_timeout", type=float, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile_hit", action="store_true", help="profile one more hit of the first mode (op tables)")
    p.add_argument("--result_file", default=None)
    a = p.parse_args(argv)
    if a.tiny:
        for key, value in TINY.items():
            if p.get_default(key) == getattr(a, key):
                setattr(a, key, value)
    a.log_dir = a.log_dir or tempfile.mkdtemp(prefix="lightllm_prefix_cache_")
    os.makedirs(a.log_dir, exist_ok=True)
    return a


def main(argv: list[str] | None = None) -> list[dict]:
    a = parse(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device (use --tiny --device cpu for a dry run)")
    rows: list[dict] = []
    t0 = time.perf_counter()
    model_dir = checkpoint(a)
    print(f"checkpoint {model_dir} ready in {time.perf_counter() - t0:.0f} s", flush=True)

    def emit(printer):
        def add(row: dict) -> None:
            rows.append(row)
            printer(row)
            if a.result_file:
                with open(a.result_file, "w") as f:
                    json.dump(rows, f, indent=1)

        return add

    parts = a.parts.split(",")
    if "ttft" in parts:
        print(
            "| mode | prefix+suffix | cold TTFT ms | hit TTFT ms | speed-up | cached tokens "
            "| exact repeat TTFT ms (cached) | engine build s |"
        )
        print("|---|---|---|---|---|---|---|---|", flush=True)
        ttft_rows(model_dir, a, emit(print_ttft))
    if "multiturn" in parts:
        print(
            f"multi-turn: {a.conversations} conversations x {a.turns} turns, system prompt {a.system_words} words, "
            f"{a.output_len} tokens per answer"
        )
        print(
            "| mode | cache | requests | req/s | output tok/s | total tok/s | TTFT mean / median ms "
            "| cached / prompt tokens | server start s |"
        )
        print("|---|---|---|---|---|---|---|---|---|", flush=True)
        multiturn_rows(model_dir, a, emit(print_multiturn))
    print(f"total {time.perf_counter() - t0:.0f} s", flush=True)
    return rows


if __name__ == "__main__":
    main()
