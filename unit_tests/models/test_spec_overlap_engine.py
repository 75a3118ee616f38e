"""Overlapped MTP verify steps (`engine.spec_overlap`) with the real runner on a tiny Qwen3.5, through the decode
and draft buffers (eager on the CPU): in every state mode and verify width 2 .. 4 the engine emits the same tokens,
log-probabilities, finish reasons and windows with overlap on as with it off, with scripted drafts that keep
0 .. W - 1 of their tokens (scripted by position, chosen on the device for the windows launched before the host
read their predecessor), staggered arrivals, an abort, a stop token found a step late, length limits, slot reuse
and prefix-cache publishes. Twins: a chained step fed tokens moved by one, or positions not shifted by the counts
still in flight, change the text."""

from __future__ import annotations

import pytest
import torch

from lightllm.engine.speculative import MtpSpeculator
from lightllm.engine.speculative.acceptance import SimulatedAcceptance
from lightllm.engine.speculative.device_drafts import DraftBatch
from unit_tests.helpers.scripted_drafts import ScriptedDrafts, seeded_script
from unit_tests.models.test_device_drafts_engine import _engine, drive, greedy_continuations

# (request id, prompt, max_tokens, arrival step): long enough for chains of width-4 windows; four requests through
# two slots (slots are reused); "c" is aborted once it has ABORT_AFTER tokens, "d" stops on its STOP_AT + 1st
REQUESTS = [
    ("a", [5, 6, 7, 8, 9], 24, 0),
    ("b", list(range(30, 49)), 14, 0),
    ("c", [11, 12], 20, 2),
    ("d", [3, 1, 4, 1, 5, 9, 2, 6], 30, 3),
]
STOP_AT = 12
ABORT_AFTER = 8

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class ScriptedMtp(MtpSpeculator):
    """Real MTP drafting (the runner's head bookkeeping runs), the drafts then replaced by scripted ones: on the
    host before a synchronous step, and on the device for an overlapped step's successor (`script_on_device`)."""

    def __init__(self, num_drafts: int, scripted: ScriptedDrafts, device: torch.device):
        super().__init__(num_drafts)
        self.scripted, self.device = scripted, device

    def propose(self, reqs):
        super().propose(reqs)
        self.scripted.propose(reqs)
        if reqs:
            rows = [list(r.draft_ids) + [-1] * (self.num_drafts - len(r.draft_ids)) for r in reqs]
            batch = DraftBatch(torch.tensor(rows, dtype=torch.long, device=self.device))
            for i, req in enumerate(reqs):
                req.draft_ids = batch.row(i, len(req.draft_ids))


def script_on_device(engine, truth: dict[tuple[int, ...], list[int]], kept_log: list[int]) -> None:
    """Wrap the runner's `verify_on_device`: the head's drafts for the next windows become the script's, computed
    on the device from each row's output length there (the host's plus the counts it has not read)."""
    runner, scripted = engine.runner, engine.speculator.scripted
    k = engine.speculator.num_drafts
    original = runner.verify_on_device

    def scripted_verify(handles, *args, **kwargs):
        figures, logits = original(handles, *args, **kwargs)
        num_accepted = figures[:, k + 1]
        reqs = {r.handle: r for r in engine.scheduler.running}
        records = [runner._requests[h] for h in handles]
        in_flight = runner._unsettled[:-1]
        extra = torch.zeros(len(handles), dtype=torch.long)
        for entry in in_flight:
            position = {id(r): i for i, r in enumerate(entry.records)}
            for j, rec in enumerate(records):
                if id(rec) in position:
                    extra[j] += entry.counts[position[id(rec)]].cpu()
        out = figures.clone()
        for j, h in enumerate(handles):
            req = reqs.get(h)
            if req is None:
                continue
            continuation = torch.tensor(truth[tuple(req.prompt_ids)] + [0] * 16, dtype=torch.long)
            start = len(req.output_ids) + extra[j] + num_accepted[j].cpu()
            row = continuation[start : start + k].clone()
            wrong = scripted.script(scripted.next_window(req.req_id, int(start)), k)
            if wrong is not None:
                row[wrong] = (row[wrong] + 1) % runner.vocab_size
            kept_log.append(k if wrong is None else wrong)
            out[j, 1 : k + 1] = row.to(out.device)
        return out, logits

    runner.verify_on_device = scripted_verify


def script_drafts(engine, mtp_step: int, truth, kept_log: list[int]) -> None:
    """Scripted MTP drafts keyed by position (the same windows whichever path drafts them): on the host before a
    synchronous step, on the device for an overlapped step's successor (`script_on_device`, logging the kept
    counts it chose)."""
    scripted = ScriptedDrafts(truth, mtp_step, engine.runner.vocab_size, seeded_script, by_position=True)
    engine.speculator = ScriptedMtp(mtp_step, scripted, engine.runner.device)
    script_on_device(engine, truth, kept_log)


