"""The HTTP front-end serves with its start-up objects frozen out of the cyclic collector (`server.collector`)."""

from __future__ import annotations

import gc

import uvicorn

from lightllm.server import api_server
from lightllm.server.args import load_server_args
from unit_tests.server.live_server import FAKE_RUNNER


def _serve_and_look(monkeypatch) -> dict:
    """Run `api_server.serve` with the fake engine up to the point where uvicorn would serve, and record there
    whether the app (made at start-up) and an object made then are still tracked by the collector."""
    seen = {}

    def run(server, sockets=None):
        fresh = [[]]  # a list is always tracked
        tracked = {id(o) for o in gc.get_objects()}
        seen.update(app=id(server.config.app) in tracked, fresh=id(fresh) in tracked)

    monkeypatch.setattr(uvicorn.Server, "run", run)
    args, info = load_server_args([], device="cpu", max_total_token_num=2048)
    try:
        assert api_server.serve(args, info, FAKE_RUNNER) == 0
    finally:
        gc.unfreeze()
    return seen


def test_the_front_end_serves_with_its_start_up_objects_frozen(monkeypatch):
    seen = _serve_and_look(monkeypatch)
    # frozen objects are out of the collector's generations: a full collection never scans the app again
    assert seen == {"app": False, "fresh": True}


def test_twin_without_the_freeze_the_app_stays_in_the_collectors_reach(monkeypatch):
    monkeypatch.setattr("lightllm.server.collector.freeze_startup_objects", lambda: None)
    assert _serve_and_look(monkeypatch) == {"app": True, "fresh": True}
