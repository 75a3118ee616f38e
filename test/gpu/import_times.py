"""What a server's start-up spends on imports, each in a fresh interpreter: torch, CUDA's initialisation and first
context, Triton's driver, fla-core's prefill modules as the engine imports them, and the API server's and the
engine's module trees (`python -X importtime` files for each go to `--log_dir`).

    python test/gpu/import_times.py [--log_dir DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# (name, code): run in this order in one fresh interpreter, each timed after the ones before it ran
STEPS = (
    ("import torch", "import torch"),
    ("torch.cuda.is_available", "torch.cuda.is_available()"),
    ("first CUDA tensor (context)", "torch.zeros(1, device='cuda') if torch.cuda.is_available() else None"),
    ("triton and its driver", "import triton; from triton.runtime.driver import driver; driver.active"),
    (
        "fla's prefill modules (the engine's import)",
        "from lightllm.linear_att.fla_pinning import fla_autotuners; fla_autotuners()",
    ),
)
TREES = {
    "api_server": "import lightllm.server.api_server",
    "engine": "import lightllm.server.prestart as p; [__import__(m) for m in p.ENGINE_MODULES]",
}


def timed_steps() -> list[tuple[str, float | None, str]]:
    """Each step's seconds (None and why when it failed, as Triton's driver does without a GPU), the steps run in
    order in one fresh interpreter."""
    code = f"""
import json, time
rows, scope = [], {{}}
for name, step in {STEPS!r}:
    t = time.perf_counter()
    try:
        exec(step, scope)
        rows.append((name, time.perf_counter() - t, ""))
    except Exception as exc:
        rows.append((name, None, f"{{type(exc).__name__}}: {{exc}}"[:120]))
print(json.dumps(rows))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return [tuple(row) for row in json.loads(out.stdout.strip().splitlines()[-1])]


def tree_seconds(code: str, log: Path) -> float:
    """Wall seconds of `code` in a fresh interpreter, its `-X importtime` lines written to `log`."""
    t = time.perf_counter()
    run = subprocess.run([sys.executable, "-X", "importtime", "-c", code], cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - t
    log.write_text(run.stderr)
    run.check_returncode()
    return seconds


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--log_dir", default="/tmp/import_times")
    a = p.parse_args(argv)
    log_dir = Path(a.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    print("| import | s |\n|---|---|")
    for name, seconds, failure in timed_steps():
        print(f"| {name} | {failure or f'{seconds:.2f}'} |", flush=True)
    for name, code in TREES.items():
        print(f"| {name} process, interpreter and imports | {tree_seconds(code, log_dir / f'{name}.txt'):.2f} |")


if __name__ == "__main__":
    main()
