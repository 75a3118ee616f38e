"""The concurrency the start-up log reports is the concurrency served: with more requests waiting than it, every
state mode (with MTP, whose verify windows need room per request) runs that many at once, leaves no linear-state
slot free while requests wait, and gets every slot back when they finish. A pool that reserved slots it could
never hand out (a server reporting 5 and running 4) fails here; the twin holds one slot back to show it."""

from __future__ import annotations

import re

import pytest

from lightllm.engine.messages import Finished, NewRequest
from lightllm.engine.sampling_params import SamplingParams
from lightllm.server.llm import LLM

MAX_RUNNING = 5


def serve_past_capacity(mode: str, mtp_step: int, held_back: int = 0) -> tuple[int, int, int, int]:
    """Submit three requests more than the reported concurrency and drive them to the end; `held_back` slots are
    taken from the pool after the report. Returns (reported, most running at once, finished, free slots at the end
    minus free at the start)."""
    with LLM(
        device="cpu",
        ssm_state_mode=mode,
        mtp_step=mtp_step,
        max_running_requests=MAX_RUNNING,
        max_req_total_len=256,
        disable_prefix_cache=True,
    ) as llm:
        engine = llm.engine
        reported = int(re.match(r"up to (\d+) concurrent requests", engine.capacity_report()).group(1))
        for _ in range(held_back):
            engine.runner.add_request()
        free_at_start = engine.runner.num_free_requests()
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        for i in range(reported + 3):
            assert engine.add_request(NewRequest(f"r{i}", [5 + i, 9, 11, 4], params, [])) == []
        most, finished = 0, 0
        for _ in range(500):
            if not engine.has_work():
                break
            finished += sum(isinstance(out, Finished) for out in engine.step())
            most = max(most, len(engine.scheduler.running))
            if engine.scheduler.waiting:
                # requests wait only when every slot is taken (a request finishing in this step holds its slot
                # until its end is read back)
                assert engine.runner.num_free_requests() == 0, mode
        return reported, most, finished, engine.runner.num_free_requests() - free_at_start


@pytest.mark.parametrize("mode,mtp_step", [("native", 2), ("compact", 2), ("replay", 2), ("replay", 0)], ids=str)
def test_the_reported_concurrency_runs_at_once_with_no_slot_idle(mode, mtp_step):
    reported, most, finished, slots_lost = serve_past_capacity(mode, mtp_step)
    assert reported == MAX_RUNNING and most == reported
    assert finished == reported + 3 and slots_lost == 0


def test_twin_a_slot_held_back_after_the_report_is_seen():
    reported, most, finished, slots_lost = serve_past_capacity("native", 2, held_back=1)
    assert most == reported - 1 and finished == reported + 3 and slots_lost == 0
