"""The HTTP benchmark's workload without HTTP: a closed loop of `--concurrency` requests on the offline engine
(each finished request is replaced at once by a new one, as `bench_serving --max_concurrency` does), the serving
checkpoint, replay. Prints a timeline per half second (steps, their mean wall time, prefill tokens and decode rows
scheduled, first tokens, finishes) and, with `--syncs`, every call that made the host wait for the GPU, by its
calling line; `--profile FIRST,COUNT` profiles steps FIRST..FIRST+COUNT-1 (their wall times, the GPU kernels and the
host operators per step; `--trace FILE` adds their Chrome trace: GPU idle gaps and what the host did in them).
With a host tier (`--host_tier_gb`), the time spent in its calls: a spill's `save` on the step loop, the lookup
of each new request, the claims of entries on the writer's thread and its waits for room. Separates what the
engine does from what the front-end adds. `--model_dir` (with `--load_format dummy`, `--quantization fp8`,
`--mem_fraction`) runs another checkpoint, e.g. a full-size model's weightless folder.

    python test/gpu/closed_loop.py [--requests 512 --concurrency 256 --input_len 1024 --output_len 256] [--syncs]
    python test/gpu/closed_loop.py --profile 200,10 [--max_mixed_prefill_tokens 8192] [--disable_prefix_cache]
    python test/gpu/closed_loop.py --host_tier_gb 16 [--prefault]   # with the server's host tier (its spills)
    python test/gpu/closed_loop.py --host_tier_gb 16 --profile 3,3 --trace /tmp/t16.json
    python test/gpu/closed_loop.py --interfere python:2@300    # the writer's kinds of work alone (loop_interference.py)
    python test/gpu/closed_loop.py --model_dir /tmp/kimi --load_format dummy --quantization fp8 --profile 20,5
"""

from __future__ import annotations

import argparse
import atexit
import collections
import contextlib
import os
import time
import traceback
import warnings

import numpy as np
import torch
from loop_interference import Interference

from lightllm import LLM
from lightllm.cache.host_tier import HostArena
from lightllm.engine.messages import Finished, NewRequest, TokenChunk
from lightllm.engine.sampling_params import SamplingParams
from lightllm.server.host_tier import BLOCK_BYTES
from lightllm.tools.bench_throughput import serving_model_dir


