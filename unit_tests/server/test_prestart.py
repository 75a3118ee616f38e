"""The engine process started before the server resolves its flags (`server.prestart`): it becomes the engine when
given one, is stopped when not, and a prestarted process that died leaves the server a freshly spawned engine."""

from __future__ import annotations

import pytest

from lightllm.server import api_server
from lightllm.server.args import load_server_args
from lightllm.server.launcher import start_engine
from lightllm.server.prestart import PrestartedEngine
from unit_tests.server.live_server import FAKE_RUNNER, fake_checkpoint


@pytest.fixture(scope="module")
def args_info(tmp_path_factory):
    folder = tmp_path_factory.mktemp("prestart")
    return load_server_args([], model_dir=fake_checkpoint(folder), device="cpu", max_total_token_num=256)


def test_the_prestarted_process_becomes_the_engine(args_info):
    prestarted = PrestartedEngine(modules=(), import_fla=False)
    handle = start_engine(*args_info, FAKE_RUNNER, prestarted)
    try:
        assert handle.process is prestarted.process and handle.process.is_alive()
        assert "concurrent requests" in handle.capacity_report
        assert not prestarted.usable()
        # once it is the engine, discarding it is a no-op
        prestarted.discard()
        assert handle.process.is_alive()
    finally:
        handle.stop()
    assert not handle.process.is_alive()


def test_twin_a_discarded_process_is_stopped_and_a_fresh_engine_spawned(args_info):
    prestarted = PrestartedEngine(modules=(), import_fla=False)
    prestarted.discard()
    assert not prestarted.process.is_alive() and not prestarted.usable()
    with pytest.raises(RuntimeError, match="taken, discarded or has exited"):
        prestarted.take(())
    handle = start_engine(*args_info, FAKE_RUNNER, prestarted)
    try:
        assert handle.process is not prestarted.process and "concurrent requests" in handle.capacity_report
    finally:
        handle.stop()


def test_a_prestarted_process_that_died_leaves_a_fresh_spawn(args_info):
    prestarted = PrestartedEngine(modules=("lightllm.no_such_module",), import_fla=False)
    prestarted.process.join(60)
    assert prestarted.process.exitcode not in (None, 0)
    handle = start_engine(*args_info, FAKE_RUNNER, prestarted)
    try:
        assert handle.process is not prestarted.process and handle.process.is_alive()
    finally:
        handle.stop()


def test_a_refused_start_stops_the_prestarted_process(monkeypatch):
    started = []

    class Recorded(PrestartedEngine):
        def __init__(self):
            super().__init__(modules=(), import_fla=False)
            started.append(self)

    monkeypatch.setattr(api_server, "PrestartedEngine", Recorded)
    assert api_server.main(["--device", "cpu", "--port", "0"]) == 2
    assert len(started) == 1 and not started[0].process.is_alive()
