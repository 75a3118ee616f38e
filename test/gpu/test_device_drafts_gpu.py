"""MTP drafts left on the device, through captured CUDA graphs: per state mode the engine's tokens, log-probabilities
and finish reasons equal the same run with the drafts read back first (exactly) and with eager steps (tokens and
reasons; log-probabilities to rounding), with scripted drafts keeping 0 .. W - 1, an abort, a stop token inside a
window, length limits and slot reuse (`unit_tests/models/test_device_drafts_engine.py` is the CPU suite)."""

from __future__ import annotations

import pytest
import torch

from unit_tests.models.test_device_drafts_engine import (
    ABORTED,
    greedy_continuations,
    scripted_run,
    windows_follow_script,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("mode", ["native", "compact", "replay"])
def test_device_drafts_in_graphs_equal_host_drafts_and_eager(mode, monkeypatch):
    truth, stop_ids = greedy_continuations("cuda")
    graph, scripted, reads = scripted_run(mode, True, truth, stop_ids, monkeypatch, True, "cuda")
    host, _, _ = scripted_run(mode, False, truth, stop_ids, monkeypatch, True, "cuda")
    eager, _, _ = scripted_run(mode, True, truth, stop_ids, monkeypatch, False, "cuda")
    assert graph == host and reads == 0
    assert windows_follow_script(graph[3], scripted)
    for rid in graph[0]:
        if rid == ABORTED:
            continue
        assert graph[0][rid] == eager[0][rid] and graph[2][rid] == eager[2][rid], rid
        assert torch.allclose(torch.tensor(graph[1][rid]), torch.tensor(eager[1][rid]), atol=1e-4), rid
