"""Does the real server compile kernels while it serves? Rounds of requests at changing batch sizes against one
server, with the TTFT of each round and the Triton kernels written to the cache during it.

    python test/gpu/serving_compiles.py                         # native, the serving benchmark's checkpoint
    python test/gpu/serving_compiles.py --mode replay --mtp_step 2

Start-up compiles (prefill warm-up, attention warm-up, decode graph capture); a kernel compiled during a round is a
compile inside a serving step, which stalls every request of that step for as long as the compile takes. The
rounds (`ROUNDS`): 4, 64, 64, 1, 16 and 5 requests of 256 random prompt tokens and 32 new tokens, all sent at
once; 32 arriving at 40 per second (prefill chunks beside decode rows, a different mix every step); multi-turn
conversations (prefix-cache hits: a few new tokens after a long cached prefix); 64 at once again.
Needs `TRITON_CACHE_DIR` (test/gpu/python_env.sh sets it). Prints one row per round; exits 1 when any round
compiled.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import io
import os
import sys
import tempfile
import time

# run as a script, this folder is on sys.path
from pd_bench import _free_port, _model_dir, _start, _stop, _wait  # noqa: E402

# (dataset, requests or conversations, arrivals per second: 0 = all at once)
ROUNDS = (
    *(("random", n, 0) for n in (4, 64, 64, 1, 16, 5)),
    ("random", 32, 40),
    ("multi_turn", 8, 0),
    ("multi_turn", 16, 0),
    ("random", 64, 0),
)


def kernels_written_since(cache_dir: str, since: float) -> list[str]:
    """Names of the kernels whose compiled metadata entered the Triton cache after `since`."""
    names = set()
    for meta in glob.glob(os.path.join(cache_dir, "*", "*.json")):
        name = os.path.basename(meta)[: -len(".json")]
        if not name.startswith("__grp__") and os.path.getmtime(meta) > since:
            names.add(name)
    return sorted(names)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", default="native", help="--ssm_state_mode of the server")
    p.add_argument("--mtp_step", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="the tiny checkpoint (a dry run)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--log", default=None, help="server log file (default: a temporary file)")
    p.add_argument("--start_timeout_s", type=float, default=240.0)
    a = p.parse_args(argv)
    cache_dir = os.environ.get("TRITON_CACHE_DIR", os.path.expanduser("~/.triton/cache"))
    from lightllm.tools.bench_serving import main as bench_serving

    log = a.log or tempfile.mkstemp(prefix="serving_compiles_", suffix=".log")[1]
    port = _free_port()
    argv_server = [
        "--model_dir",
        _model_dir(a.tiny),
        "--device",
        a.device,
        "--port",
        str(port),
        "--ssm_state_mode",
        a.mode,
        "--mtp_step",
        str(a.mtp_step),
    ]
    procs = [_start(argv_server, log)]
    compiled_rounds = 0
    try:
        _wait(f"http://127.0.0.1:{port}/health", procs, a.start_timeout_s)
        print(f"server log {log}")
        print("| round | dataset | requests | TTFT mean ms | TTFT p99 ms | TPOT mean ms | kernels compiled |")
        print("|---|---|---|---|---|---|---|", flush=True)
        for i, (dataset, n, rate) in enumerate(ROUNDS):
            mark = time.time()
            with contextlib.redirect_stdout(io.StringIO()):
                s = bench_serving(
                    [
                        "--base_url",
                        f"http://127.0.0.1:{port}",
                        "--dataset",
                        dataset,
                        "--num_prompts",
                        str(n),
                        "--max_concurrency",
                        str(n),
                        "--request_rate",
                        str(rate),
                        "--input_len",
                        "256",
                        "--output_len",
                        "32",
                        "--seed",
                        str(100 + i),
                    ]
                )
            compiled = kernels_written_since(cache_dir, mark)
            compiled_rounds += bool(compiled)
            kind = f"{dataset} at {rate}/s" if rate else dataset
            cells = [s["ttft"]["mean_ms"], s["ttft"]["p99_ms"], s["tpot"]["mean_ms"]]
            print(
                f"| {i} | {kind} | {s['num_requests']} | {' | '.join(f'{c:.1f}' for c in cells)} "
                f"| {', '.join(compiled) or '-'} |",
                flush=True,
            )
    finally:
        _stop(procs)
    return 1 if compiled_rounds else 0


if __name__ == "__main__":
    sys.exit(main())
