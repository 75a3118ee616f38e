"""`test/gpu/startup_check.py` (start the real server many times, one chat request each) on the CPU with the tiny
qwen3_5 checkpoint: a good start is a row `ok` with its usage, a server that refuses to start fails its row and the
run, a malformed mode is refused before anything starts."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from unit_tests.server.live_server import single_threaded_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "test" / "gpu" / "startup_check.py"


def _run(tmp_path: Path, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = single_threaded_env()
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", "--log_dir", str(tmp_path / "logs"), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_each_start_answers_a_chat_request_and_stops_cleanly(tmp_path):
    run = _run(tmp_path, "--starts", "1", "--modes", "compact+mtp")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = re.findall(
        r"^\| (\d+) \| \. \| compact\+mtp \| (\d+) \| ([\d.]+) \| (\d+)\+(\d+) \| ([\d.]+) \| ok \|$", run.stdout, re.M
    )
    # one start at 64 requests, then the one at 256; each with prompt and completion tokens in its usage
    assert [(r[0], r[1]) for r in rows] == [("0", "64"), ("1", "256")], run.stdout
    assert all(int(r[3]) > 0 and int(r[4]) > 0 for r in rows)
    assert "| . | compact+mtp | 2 | 2 |" in run.stdout and "2 starts; failures: 0" in run.stdout
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [
        "start00-compact-mtp-64.log",
        "start01-compact-mtp-256.log",
    ]


def test_a_server_that_does_not_start_fails_its_row(tmp_path):
    run = _run(tmp_path, "--starts", "1", "--modes", "bogus", "--big_max_running_requests", "0", timeout=120)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert re.search(r"^\| 0 \| \. \| bogus \| 64 \| - \| - \| [\d.]+ \| FAIL .*exited with code 2", run.stdout, re.M)
    assert "invalid choice: 'bogus'" in run.stdout, "the server's log tail is printed"
    assert "1 starts; failures: 1" in run.stdout


def test_a_malformed_mode_is_refused_before_anything_starts(tmp_path):
    run = _run(tmp_path, "--modes", "native+eagle", timeout=60)
    assert run.returncode == 2 and "STATE_MODE+mtp" in run.stderr
    assert not (tmp_path / "logs").exists()


def test_another_tree_runs_its_own_server(tmp_path):
    """`--trees`: each tree's server is started from its own copy, in turn. The other copy here is a stand-in whose
    api_server only says which it is and exits."""
    other = tmp_path / "other"
    (other / "lightllm" / "server").mkdir(parents=True)
    (other / "lightllm" / "__init__.py").write_text("")
    (other / "lightllm" / "server" / "__init__.py").write_text("")
    (other / "lightllm" / "server" / "api_server.py").write_text("print('the other tree')\nraise SystemExit(2)\n")
    run = _run(
        tmp_path, "--starts", "1", "--modes", "replay", "--big_max_running_requests", "0", "--trees", f".,{other}"
    )
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert re.search(r"^\| 0 \| \. \| replay \| 64 \| [\d.]+ \| \d+\+\d+ \| [\d.]+ \| ok \|$", run.stdout, re.M)
    assert re.search(rf"^\| 1 \| {re.escape(str(other))} \| replay \| 64 \| - \| .* FAIL .*code 2", run.stdout, re.M)
    assert "the other tree" in run.stdout and "2 starts; failures: 1" in run.stdout