def shift_chained_tokens(previous, vocab_size: int) -> None:
    """The twins' broken input: the next tokens a chained step takes from its predecessor, moved by one."""
    previous.figures[:, 0] = (previous.figures[:, 0] + 1) % vocab_size


def spec_run(
    mode: str,
    mtp_step: int,
    overlap: bool,
    truth,
    stop_ids,
    corrupt: str | None = None,
    device: str = "cpu",
    requests=REQUESTS,
    max_running_requests: int = 2,
):
    """REQUESTS through an engine with scripted MTP drafts (on CUDA: through captured graphs); its result, the
    overlapped launches (chained or not), the kept counts the device script chose, the prefix-cache checkpoints
    stored, the requests whose in-flight step was dropped, and the chained launches that left out a finished row
    or held a row within two windows of its limit. The longest request fills a whole KV row (max_req_total_len)."""
    engine = _engine(
        mode,
        mtp_step,
        fixed_buffers=True,
        device=device,
        max_running_requests=max_running_requests,
        max_req_total_len=max(len(prompt) + max_tokens for _, prompt, max_tokens, _ in requests),
    )
    assert engine.runner.prefix_cache is not None
    engine.overlap_schedule = overlap
    launches, kept, dropped = [], [], []
    chains = {"without a finished row": 0, "near a limit": 0, "synchronous after the first": 0}
    script_drafts(engine, mtp_step, truth, kept)
    spec = engine.overlap.spec
    launch, forward = spec.launch, engine.runner.forward
    in_launch = []

    def counted_forward(batch):
        chains["synchronous after the first"] += bool(launches) and not in_launch
        return forward(batch)

    engine.runner.forward = counted_forward

    def counted(plan, previous):
        in_launch.append(True)
        try:
            return counted_launch(plan, previous)
        finally:
            in_launch.pop()

    def counted_launch(plan, previous):
        launches.append(previous is not None)
        if previous is not None:
            chains["without a finished row"] += len(plan.decode) < len(previous.plan.decode)
            chains["near a limit"] += any(r.req.num_remaining_tokens < 2 * (mtp_step + 1) for r in plan.decode)
        if corrupt == "tokens" and previous is not None:
            shift_chained_tokens(previous, engine.runner.vocab_size)
        return launch(plan, previous)

    spec.launch = counted
    complete = spec.complete

    def reading(inflight):
        # rows whose request finished after this step was launched (ride-alongs whose tokens are dropped)
        dropped.extend(row.req.req_id for row in inflight.plan.decode if row.req.is_finished)
        return complete(inflight)

    spec.complete = reading
    if corrupt == "positions":
        engine.runner._cached_extra = lambda records: None
    result = drive(engine, stop_ids, abort=requests is REQUESTS, requests=requests, abort_after=ABORT_AFTER)
    stored = engine.runner.prefix_cache_stats()["num_checkpoints_stored"]
    return result, launches, kept, stored, dropped, chains


@pytest.fixture(scope="module")
def continuations():
    # long enough for the drafts of the last windows at width 4
    return greedy_continuations(requests=REQUESTS, num_tokens=40, stop_at=STOP_AT)


@pytest.mark.parametrize("mtp_step", [1, 2, 3], ids=["W2", "W3", "W4"])
@pytest.mark.parametrize("mode", ["native", "compact", "replay"])
def test_overlapped_verify_equals_synchronous(mode, mtp_step, continuations):
    truth, stop_ids = continuations
    (on, launches, kept, stored, dropped, chains) = spec_run(mode, mtp_step, True, truth, stop_ids)
    (off, off_launches, _, off_stored, _, _) = spec_run(mode, mtp_step, False, truth, stop_ids)
    tokens, logprobs, finished, chunks = on
    # every window kept what the synchronous one did (the script is keyed by position), the aborted request's too
    assert chunks == off[3]
    assert tokens == off[0] and finished == off[2]
    for rid in tokens:
        assert torch.allclose(torch.tensor(logprobs[rid]), torch.tensor(off[1][rid]), atol=1e-5), rid
    # the aborted request stops where the host has seen enough of its tokens (as a stop string found in the text)
    assert len(tokens["c"]) >= ABORT_AFTER and finished["c"][0] == "abort"
    # the overlapped path ran, chained steps launched before their predecessor was read, the synchronous run none
    assert sum(launches) >= 4 and not off_launches
    # the stop token was read while a later step of its request was in flight: that step rode along, dropped
    assert "d" in dropped, dropped
    # the chain went on past a finish and through rows about to reach their limit
    assert chains["near a limit"], chains
    # windows chosen on the device kept every count of drafts
    assert set(kept) == set(range(mtp_step + 1)), kept
    # finished requests still fed the prefix cache
    assert stored > 0 and off_stored > 0
    assert finished["d"] == ("stop", STOP_AT + 1) and finished["a"] == ("length", 24)
    # the greedy text is the model's
    for rid, prompt, _, _ in REQUESTS:
        assert tokens[rid] == truth[tuple(prompt)][: len(tokens[rid])], rid


