"""A discarded overlapped MTP step: a request decoding alone reaches its length limit in step t while step t + 1
is already launched, so t + 1 rides along, every row of it finished when it is read (its tokens dropped) and none
of its drafts kept (its row has no room left). Every state slot no request holds is NaN and every free KV slot of
the model and of the MTP head is NaN before each engine step, so a step that read or wrote a neighbouring slot, or
a KV slot it released, would spread NaN. With real MTP drafts kept at a seeded simulated rate (so the MTP head's
state shapes the text), in every state mode and width: the overlapped run emits the synchronous run's tokens,
windows and finishes, log-probabilities to 1e-5, and the next turn of that request (its prompt, its answer, new
tokens), which resumes from the checkpoint held for the request's end, and a request stopping on a token beside
it, emit what a fresh engine emits for them alone. Twin: the held checkpoint taken from the neighbouring (NaN)
slot, as an off-by-one slot index would, breaks the next turn."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightllm.engine.speculative.acceptance import SimulatedAcceptance
from unit_tests.models.test_device_drafts_engine import _engine, drive

KEEP_PROBABILITY, SEED = 0.6, 3
PROMPT = [5, 6, 7, 8, 9, 10, 11]
ANSWER_LEN = 10
# the next turn and a request that stops arrive once the first request has finished, in either run
LATER = 16
OTHER_PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
# the stopping request stops on its STOP_AT + 1st token
STOP_AT = 6
NEXT_TURN_TOKENS = [41, 42, 43]


def _sim_engine(mode: str, mtp_step: int, fixed_buffers: bool):
    """An engine keeping real MTP drafts at the seeded rate (each request's coins its own)."""
    acceptance = SimulatedAcceptance(KEEP_PROBABILITY, seed=SEED)
    return _engine(mode, mtp_step, acceptance, fixed_buffers=fixed_buffers, max_running_requests=4)


def _alone(mode: str, mtp_step: int, requests, stop_ids=None):
    """Each request through a fresh synchronous engine of its own (no cache to resume from, nothing beside it)."""
    out = {}
    for rid, prompt, max_tokens, _ in requests:
        tokens, logprobs, finished, _ = drive(
            _sim_engine(mode, mtp_step, False), stop_ids or {}, abort=False, requests=[(rid, prompt, max_tokens, 0)]
        )
        out[rid] = (tokens[rid], logprobs[rid], finished[rid])
    return out


def _poison_free(runner) -> list[int]:
    """NaN in every state slot no request holds and in every free KV slot (model and MTP head); the state slots.
    The checkpoints published from slots given back meanwhile are exported first, as the runner does before
    anything writes a state slot."""
    runner._flush_checkpoints()
    held = {record.state_slot for record in runner._requests.values()}
    free = [s for s in range(runner.state.hold_slot) if s not in held]
    if free:
        index = torch.tensor(free)
        for tensor, slot_dim in runner.state._per_slot_tensors():
            if tensor.is_floating_point():
                tensor.index_fill_(slot_dim, index, float("nan"))
    for kv in (runner.kv, runner.drafter.kv):
        slots = torch.from_numpy(kv.allocator._stack[: kv.allocator.num_free()].copy())
        for buf in kv.buffers:
            buf.index_fill_(1, slots, float("nan"))
    return free


def _run(mode: str, mtp_step: int, overlap: bool, requests, stop_ids, shift_held: bool = False):
    """`requests` through a poisoned engine (fixed step buffers); its result, prefix-cache hit tokens, and per
    overlapped step read back whose rows had all finished: (its kept counts, whether a slot beside one of its
    rows was NaN at its launch)."""
    engine = _sim_engine(mode, mtp_step, True)
    engine.overlap_schedule = overlap
    runner = engine.runner
    poisoned: list[int] = []
    step = engine.step

    def poisoned_step():
        poisoned[:] = _poison_free(runner)
        return step()

    engine.step = poisoned_step
    spec = engine.overlap.spec
    launch, complete = spec.launch, spec.complete
    beside: dict[int, bool] = {}

    def launching(plan, previous):
        inflight = launch(plan, previous)
        if inflight is not None:
            slots = [runner._requests[h].state_slot for h in inflight.handles]
            beside[id(inflight)] = any(s + d in poisoned for s in slots for d in (-1, 1))
        return inflight

    discarded = []

    def reading(inflight):
        if all(row.req.is_finished for row in inflight.plan.decode):
            discarded.append(([count for count, _, _ in inflight.read()], beside[id(inflight)]))
        return complete(inflight)

    spec.launch, spec.complete = launching, reading
    if shift_held:
        # the held checkpoint read one slot over (a neighbour no request holds)
        hold, export = runner.hold_checkpoints, runner.state.export_checkpoint

        def shifted(handles):
            runner.state.export_checkpoint = lambda slots: export(slots + 1)
            try:
                hold(handles)
            finally:
                runner.state.export_checkpoint = export

        runner.hold_checkpoints = shifted
    result = drive(engine, stop_ids, abort=False, requests=requests)
    return result, runner.prefix_cache_stats()["num_hit_tokens"], discarded


@pytest.fixture(scope="module")
def scenario():
    """Per (mode, MTP step): the requests (the first alone, then its next turn beside a request that stops), the
    stop ids, and each request's output alone in a fresh engine."""
    cache = {}

    def build(mode: str, mtp_step: int):
        if (mode, mtp_step) not in cache:
            first = _alone(mode, mtp_step, [("a", PROMPT, ANSWER_LEN, 0), ("d", OTHER_PROMPT, 3 * STOP_AT, 0)])
            answer, stopper = first["a"][0], first["d"][0]
            stop = stopper[STOP_AT]
            assert stop not in stopper[:STOP_AT], "pick another STOP_AT: the stop token occurs earlier"
            requests = [
                ("a", PROMPT, ANSWER_LEN, 0),
                ("b", PROMPT + answer + NEXT_TURN_TOKENS, 12, LATER),
                ("d", OTHER_PROMPT, 3 * STOP_AT, LATER),
            ]
            stop_ids = {"d": [stop]}
            expected = {"a": first["a"], **_alone(mode, mtp_step, requests[1:], stop_ids)}
            cache[mode, mtp_step] = requests, stop_ids, expected
        return cache[mode, mtp_step]

    return build


@pytest.mark.parametrize("mtp_step", [1, 2, 3], ids=["W2", "W3", "W4"])
@pytest.mark.parametrize("mode", ["native", "compact", "replay"])
def test_a_discarded_step_beside_nan_slots_changes_nothing(mode, mtp_step, scenario):
    requests, stop_ids, expected = scenario(mode, mtp_step)
    (on, hits, discarded) = _run(mode, mtp_step, True, requests, stop_ids)
    (off, off_hits, _) = _run(mode, mtp_step, False, requests, stop_ids)
    tokens, logprobs, finished, chunks = on
    assert tokens == off[0] and finished == off[2] and chunks == off[3]
    for rid in tokens:
        assert torch.allclose(torch.tensor(logprobs[rid]), torch.tensor(off[1][rid]), atol=1e-5), rid
    # each request emits what it emits alone in a fresh engine: the next turn resumed from a correct checkpoint
    for rid, (want_tokens, want_logprobs, want_finish) in expected.items():
        assert tokens[rid] == want_tokens and finished[rid] == want_finish, rid
        assert np.allclose(logprobs[rid], want_logprobs, atol=1e-4), rid
    assert finished["a"] == ("length", ANSWER_LEN) and finished["d"] == ("stop", STOP_AT + 1)
    # the next turn resumed at the first request's end (its last token not fed yet), as the synchronous run's did
    assert hits == off_hits and hits >= len(PROMPT) + ANSWER_LEN - 1, (hits, off_hits)
    # the first request's last step rode along alone: read back with its row finished, no draft kept, and a NaN
    # slot beside its row when it was launched
    assert discarded and all(counts == [1] and nan_beside for counts, nan_beside in discarded), discarded
    # windows kept none and all of their drafts: the MTP head's drafts are in the text
    assert {1, mtp_step + 1} <= {n for rid in chunks for n in chunks[rid][1:]}, chunks


def test_twin_a_held_checkpoint_from_the_neighbouring_slot_breaks_the_next_turn(scenario):
    requests, stop_ids, expected = scenario("replay", 2)
    (tokens, _, finished, _), hits, discarded = _run("replay", 2, True, requests, stop_ids, shift_held=True)
    assert discarded and hits > 0
    want_tokens, _, want_finish = expected["b"]
    assert (tokens["b"], finished["b"]) != (want_tokens, want_finish), (tokens["b"], finished["b"])
