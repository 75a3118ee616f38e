"""`DeviceDrafts` / `draft_matrix`: drafts left on the device keep their length on the host, slices from the start
stay unread, the matrix the batch builder and the verifiers use is gathered without a read-back, and any other
reader gets the true values through one read-back of the drafting call."""

from __future__ import annotations

import pytest
import torch

from lightllm.engine.sampling_params import SamplingParams
from lightllm.engine.speculative.device_drafts import (
    DraftBatch,
    decode_draft_ids,
    draft_matrix,
    has_device_drafts,
    host_drafts,
)
from lightllm.engine.speculative.verify import verify_greedy_windows
from unit_tests.engine.fake_runner import FakeRunner
from unit_tests.engine.helpers import make_engine, run


class CountingBatch(DraftBatch):
    def __init__(self, tensor):
        super().__init__(tensor)
        self.num_reads = 0

    def host(self):
        self.num_reads += 1
        return super().host()


def _batch(rows: int = 4, width: int = 3, seed: int = 0) -> CountingBatch:
    g = torch.Generator().manual_seed(seed)
    return CountingBatch(torch.randint(0, 97, (rows, width), generator=g))


def test_length_and_slices_stay_on_the_device():
    batch = _batch()
    d = batch.row(2, 3)
    assert len(d) == 3 and len(d[:2]) == 2 and len(d[:0]) == 0 and len(d[:-1]) == 2 and len(d[:9]) == 3
    assert has_device_drafts([[], d]) and not has_device_drafts([[], d[:0]])
    assert host_drafts(d[:2]) == [0, 0]
    assert batch.num_reads == 0
    # reading a value reads the whole call's drafts once
    assert d[1] == int(batch.tensor[2, 1]) and list(d[:2]) == batch.tensor[2, :2].tolist()
    assert list(batch.row(0, 3)) == batch.tensor[0].tolist()
    assert batch.num_reads == 3 and not has_device_drafts([d]) and host_drafts(d) == batch.tensor[2].tolist()
    with pytest.raises(ValueError, match="4 drafts of a row holding 3"):
        batch.row(0, 4)


def test_draft_matrix_gathers_without_reading_back():
    a, b = _batch(seed=1), _batch(rows=2, width=2, seed=2)
    drafts = [a.row(3, 2), [5, 6, 7], [], b.row(1, 1), a.row(0, 3)]
    matrix = draft_matrix(drafts, torch.device("cpu"))
    expected = [
        a.tensor[3, :2].tolist() + [-1],
        [5, 6, 7],
        [-1, -1, -1],
        b.tensor[1, :1].tolist() + [-1, -1],
        a.tensor[0].tolist(),
    ]
    assert matrix.tolist() == expected
    assert a.num_reads == 0 and b.num_reads == 0
    assert decode_draft_ids(drafts).tolist() == expected
    assert decode_draft_ids([[1], [2, 3]]) is None
    # twin: another batch's values give another matrix
    assert draft_matrix([_batch(seed=9).row(3, 2)], torch.device("cpu")).tolist() != [expected[0][:2]]


def test_draft_matrix_of_whole_rows_of_one_call():
    """The steady state (every row a whole unread row of one drafting call), in the call's order or another."""
    batch = _batch(rows=5, seed=3)
    in_order = draft_matrix([batch.row(i, 3) for i in range(5)], torch.device("cpu"))
    assert in_order.tolist() == batch.tensor.tolist()
    order = [4, 0, 2]
    assert draft_matrix([batch.row(i, 3) for i in order], torch.device("cpu")).tolist() == batch.tensor[order].tolist()
    # a shorter row among them takes the padded path: -1 after its drafts
    mixed = draft_matrix([batch.row(4, 3), batch.row(0, 1)], torch.device("cpu")).tolist()
    assert mixed == [batch.tensor[4].tolist(), [int(batch.tensor[0, 0]), -1, -1]]
    assert batch.num_reads == 0


