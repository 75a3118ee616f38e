"""`test/gpu/prefix_cache_ttft.py` (prefix-cache TTFT cold vs hit) on the CPU with the tiny qwen3_5 checkpoint, its
ttft part: the hit resumes exactly the shared prefix (128 tokens: the cold request's first prefill chunk ended at
that interval boundary), the exact repeat all but its last token, the cache-off row follows, and the JSON holds every row. Twin: with checkpoints every 48
tokens the cold chunk is cut at 96, and the table says the hit resumed 96."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from unit_tests.server.live_server import single_threaded_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "test" / "gpu" / "prefix_cache_ttft.py"


def _run(tmp_path: Path, *args: str) -> tuple[str, list[dict]]:
    env = single_threaded_env()
    result = tmp_path / "rows.json"
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--tiny",
        "--device",
        "cpu",
        "--parts",
        "ttft",
        "--modes",
        "native",
        "--repeats",
        "1",
        "--result_file",
        str(result),
        *args,
    ]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout, json.loads(result.read_text())


def _hit_row(stdout: str) -> re.Match:
    row = re.search(
        r"^\| native \| 128\+12 \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x \| (\d+) \| ([\d.]+) \((\d+)\) \| \d+ \|$",
        stdout,
        re.M,
    )
    assert row is not None, stdout
    return row


def test_the_hit_resumes_the_whole_shared_prefix(tmp_path):
    stdout, rows = _run(tmp_path)
    row = _hit_row(stdout)
    assert int(row[4]) == 128 and float(row[1]) > 0 and float(row[2]) > 0
    # the exact repeat resumes all but its last token
    assert int(row[6]) == 128 + 12 - 1 and float(row[5]) > 0
    assert re.search(r"^\| native \| 128\+12 \| [\d.]+ \| - \| - \| cache off \| - \| \d+ \|$", stdout, re.M), stdout
    assert [(r["mode"], r["cache"], r.get("cached_tokens")) for r in rows] == [
        ("native", True, 128),
        ("native", False, None),
    ]


def test_twin_an_interval_that_cuts_the_prefix_earlier_resumes_less(tmp_path):
    stdout, _ = _run(tmp_path, "--interval", "48")
    assert int(_hit_row(stdout)[4]) == 96