@pytest.mark.parametrize("mode", ["native", "replay"])
def test_chained_steps_leave_finished_rows_out(mode, continuations, monkeypatch):
    """Three requests decoding together, nothing waiting, finishing at their length limits one after another: each
    finish leaves its row out of the next chained step instead of ending the chain, with the synchronous text, and
    each still publishes its prefix-cache checkpoint at its end (held before the step it rode along in moved its
    state on). Twin: without the held checkpoints those publishes are lost."""
    truth, stop_ids = continuations
    staggered = [
        (f"{rid}-{n}", prompt, n, 0) for (rid, prompt, _, _), n in zip(REQUESTS[:2] + REQUESTS[3:], (9, 14, 24))
    ]
    on, launches, _, stored, _, chains = spec_run(mode, 3, True, truth, {}, requests=staggered, max_running_requests=3)
    off, _, _, off_stored, *_ = spec_run(mode, 3, False, truth, {}, requests=staggered, max_running_requests=3)
    assert stored == off_stored
    from lightllm.worker.runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "hold_checkpoints", lambda self, handles: None)
    *_, lost, _, _ = spec_run(mode, 3, True, truth, {}, requests=staggered, max_running_requests=3)
    assert lost < stored
    assert on[0] == off[0] and on[2] == off[2]
    assert {rid: reason for rid, (reason, _) in on[2].items()} == {rid: "length" for rid, *_ in staggered}
    assert chains["without a finished row"] >= 2, chains
    # once overlapped, every step chained from its predecessor to the end
    assert chains["synchronous after the first"] == 0 and all(launches[1:]), (chains, launches)


@pytest.mark.parametrize("corrupt", ["tokens", "positions"])
def test_overlapped_verify_twin_broken_inputs_change_the_text(corrupt, continuations):
    """Twin: a chained step fed its predecessor's next tokens moved by one, or run at positions that ignore the
    counts still in flight, no longer gives the synchronous text."""
    truth, stop_ids = continuations
    (on, launches, *_) = spec_run("replay", 2, True, truth, stop_ids, corrupt=corrupt)
    (off, *_) = spec_run("replay", 2, False, truth, stop_ids)
    assert sum(launches) >= 2
    assert on[0] != off[0]


@pytest.mark.parametrize(
    "mode, seed", [("native", 3), ("replay", 3), ("replay", 4)], ids=["native", "replay", "twin-other-coins"]
)
def test_overlapped_simulated_acceptance_equals_synchronous(mode, seed):
    """Simulated acceptance (the benchmarks' controlled rate) over real MTP drafts: the overlapped steps draw the
    same seeded coins for each request's windows as the synchronous verify (whatever rows share a step, and with
    full windows near a request's length limit, where the synchronous scheduler cuts them), so every window keeps
    the same drafts: the same tokens, finishes and acceptance counts, log-probabilities to float rounding (the
    batches differ). Twin: other coins under overlap keep other drafts."""
    runs = []
    for overlap in (True, False):
        engine = _engine(mode, 2, SimulatedAcceptance(0.6, seed=seed if overlap else 3), fixed_buffers=True)
        engine.overlap_schedule = overlap
        launches = []
        launch = engine.overlap.spec.launch
        engine.overlap.spec.launch = lambda plan, previous, launches=launches, launch=launch: (
            launches.append(previous is not None) or launch(plan, previous)
        )
        tokens, logprobs, finished, _ = drive(engine, {}, abort=False, requests=REQUESTS)
        runs.append((tokens, finished, engine.stats.accepted_length_counts, logprobs))
        assert (sum(launches) >= 4) == overlap
    assert (runs[0][:3] == runs[1][:3]) == (seed == 3)
    if seed == 3:
        for rid, values in runs[0][3].items():
            assert torch.allclose(torch.tensor(values), torch.tensor(runs[1][3][rid]), atol=1e-5), rid
    assert all(c > 0 for c in runs[0][2]), runs[0][2]