def test_verify_greedy_windows_reads_device_drafts_with_its_one_transfer():
    """Device drafts verify like the same drafts as host lists; their values come back with the counts."""
    torch.manual_seed(0)
    vocab = 11
    batch = _batch(rows=3, width=2, seed=4)
    batch.tensor %= vocab
    logits = torch.randn(7, vocab)
    # window 0 keeps its first draft (its second is not the argmax), window 2 both: they keep 1, 0 and 2
    logits[0, int(batch.tensor[0, 0])] = 10.0
    logits[1, (int(batch.tensor[0, 1]) + 1) % vocab] = 10.0
    logits[4, int(batch.tensor[2, 0])] = 10.0
    logits[5, int(batch.tensor[2, 1])] = 10.0
    starts, widths = [0, 3, 4], [3, 1, 3]
    device = [batch.row(0, 2), [], batch.row(2, 2)]
    host = [batch.tensor[0].tolist(), [], batch.tensor[2].tolist()]
    on_device = verify_greedy_windows(starts, widths, device, logits)
    assert batch.num_reads == 0
    on_host = verify_greedy_windows(starts, widths, host, logits)
    assert [r.token_ids for r in on_device] == [r.token_ids for r in on_host]
    assert [r.num_accepted_drafts for r in on_device] == [1, 0, 2]
    # twin: shifted device values are what gets verified
    shifted = DraftBatch((batch.tensor + 1) % vocab)
    moved = verify_greedy_windows(starts, widths, [shifted.row(0, 2), [], shifted.row(2, 2)], logits)
    assert [r.num_accepted_drafts for r in moved] != [1, 0, 2]


def _mtp_engine(keep_on_device: bool, **runner_kw):
    runner = FakeRunner(max_width=3, **runner_kw)
    engine = make_engine(runner, mtp_step=2, max_req_total_len=100)
    engine.speculator.keep_on_device = keep_on_device
    return runner, engine


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.9, top_k=20, seed=7, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.7, repetition_penalty=1.3, seed=5, max_tokens=40, ignore_eos=True),
    ],
    ids=["greedy", "sampled", "penalties"],
)
def test_engine_with_device_drafts_equals_drafts_read_first_under_preemption(params):
    """MTP drafts on the device and read back first give the same requests' outputs, also when KV pressure
    preempts requests holding unread drafts and when sampled or penalised rows read them on the host."""
    prompts = {f"r{i}": [(7 * i + j) % 50 + 3 for j in range(4 + 3 * i)] for i in range(6)}
    results = []
    for keep_on_device in (True, False):
        runner, engine = _mtp_engine(keep_on_device, max_requests=6, kv_tokens=200)
        results.append(run(engine, prompts, params))
        assert engine.scheduler.num_preemptions > 0
        assert runner.num_free_kv_tokens() == 200
    assert results[0] == results[1]
    if params.greedy:
        assert results[0][0] == {rid: FakeRunner().greedy(ids, 40) for rid, ids in prompts.items()}


def test_engine_greedy_device_drafts_are_never_read_on_their_own(monkeypatch):
    reads = []
    original = DraftBatch.host
    monkeypatch.setattr(DraftBatch, "host", lambda self: reads.append(1) or original(self))
    _, engine = _mtp_engine(True)
    run(engine, {"a": [3, 1, 4, 1, 5], "b": [9, 2, 6]}, SamplingParams(temperature=0, max_tokens=20))
    assert reads == [] and engine.stats.num_spec_windows > 0
    # twin: a sampled row verifies on the host, which reads its drafts back
    _, engine = _mtp_engine(True)
    run(engine, {"a": [3, 1, 4, 1, 5]}, SamplingParams(temperature=0.8, seed=1, max_tokens=20))
    assert reads


def test_engine_nan_row_fails_alone_beside_device_drafts():
    """A row whose verify window turns NaN (a token of its own continuation poisons its logits) fails alone while
    its neighbours' device drafts verify as usual: their text is greedy's, and equal to drafts read back first."""
    good_prompt, bad_prompt = [1, 2, 1, 2], [7, 3, 9]
    expected = FakeRunner().greedy(good_prompt, 24)
    bad_continuation = FakeRunner().greedy(bad_prompt, 24)
    nan_token = next(t for t in bad_continuation[4:] if t not in expected and t not in good_prompt)
    results = []
    for keep_on_device in (True, False):
        runner = FakeRunner(nan_token=nan_token, max_width=3)
        engine = make_engine(runner, mtp_step=2)
        engine.speculator.keep_on_device = keep_on_device
        tokens, finished = run(engine, {"bad": bad_prompt, "good": good_prompt}, SamplingParams(temperature=0))
        assert finished["bad"].reason == "error" and "NaN" in finished["bad"].error
        assert len(tokens["bad"]) >= 5 and tokens["bad"] == bad_continuation[: len(tokens["bad"])]
        assert tokens["good"] == expected[: len(tokens["good"])] and finished["good"].reason == "length"
        assert runner.num_free_requests() == 8
        results.append((tokens, {rid: f.reason for rid, f in finished.items()}))
    assert results[0] == results[1]
