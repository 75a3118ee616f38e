"""`test/benchmark/bench_structured_output.py` on the CPU at tiny size: free and constrained runs alternate in one
engine, each emits its full length (the schema cannot end sooner), constrained steps compute masks, and the ratio
is printed; with --synthetic_vocab the grammar runs over the generated tokenizer; `--phases` splits the steps'
host time by part, where only the constrained run spends time on masks."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from lightllm.tools.make_tiny_model import tiny_model_dir
from unit_tests.server.live_server import single_threaded_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "test" / "benchmark" / "bench_structured_output.py"


def test_free_and_constrained_side_by_side():
    model = tiny_model_dir("qwen3_5", vocab_size=1024)
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--model_dir", str(model), "--synthetic_vocab", "700"]
    cmd += ["--batch", "3", "--input_len", "8", "--output_len", "12", "--repeats", "1", "--phases"]
    env = single_threaded_env()
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    assert "tokenizer 956 tokens" in out and "schema records" in out
    # run, step ms, tok/s, mask ms, GPU ms ("-" on the CPU)
    rows = dict(re.findall(r"^(free 0|constrained 0)\s+[\d.]+\s+[\d.]+\s+([\d.]+)\s+-$", out, re.M))
    assert float(rows["free 0"]) == 0 and float(rows["constrained 0"]) > 0
    assert re.search(r"^constrained / free = \d+\.\d{3}$", out, re.M)
    header = re.search(r"^\| run \| (.*) \|$", out, re.M).group(1).split(" | ")
    parts = {
        m.group(1): dict(zip(header, map(float, m.group(2).split(" | "))))
        for m in re.finditer(r"^\| (free 0|constrained 0) \| (.*) \|$", out, re.M)
    }
    assert {"forward", "masks", "mask_fill", "mask_wait", "advance", "read_wait", "emit"} <= set(header)
    # a free step only passes through the mask call; an overlapped constrained step fills its masks in a job
    assert parts["constrained 0"]["mask_fill"] > 0 and parts["free 0"]["mask_fill"] == 0
    assert parts["constrained 0"]["forward"] > 0 and parts["free 0"]["forward"] > 0
