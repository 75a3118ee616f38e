"""`build_engine`'s GIL switch interval: short while the runner starts (its background threads run Python for
seconds beside the weights' load), kept for serving, and the process's own again when the build fails; a runner
whose engine cannot be built is closed."""

from __future__ import annotations

import sys

import pytest

from lightllm.server.args import load_server_args
from lightllm.server.engine_process import GIL_SWITCH_S, build_engine
from unit_tests.engine.fake_runner import create_fake_runner
from unit_tests.server.live_server import fake_checkpoint

# the switch interval each factory call saw
SEEN: list[float] = []
PROCESS_INTERVAL = 0.0042


def recording_factory(args, info):
    SEEN.append(sys.getswitchinterval())
    return create_fake_runner(args, info)


def failing_factory(args, info):
    SEEN.append(sys.getswitchinterval())
    raise RuntimeError("no device for this runner")


@pytest.fixture
def args_info(tmp_path):
    return load_server_args([], model_dir=fake_checkpoint(tmp_path), device="cpu", max_total_token_num=256)


@pytest.fixture(autouse=True)
def process_interval():
    before = sys.getswitchinterval()
    sys.setswitchinterval(PROCESS_INTERVAL)
    SEEN.clear()
    yield
    sys.setswitchinterval(before)


def test_the_runner_starts_under_the_short_interval_and_serving_keeps_it(args_info):
    engine = build_engine(*args_info, f"{__name__}:recording_factory")
    assert engine.runner is not None
    assert SEEN == [pytest.approx(GIL_SWITCH_S)]
    assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_S)


def test_a_failed_build_puts_the_process_interval_back(args_info):
    with pytest.raises(RuntimeError, match="no device for this runner"):
        build_engine(*args_info, f"{__name__}:failing_factory")
    # twin of the test above: the factory ran under the short interval, which did not outlive the failure
    assert SEEN == [pytest.approx(GIL_SWITCH_S)]
    assert sys.getswitchinterval() == pytest.approx(PROCESS_INTERVAL)


CLOSED: list[object] = []


def closing_factory(args, info):
    """A runner whose engine cannot be built (a tensor-parallel runner has followers and a process group to stop)."""
    runner = create_fake_runner(args, info)
    runner.close = lambda: CLOSED.append(runner)
    return runner


def test_a_build_failing_after_the_runner_closes_it(args_info, monkeypatch):
    from lightllm.server import engine_process

    CLOSED.clear()

    def broken_engine(args, runner, acceptance=None):
        raise RuntimeError("the engine could not be built")

    monkeypatch.setattr(engine_process, "engine_for_runner", broken_engine)
    with pytest.raises(RuntimeError, match="could not be built"):
        build_engine(*args_info, f"{__name__}:closing_factory")
    assert len(CLOSED) == 1
    # twin: a build that succeeds leaves its runner open
    monkeypatch.undo()
    CLOSED.clear()
    engine = build_engine(*args_info, f"{__name__}:recording_factory")
    assert engine.runner is not None and CLOSED == []
