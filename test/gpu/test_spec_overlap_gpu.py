"""Overlapped MTP verify steps through captured CUDA graphs (one graph a step: verify forward, acceptance, the
state's accept and the MTP head's drafts, with counts the host has not read): per state mode and width the engine's
tokens and finish reasons equal the synchronous run's and its log-probabilities to rounding, with scripted drafts
keeping 0 .. W - 1, staggered arrivals, an abort, a stop token read a step late, length limits, slot reuse and
prefix-cache publishes (`unit_tests/models/test_spec_overlap_engine.py` is the CPU suite, whose twins show that
broken inputs change the text)."""

from __future__ import annotations

import pytest
import torch

from unit_tests.models.test_device_drafts_engine import greedy_continuations
from unit_tests.models.test_spec_overlap_engine import ABORT_AFTER, REQUESTS, STOP_AT, spec_run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("mtp_step", [1, 2, 3], ids=["W2", "W3", "W4"])
@pytest.mark.parametrize("mode", ["native", "compact", "replay"])
def test_overlapped_verify_in_graphs_equals_synchronous(mode, mtp_step):
    truth, stop_ids = greedy_continuations("cuda", requests=REQUESTS, num_tokens=40, stop_at=STOP_AT)
    on, launches, kept, _, dropped, _ = spec_run(mode, mtp_step, True, truth, stop_ids, device="cuda")
    off, off_launches, *_ = spec_run(mode, mtp_step, False, truth, stop_ids, device="cuda")
    assert sum(launches) >= 4 and not off_launches and "d" in dropped
    assert set(kept) == set(range(mtp_step + 1)), kept
    for run in (on, off):
        assert len(run[0].pop("c")) >= ABORT_AFTER and run[2].pop("c")[0] == "abort"
    assert on[0] == off[0] and on[2] == off[2]
    for rid in on[0]:
        assert torch.allclose(torch.tensor(on[1][rid]), torch.tensor(off[1][rid]), atol=1e-4), rid
