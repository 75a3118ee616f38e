"""`test/gpu/loop_interference.py` (a background thread doing the host tier writer's kinds of work without the
tier, for `closed_loop.py --interfere`): specs are read or refused, each part runs at its rate until stopped."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("loop_interference", ROOT / "test" / "gpu" / "loop_interference.py")
loop_interference = importlib.util.module_from_spec(spec)
spec.loader.exec_module(loop_interference)


def test_specs_are_read_part_by_part():
    assert loop_interference.parse_spec("python:2@300") == [("python", 2.0, 300.0)]
    assert loop_interference.parse_spec("python:0.5@10+copy:17@150") == [("python", 0.5, 10.0), ("copy", 17.0, 150.0)]


@pytest.mark.parametrize("bad", ["python:2", "gil:2@300", "copy:x@1", "python:2@0", "python:-1@5"])
def test_a_bad_spec_is_refused_with_its_part(bad):
    with pytest.raises(ValueError, match="--interfere"):
        loop_interference.parse_spec(bad)


def test_each_part_runs_at_its_rate_until_stopped():
    work = loop_interference.Interference("python:1@50+copy:1@100", "cpu")
    work.start()
    time.sleep(1.0)
    line = work.stop()
    python, copies = work.events
    # about 50 and 100 events in the second (a slow host falls behind, never ahead)
    assert 20 <= python <= 55 and 40 <= copies <= 105, work.events
    assert line == f"{python} x python:1, {copies} x copy:1"
    time.sleep(0.2)
    assert work.events == [python, copies]
