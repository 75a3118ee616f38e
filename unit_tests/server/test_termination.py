"""SIGTERM is never lost: one whose SystemExit Python drops (the handler ran inside an object's finalizer during a
garbage collection) is still recorded, and the HTTP server and the engine's step loop stop on the record."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

# a process that takes SIGTERM inside a finalizer, says whether it noticed, then serves a trivial app on `port`
SCRIPT = """
import gc, os, signal, sys
from fastapi import FastAPI
from lightllm.server.args import load_server_args
from lightllm.server.http.server import HttpServer, uvicorn_config
from lightllm.server.termination import exit_on_sigterm, sigterm_received
import uvicorn

exit_on_sigterm()

class Dropped:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):
            pass

cycle = Dropped()
cycle.self = cycle
del cycle
gc.collect()
print("survived the signal; recorded:", sigterm_received(), flush=True)
app = FastAPI()
app.get("/ping")(lambda: "pong")
args, _ = load_server_args(["--device", "cpu", "--port", "{port}"])
server_class = {server_class}
server_class(uvicorn_config(app, args)).run()
sys.exit(7)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(server_class: str) -> tuple[subprocess.Popen, int]:
    port = _free_port()
    script = textwrap.dedent(SCRIPT).replace("{port}", str(port)).replace("{server_class}", server_class)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, port


def test_a_sigterm_dropped_in_a_finalizer_still_stops_the_http_server():
    proc, _ = _start("HttpServer")
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert "Exception ignored" in out and "SystemExit" in out, out
    assert "survived the signal; recorded: True" in out, out
    # the server stopped by itself, as a normal return from run()
    assert proc.returncode == 7, out


def test_twin_plain_uvicorn_keeps_serving_after_the_dropped_sigterm():
    proc, port = _start("uvicorn.Server")
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ping", timeout=2).json() == "pong":
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        time.sleep(1.0)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait(30)


def _idle_loop_turns(record_at_turn: int | None, max_turns: int) -> int:
    """Turns an idle engine loop makes until it stops: SIGTERM is recorded at `record_at_turn` (if not None), and
    `keep_running` says no after `max_turns`."""
    import zmq

    from lightllm.engine.messages import EngineStats
    from lightllm.server import termination
    from lightllm.server.engine_loop import run_engine_loop

    turns = []

    class IdleRole:
        engine = type("IdleEngine", (), {"has_work": lambda self: False, "snapshot": lambda self: EngineStats()})()

        def has_work(self):
            return False

        def tick(self):
            turns.append(1)
            if len(turns) == record_at_turn:
                termination._received = True
            return []

    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind("inproc://termination-test")
    try:
        run_engine_loop(
            IdleRole(),
            inbox,
            None,
            idle_poll_ms=1,
            keep_running=lambda: len(turns) < max_turns,
            send=lambda outputs: None,
            log_name="log",
        )
    finally:
        inbox.close(0)
        ctx.term()
    return len(turns)


def test_the_engine_loop_stops_on_a_recorded_sigterm():
    assert _idle_loop_turns(record_at_turn=3, max_turns=50) == 3


def test_twin_the_engine_loop_runs_on_without_one():
    assert _idle_loop_turns(record_at_turn=None, max_turns=50) == 50


@pytest.fixture(autouse=True)
def _no_record_left(monkeypatch):
    from lightllm.server import termination

    monkeypatch.setattr(termination, "_received", False)
