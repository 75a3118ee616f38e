"""`python -m lightllm.server.api_server` as a user runs it: the demo checkpoint, start-up refusals, and a clean
shutdown on SIGTERM / SIGINT that takes the engine process with it."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from unit_tests.server.conftest import wait_for
from unit_tests.server.live_server import single_threaded_env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server(*flags: str, tmpdir: str | None = None) -> subprocess.Popen:
    """The server as a user starts it; with `tmpdir`, its temporary files (the socket folder) go there, so a test
    sees its own server's and no other process's."""
    cmd = [sys.executable, "-m", "lightllm.server.api_server", *flags]
    env = single_threaded_env()
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _socket_dirs(tmpdir) -> set[str]:
    return set(glob.glob(os.path.join(str(tmpdir), "lightllm-*")))


def _wait_up(proc: subprocess.Popen, base: str) -> None:
    def up() -> bool:
        assert proc.poll() is None, proc.stdout.read()
        try:
            return httpx.get(f"{base}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(up, timeout_s=180, what="server start")


def _engine_pid(server_pid: int) -> int:
    # the other child is multiprocessing's resource tracker
    for pid in _children(server_pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"resource_tracker" not in f.read():
                return pid
    raise AssertionError("no engine process")


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--ssm_state_mode", "compact"], "add --mtp_step N or --spec_ngram K"),
        (["--run_mode", "pd_master", "--pd_node_timeout_s", "0"], "--pd_node_timeout_s must be positive"),
    ],
    ids=["compact-without-spec", "pd-master-timeout"],
)
def test_cli_refuses_bad_flags(flags, message):
    proc = subprocess.run(
        [sys.executable, "-m", "lightllm.server.api_server", *flags],
        capture_output=True,
        text=True,
        timeout=120,
        env=single_threaded_env(),
    )
    assert proc.returncode == 2
    assert "refusing to start" in proc.stderr and message in proc.stderr


def _readme_request_body() -> dict:
    """The JSON body of the README's example request."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    return json.loads(re.search(r"-d '(\{.*?\})'", readme).group(1))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_cli_serves_demo_model_and_shuts_down(sig, tmp_path):
    port = _free_port()
    proc = _server(
        "--port", str(port), "--device", "cpu", "--ssm_state_mode", "replay", "--mtp_step", "2", tmpdir=tmp_path
    )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_up(proc, base)
        assert _socket_dirs(tmp_path), "the running server's socket folder should be in its TMPDIR"
        models = httpx.get(f"{base}/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["tiny-qwen3_5"]
        body = {"model": "tiny-qwen3_5", "prompt": "Hello", "max_tokens": 5, "temperature": 0}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        # the README's request, as a newcomer sends it: an answer with text in it, each time
        for _ in range(3):
            r = httpx.post(f"{base}/v1/chat/completions", json=_readme_request_body(), timeout=60)
            assert r.status_code == 200 and len(r.json()["choices"][0]["message"]["content"] or "") > 10, r.text
        engines = _children(proc.pid)
        assert engines, "the engine process should be a child of the server"
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 0
        time.sleep(0.5)
        assert not any(_alive(p) for p in engines), "engine process outlived the server"
        # nothing left behind: no leaked-semaphore warning, no socket folder
        log = proc.stdout.read()
        assert "leaked" not in log and "Traceback" not in log, log[-2000:]
        assert not _socket_dirs(tmp_path), "the socket folder outlived the server"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_exits_nonzero_when_the_engine_dies(tmp_path):
    port = _free_port()
    proc = _server("--port", str(port), "--device", "cpu", tmpdir=tmp_path)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_up(proc, base)
        assert _socket_dirs(tmp_path), "the running server's socket folder should be in its TMPDIR"
        os.kill(_engine_pid(proc.pid), signal.SIGKILL)
        # a supervisor sees a non-zero exit and restarts the server
        assert proc.wait(timeout=60) == 3
        log = proc.stdout.read()
        assert "the engine process exited (exit code -9)" in log
        assert "leaked" not in log, log[-2000:]
        assert not _socket_dirs(tmp_path), "the socket folder outlived the server"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_stays_up_after_engine_death_when_asked():
    port = _free_port()
    proc = _server("--port", str(port), "--device", "cpu", "--keep_serving_after_engine_exit")
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_up(proc, base)
        os.kill(_engine_pid(proc.pid), signal.SIGKILL)
        wait_for(lambda: httpx.get(f"{base}/health", timeout=5).status_code == 503, what="health 503")
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_help_shows_defaults_but_not_the_key():
    env = {**single_threaded_env(), "LIGHTLLM_API_KEY": "do-not-print-me"}
    cmd = [sys.executable, "-m", "lightllm.server.api_server", "--help"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, check=True).stdout
    flat = " ".join(out.split())
    for expected in ("(default: 8000)", "(default: 127.0.0.1)", "(default: 1024)", "(default: $LIGHTLLM_API_KEY)"):
        assert expected in flat, expected
    assert "do-not-print-me" not in out
