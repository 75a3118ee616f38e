"""`DeviceDrafts` / `draft_matrix`: drafts left on the device keep their length on the host, slices from the start
stay unread, the matrix the batch builder and the verifiers use is gathered without a read-back, and any other
reader gets the true values through one read-back of the drafting call."""

from __future__ import annotations

import pytest
import torch

from lightllm.engine.speculative.device_drafts import (
    DraftBatch,
    decode_draft_ids,
    draft_matrix,
    has_device_drafts,
    host_drafts,
)
from lightllm.engine.speculative.verify import verify_greedy_windows


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
