"""StartupPhases on a scripted clock: each phase and mark records its own duration, in order; a failing phase is
still recorded."""

import pytest

from lightllm.worker.startup_phases import StartupPhases


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_phases_and_marks_record_their_own_durations_in_order():
    clock = Clock()
    phases = StartupPhases(clock)
    clock.now += 2.0
    phases.mark("memory")
    with phases.phase("warm-up"):
        clock.now += 5.25
    clock.now += 1.5
    phases.mark("graphs")
    assert phases.phases == [("memory", 2.0), ("warm-up", 5.25), ("graphs", 1.5)]
    clock.now += 0.5
    assert phases.summary() == "memory 2.0 s, warm-up 5.2 s, graphs 1.5 s (total 9.2 s)"


def test_a_mark_counts_from_the_end_of_the_phase_before_it_not_from_the_start():
    clock = Clock()
    phases = StartupPhases(clock)
    clock.now += 3.0
    with phases.phase("weights"):
        clock.now += 4.0
    clock.now += 1.0
    phases.mark("state")
    assert dict(phases.phases)["state"] == 1.0
    assert dict(phases.phases)["state"] != clock.now - 100.0


def test_a_failing_phase_is_recorded():
    clock = Clock()
    phases = StartupPhases(clock)
    with pytest.raises(RuntimeError), phases.phase("broken"):
        clock.now += 0.75
        raise RuntimeError("no device")
    assert phases.phases == [("broken", 0.75)]
