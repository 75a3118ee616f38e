"""Helpers of the prefill/decode tests with real processes: a pd_master (HTTP front and router) in the test's
process on a free port, and prefill/decode nodes as `lightllm.server.api_server` processes that register with it.
A node's stderr goes to a file (`node_log`): a pipe nobody reads would block a chatty node."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import threading

import httpx
import uvicorn

from lightllm.server.args import load_server_args
from lightllm.server.http.app import create_app
from lightllm.server.http.server import uvicorn_config
from lightllm.server.pd.master import add_pd_routes, start_router
from lightllm.server.tokenizer import Tokenizer
from unit_tests.server.conftest import wait_for
from unit_tests.server.live_server import single_threaded_env


class Master:
    """The pd_master's app and router in this process, on a free port."""

    def __init__(self, model_dir: str, node_timeout_s: float, queue_timeout_s: float = 5.0, **flags):
        self.args, self.info = load_server_args(
            [],
            model_dir=model_dir,
            run_mode="pd_master",
            pd_node_timeout_s=node_timeout_s,
            pd_queue_timeout_s=queue_timeout_s,
            **flags,
        )
        self.router, self.socket_dir = start_router(self.args)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        app = create_app(self.args, self.info, Tokenizer(self.info), self.router, None, self.router.serving_problem)
        add_pd_routes(app, self.router)
        self.server = uvicorn.Server(uvicorn_config(app, self.args, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, 60, "the master's HTTP server")
        self.url = f"http://127.0.0.1:{self.port}"

    def nodes(self, role: str) -> list[dict]:
        auth = {"Authorization": f"Bearer {self.args.api_key}"} if self.args.api_key else {}
        return [n for n in httpx.get(f"{self.url}/pd/nodes", headers=auth).json()["nodes"] if n["role"] == role]

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.router.stop()


def start_node(master: Master, model_dir: str, role: str, *flags: str, secret: str | None = None) -> subprocess.Popen:
    """A node process; `secret`: its --pd_secret (none: the master's, so it is accepted)."""
    secret = secret if secret is not None else master.args.pd_secret
    argv = ["--run_mode", role, "--model_dir", model_dir, "--pd_master_port", str(master.port), *flags]
    argv += ["--pd_secret", secret] if secret else []
    log = tempfile.NamedTemporaryFile("w+", prefix=f"lightllm-{role}-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "lightllm.server.api_server", *argv],
        stdout=subprocess.DEVNULL,
        stderr=log,
        text=True,
        env=single_threaded_env(),
    )
    proc.log_path = log.name
    log.close()
    return proc


def node_log(proc: subprocess.Popen) -> str:
    with open(proc.log_path) as f:
        return f.read()


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