@contextlib.contextmanager
def counting_syncs(sites: collections.Counter):
    """Count each host wait on the GPU (CUDA's sync debug mode) by the last lightllm or fla frame that caused it."""

    def count(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "lightllm" in f.filename or "/fla/" in f.filename]
        f = frames[-1] if frames else None
        sites[f"{'/'.join(f.filename.rsplit('/', 3)[-3:])}:{f.lineno} {f.name}" if f else "?"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = count
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")


def time_calls(obj, name: str, totals: dict) -> None:
    """Wrap `obj.name` so each call adds its wall time to `totals[name]` ([calls, total ms, max ms]); nothing
    when `obj` has no such method (another tree's)."""
    inner = getattr(obj, name, None)
    if inner is None:
        return
    totals[name] = [0, 0.0, 0.0]

    def timed(*args, **kwargs):
        s = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            ms = (time.perf_counter() - s) * 1e3
            t = totals[name]
            t[0], t[1], t[2] = t[0] + 1, t[1] + ms, max(t[2], ms)

    setattr(obj, name, timed)


def report_profile(profiler, profiled: list) -> None:
    """The profiled steps' wall times, then the GPU kernels and host operators per step."""
    print("profiled steps (wall ms, running, tokens out):", profiled)
    n = len(profiled)
    events = profiler.key_averages()
    for label, key in (("GPU", "device_time_total"), ("host self", "self_cpu_time_total")):
        print(f"top by {label} time, ms per step:")
        for e in sorted(events, key=lambda e: getattr(e, key), reverse=True)[:25]:
            print(f"  {getattr(e, key) / 1e3 / n:8.3f}  {e.count / n:7.1f} calls  {e.key[:110]}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--input_len", type=int, default=1024)
    p.add_argument("--output_len", type=int, default=256)
    p.add_argument("--mode", default="replay")
    p.add_argument("--syncs", action="store_true")
    p.add_argument("--disable_prefix_cache", action="store_true")
    p.add_argument("--max_mixed_prefill_tokens", type=int, default=None, help="the server flag (default: its auto)")
    p.add_argument("--prefill_graph_max_tokens", type=int, default=None, help="the server flag (default: its default)")
    p.add_argument("--host_tier_gb", type=float, default=0, help="a host tier of this size beside the engine (0: none)")
    p.add_argument(
        "--prefault", action="store_true", help="touch every page of the host tier first (no first-write page faults)"
    )
    p.add_argument("--profile", default=None, metavar="FIRST,COUNT", help="profile these steps")
    p.add_argument("--trace", default=None, help="with --profile: a Chrome trace of the profiled steps to this file")
    p.add_argument("--device", default="cuda", help="cpu: a quick check of the script at tiny sizes")
    p.add_argument("--model_dir", default=None, help="checkpoint (default: the serving benchmark's)")
    p.add_argument("--load_format", default="auto", help="dummy: random weights from config.json")
    p.add_argument("--quantization", default=None, help="fp8: quantize the weights at load")
    p.add_argument("--mem_fraction", type=float, default=None, help="the server flag (default: its own)")
    p.add_argument(
        "--interfere",
        default=None,
        metavar="SPEC",
        help="a background thread's work during the loop (loop_interference.py)",
    )
    a = p.parse_args()
    interference = Interference(a.interfere, a.device) if a.interfere else None
    profile_first, profile_count = map(int, a.profile.split(",")) if a.profile else (-1, 0)
    arena = None
    if a.host_tier_gb:
        arena = HostArena.create(f"lightllm-closed-loop-{os.getpid()}", int(a.host_tier_gb * 2**30), BLOCK_BYTES)
        atexit.register(arena.unlink)
        if a.prefault:
            s = time.perf_counter()
            arena.data[:] = 0
            print(f"host tier prefaulted in {time.perf_counter() - s:.1f} s")
    optional = dict(mem_fraction=a.mem_fraction, quantization=a.quantization)
    llm = LLM(
        a.model_dir or serving_model_dir(),
        device=a.device,
        load_format=a.load_format,
        **{k: v for k, v in optional.items() if v is not None},
        ssm_state_mode=a.mode,
        max_running_requests=a.concurrency,
        disable_prefix_cache=a.disable_prefix_cache,
        max_mixed_prefill_tokens=a.max_mixed_prefill_tokens,
        **({} if a.prefill_graph_max_tokens is None else {"prefill_graph_max_tokens": a.prefill_graph_max_tokens}),
        **({} if arena is None else {"host_tier_name": arena.name}),
    )
    engine, vocab = llm.engine, llm.engine.runner.vocab_size
    # the host tier's work: a spill's `save` and each new request's lookup on the engine thread, the claim of an
    # entry (`begin_write`, on the writer's threads) and the wait for staging room
    host = getattr(engine.runner.prefix_cache, "host", None) if arena is not None else None
    host_calls: dict = {}
    if host is not None:
        time_calls(host, "save", host_calls)
        time_calls(host, "match_len", host_calls)
        time_calls(host.writer, "_reserve", host_calls)
        time_calls(host.tier, "begin_write", host_calls)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
    sched = engine.scheduler
    sent, done = 0, 0
    t0 = time.perf_counter()
    rows = collections.defaultdict(lambda: collections.Counter())
    step_ms = collections.defaultdict(list)
    sites: collections.Counter[str] = collections.Counter()

    # per request: when it was submitted, when its first token and when its finish came out of a step
    submitted, first_at, finished_at = {}, {}, {}

    def submit() -> None:
        nonlocal sent
        prompt = rng.integers(3, vocab - 3, a.input_len).tolist()
        submitted[f"r{sent}"] = time.perf_counter()
        engine.add_request(NewRequest(f"r{sent}", prompt, params))
        sent += 1

    seen_first: set[str] = set()
    profiler, profiled = None, []
    if interference is not None:
        interference.start()
    with counting_syncs(sites) if a.syncs and a.device == "cuda" else contextlib.nullcontext():
        for _ in range(min(a.concurrency, a.requests)):
            submit()
        while done < a.requests:
            bucket = int((time.perf_counter() - t0) * 2)
            rows[bucket]["running"] = max(rows[bucket]["running"], len(sched.running))
            steps = sum(len(ms) for ms in step_ms.values())
            if steps == profile_first:
                profiler = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU]
                    + ([torch.profiler.ProfilerActivity.CUDA] if a.device == "cuda" else [])
                )
                profiler.__enter__()
            s = time.perf_counter()
            outputs = engine.step()
            now = time.perf_counter()
            step_ms[bucket].append((now - s) * 1e3)
            if profiler is not None and len(profiled) < profile_count:
                profiled.append(
                    (
                        round((now - s) * 1e3, 2),
                        len(sched.running),
                        sum(len(o.token_ids) for o in outputs if isinstance(o, TokenChunk)),
                    )
                )
                if len(profiled) == profile_count:
                    profiler.__exit__(None, None, None)
                    report_profile(profiler, profiled)
                    if a.trace:
                        profiler.export_chrome_trace(a.trace)
            for out in outputs:
                if isinstance(out, TokenChunk) and out.req_id not in seen_first:
                    seen_first.add(out.req_id)
                    first_at[out.req_id] = now
                    rows[bucket]["first"] += 1
                elif isinstance(out, TokenChunk):
                    rows[bucket]["tokens"] += len(out.token_ids)
                elif isinstance(out, Finished):
                    finished_at[out.req_id] = now
                    done += 1
                    rows[bucket]["finished"] += 1
                    if sent < a.requests:
                        submit()
    elapsed = time.perf_counter() - t0
    print(f"{a.requests} requests in {elapsed:.2f} s: {a.requests * a.output_len / elapsed:.0f} output tok/s")
    if interference is not None:
        print(f"interference ({a.interfere}): {interference.stop()}")
    # as bench_serving reports them over HTTP, here at the engine's own step boundaries
    ttft = np.array([first_at[r] - submitted[r] for r in first_at]) * 1e3
    tpot = np.array([(finished_at[r] - first_at[r]) / max(a.output_len - 1, 1) for r in finished_at]) * 1e3
    print(
        f"TTFT ms mean {ttft.mean():.1f} p50 {np.median(ttft):.1f} p99 {np.percentile(ttft, 99):.1f}; "
        f"TPOT ms median {np.median(tpot):.2f}"
    )
    print("| t s | steps | step ms mean | step ms max | running max | first tokens | tokens | finished |")
    print("|---|---|---|---|---|---|---|---|")
    for b in sorted(rows):
        ms = step_ms[b]
        r = rows[b]
        print(
            f"| {b / 2:.1f} | {len(ms)} | {np.mean(ms):.1f} | {max(ms):.1f} | {r['running']} | {r['first']} "
            f"| {r['tokens']} | {r['finished']} |"
        )
    if a.syncs:
        print("host waits by calling line:")
        for site, n in sites.most_common(15):
            print(f"  {n:6d}  {site}")
    if arena is not None:
        print("host tier:", host.stats() if host is not None else "not attached (no prefix cache)")
        for name, (n, total, worst) in host_calls.items():
            print(f"  in {name}: {n} calls, {total:.1f} ms in all, {total / max(n, 1):.2f} ms mean, {worst:.1f} max")
    llm.close()


if __name__ == "__main__":
    main()
