"""Run the real HTTP app and engine process on 127.0.0.1 (a free port) inside a test."""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import uvicorn

from lightllm.server.args import load_server_args
from lightllm.server.demo_checkpoint import random_demo_model_dir
from lightllm.server.dp.replicas import start_engines
from lightllm.server.http.app import create_app
from lightllm.server.http.server import uvicorn_config
from lightllm.server.tokenizer import Tokenizer

FAKE_RUNNER = "unit_tests.engine.fake_runner:create_fake_runner"


def fake_checkpoint(folder: Path, **fake_config) -> str:
    """A copy of the random demo checkpoint in `folder`/ckpt whose config.json also carries the fake runner's
    settings (`fake_step_delay_s`, `fake_fail_token`, ...)."""
    model_dir = Path(folder) / "ckpt"
    shutil.copytree(random_demo_model_dir(), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(fake_config)
    (model_dir / "config.json").write_text(json.dumps(config))
    return str(model_dir)


def slow_server(folder: Path, **flags) -> LiveServer:
    """The fake runner on the CPU with every step slowed to 20 ms, so requests stay in flight long enough for a test
    to act on them (fill the queue, send another request beside them)."""
    return LiveServer(model_dir=fake_checkpoint(folder, fake_step_delay_s=0.02), device="cpu", **flags)


def reasoning_and_content(r, stream: bool) -> tuple[str, str]:
    """A chat response's first choice as (reasoning_content, content), from JSON or joined from its SSE deltas."""
    if not stream:
        message = r.json()["choices"][0]["message"]
        return message.get("reasoning_content") or "", message["content"] or ""
    reasoning = content = ""
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[len("data: ") :])["choices"]:
                reasoning += choice["delta"].get("reasoning_content") or ""
                content += choice["delta"].get("content") or ""
    return reasoning, content


def single_threaded_env() -> dict[str, str]:
    """Environment for processes started by tests: one OpenMP thread each. Tests run several torch processes on
    few cores, and OpenMP workers spin-waiting on an oversubscribed CPU slow tiny forwards down a hundredfold."""
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def tiny_checkpoint_server(arch: str, reasoning_parser: str) -> LiveServer:
    """The fake runner behind a tiny `arch` checkpoint's tokenizer and chat template, n-gram drafts on: the server
    the HTTP tool-calling and structured-output tests talk to."""
    from lightllm.tools.make_tiny_model import tiny_model_dir

    return LiveServer(
        model_dir=str(tiny_model_dir(arch)),
        reasoning_parser=reasoning_parser,
        device="cpu",
        spec_ngram=3,
        max_running_requests=4,
        max_total_token_num=2048,
        chunked_prefill_size=64,
    )


class LiveServer:
    def __init__(self, runner_factory: str = FAKE_RUNNER, **flags):
        # the spawned engine process inherits this process's environment at start
        os.environ["OMP_NUM_THREADS"] = "1"
        self.args, self.info = load_server_args([], **flags)
        self.tokenizer = Tokenizer(self.info)
        self.engine = start_engines(self.args, self.info, runner_factory)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        app = create_app(self.args, self.info, self.tokenizer, self.engine)
        self.server = uvicorn.Server(uvicorn_config(app, self.args, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "HTTP server did not start"
            time.sleep(0.02)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def model(self) -> str:
        return self.args.served_model_name

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.engine.stop()
