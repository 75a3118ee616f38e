"""Start-up check of the real server: start, answer one chat request, stop, many times in a row, in each state mode.

    python test/gpu/startup_check.py                                   # 5 starts per mode + one at 256 requests
    python test/gpu/startup_check.py --starts 2 --modes replay,compact+mtp --model_dir /path/to/built/checkpoint
    python test/gpu/startup_check.py --tiny --device cpu --starts 1   # a dry run of this script without a GPU
    python test/gpu/startup_check.py --starts 3 --modes replay --trees .,/tmp/base   # A/B: this tree and a copy

Each start runs `python -m lightllm.server.api_server` (every flag at its default but the state mode, speculation
and `--max_running_requests`) on a random-weight Qwen3.5 checkpoint of real width (hidden 2048; attention 16 heads,
2 KV heads, head dim 256; GDN 16 key / 32 value heads of 128; FFN 6144; 8 layers = 6 GDN + 2 attention; vocab
32000; bf16: the serving benchmark's checkpoint, `lightllm.tools.bench_throughput.SERVING_BENCH_SIZES`), waits
for /health, sends one chat completion, checks for HTTP 200 with non-empty usage, stops the server with SIGTERM and checks that it
exits 0. `--starts` starts per mode run at `--max_running_requests 64`, then one more at 256. A mode is a state
mode, optionally with `+mtp` (`--mtp_step 2`, a verify width of 3): the default `native,replay,compact+mtp`.

The server start-up is where the conv-prefill overread crashed the H200 (the prefill warm-up at the serving
shapes, then the slot allocation at the largest batch): a crash, a hang past `--start_timeout` or a failed request
fails the start. The first start on a machine also pays fla-core's autotuning of its chunk kernels (minutes; kept
in the Triton cache afterwards). `--trees` compares copies of the repository (`.` is this one; another, e.g. a
`git archive` of an older commit, is run from its folder): their starts alternate, so a machine's drift reaches
each alike, and the first start of every tree is left out of the summary (a copy's first start compiles its Python
and whatever its caches lack). Server logs go to `--log_dir`, one file per start. Prints one line per start and a
table; exits 1 on any failed start.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (HERE.parents[1], HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from smoke_serving_gpu import chat_once, log_tail, start_server, stop_server, wait_healthy  # noqa: E402

DEFAULT_MODES = "native,replay,compact+mtp"


def mode_flags(mode: str) -> list[str]:
    """`MODE` or `MODE+mtp` -> server flags."""
    state, _, extra = mode.partition("+")
    if extra not in ("", "mtp"):
        raise ValueError(f"mode {mode!r}: expected STATE_MODE or STATE_MODE+mtp")
    return ["--ssm_state_mode", state] + (["--mtp_step", "2"] if extra else [])


def checkpoint(args) -> str:
    if args.model_dir:
        return args.model_dir
    if args.tiny:
        from lightllm.tools.make_tiny_model import tiny_model_dir

        return str(tiny_model_dir("qwen3_5", cache_dir=args.cache_dir))
    from lightllm.tools.bench_throughput import serving_model_dir

    # the serving benchmark's checkpoint: the server that starts here is the one that is measured
    return serving_model_dir(args.cache_dir)


def one_start(model_dir: str, args, mode: str, max_running: int, log_path: str, tree: str = ".") -> dict:
    """Start (the server of `tree`), wait for /health, one chat request, stop. Returns the row of the table."""
    flags = mode_flags(mode) + ["--max_running_requests", str(max_running)]
    row = {"mode": mode, "max_running_requests": max_running, "start_s": None, "stop_s": None, "result": "ok"}
    row["tree"] = tree
    t0 = time.perf_counter()
    proc, port = start_server(model_dir, args.device, flags, log_path, None if tree == "." else tree)
    try:
        wait_healthy(proc, port, args.start_timeout)
        row["start_s"] = time.perf_counter() - t0
        data = chat_once(port, "Start-up check: say something.", max_tokens=args.max_tokens)
        usage = data.get("usage") or {}
        if not (usage.get("prompt_tokens", 0) > 0 and usage.get("completion_tokens", 0) > 0):
            raise AssertionError(f"HTTP 200 with empty usage {usage}")
        row["usage"] = f"{usage['prompt_tokens']}+{usage['completion_tokens']}"
    except Exception as exc:  # noqa: BLE001 - every start gets its row
        row["result"] = f"FAIL {exc!r}"[:300]
    finally:
        t1 = time.perf_counter()
        code = stop_server(proc, args.stop_timeout)
        row["stop_s"] = time.perf_counter() - t1
    if row["result"] == "ok" and code != 0:
        row["result"] = "FAIL killed after SIGTERM timeout" if code is None else f"FAIL exit code {code} after SIGTERM"
    if row["result"] != "ok":
        row["log_tail"] = log_tail(log_path)
    return row


def _fmt(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--starts", type=int, default=5, help="starts per mode at --max_running_requests 64")
    p.add_argument("--modes", default=DEFAULT_MODES, help="comma-separated STATE_MODE[+mtp]")
    p.add_argument(
        "--big_max_running_requests",
        type=int,
        default=256,
        help="one more start per mode at this many requests (0: none)",
    )
    p.add_argument("--model_dir", default=None, help="serve this checkpoint instead of building the real-width one")
    p.add_argument(
        "--cache_dir", default=None, help="where the built checkpoint is cached (default ~/.cache/lightllm/tiny)"
    )
    p.add_argument("--tiny", action="store_true", help="the tiny default-size qwen3_5 checkpoint (CPU dry runs)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--start_timeout", type=float, default=600, help="seconds until /health must answer 200")
    p.add_argument("--stop_timeout", type=float, default=60, help="seconds the server gets to exit after SIGTERM")
    p.add_argument("--max_tokens", type=int, default=8)
    p.add_argument("--log_dir", default="/tmp/lightllm_startup_logs")
    p.add_argument("--trees", default=".", help="comma-separated repository copies whose servers start in turn")
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    for mode in modes:
        try:
            mode_flags(mode)  # refuse a malformed mode before building anything
        except ValueError as exc:
            p.error(str(exc))
    os.makedirs(args.log_dir, exist_ok=True)

    t = time.perf_counter()
    model_dir = checkpoint(args)
    print(f"checkpoint {model_dir} ({time.perf_counter() - t:.0f} s to build or find)", flush=True)
    trees = [t for t in args.trees.split(",") if t]
    plan = [(m, 64, t) for m in modes for _ in range(args.starts) for t in trees]
    if args.big_max_running_requests:
        plan += [(m, args.big_max_running_requests, t) for m in modes for t in trees]
    plan.sort(key=lambda mrt: modes.index(mrt[0]))  # every start of a mode in a row, the big ones last
    rows = []
    print("| # | tree | mode | max_running_requests | start s | usage | stop s | result |", flush=True)
    for i, (mode, max_running, tree) in enumerate(plan):
        log_path = os.path.join(args.log_dir, f"start{i:02d}-{mode.replace('+', '-')}-{max_running}.log")
        row = one_start(model_dir, args, mode, max_running, log_path, tree)
        rows.append(row)
        print(
            f"| {i} | {tree} | {mode} | {max_running} | {_fmt(row['start_s'])} | {row.get('usage', '-')} | "
            f"{_fmt(row['stop_s'])} | {row['result']} |",
            flush=True,
        )
        if "log_tail" in row:
            print(f"server log tail ({log_path}):\n{row['log_tail']}", flush=True)

    print("\n| tree | mode | starts | ok | start s min / median / max |")
    print("|---|---|---|---|---|")
    for tree in trees:
        for mode in modes:
            mine = [r for r in rows if r["mode"] == mode and r["tree"] == tree]
            # with more than one tree each tree's first start is its copy's cold one
            cold = 1 if len(trees) > 1 else 0
            times = [r["start_s"] for r in mine[cold:] if r["start_s"] is not None]
            spread = " / ".join(f"{f(times):.1f}" for f in (min, statistics.median, max)) if times else "-"
            print(f"| {tree} | {mode} | {len(mine)} | {sum(r['result'] == 'ok' for r in mine)} | {spread} |")
    failures = sum(r["result"] != "ok" for r in rows)
    print(f"\n{len(rows)} starts; failures: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
