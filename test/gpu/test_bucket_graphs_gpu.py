"""`BucketGraphs.capture` on the GPU: a dead graph that Python's collector would destroy mid-capture does not
invalidate the capture, and a capture that fails leaves the device's random generator usable (the eager fallback
still samples)."""

from __future__ import annotations

import gc

import pytest
import torch

from lightllm.worker.graphs.buckets import BucketGraphs

pytestmark = pytest.mark.gpu

BUCKETS = [4, 8]


class _Cycle:
    """A captured graph kept alive only by a reference cycle, as a dropped engine's graphs are."""

    def __init__(self):
        self.me = self
        x = torch.randn(1 << 20, device="cuda")
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.y = x * 2


def _graphs(forward_extra=lambda: None):
    x = torch.randn(max(BUCKETS), device="cuda")

    def forward(rows):
        forward_extra()
        return x[:rows] * 3 + 1

    return BucketGraphs(BUCKETS, forward, lambda rows: None, "test steps"), x


def _churn():
    """Enough container allocations to trigger the collector's youngest generation several times."""
    return [[i] for i in range(20000)]


def test_capture_survives_a_dead_graph_collected_mid_capture():
    gc.collect()
    _Cycle()  # garbage from here on, freed only by the collector
    graphs, x = _graphs(_churn)
    assert graphs.capture(), "capture failed (see the log)"
    for rows in BUCKETS:
        out = graphs.run(rows)
        assert torch.equal(out, x[:rows] * 3 + 1)
    x.normal_()
    assert torch.equal(graphs.run(8), x * 3 + 1), "the graph did not replay over the current buffer"


def _bare_capture(body) -> bool:
    """`body` captured under a bare `torch.cuda.graph`; whether the capture failed. The generator state from before
    is put back either way, so a failure here does not leak into later tests."""
    rng = torch.cuda.default_generators[torch.cuda.current_device()]
    state = rng.clone_state()
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            body()
        torch.cuda.synchronize()
        return False
    except Exception:
        return True
    finally:
        rng.graphsafe_set_state(state)


def test_a_dead_graph_collected_mid_capture_breaks_a_plain_capture():
    """The twin: a collection inside a bare capture, with the same garbage about, invalidates it."""
    gc.collect()
    _Cycle()
    x = torch.randn(8, device="cuda")
    assert _bare_capture(lambda: (gc.collect(), x * 3))


def test_failed_capture_falls_back_eager_and_the_generator_still_draws():
    def sync_inside_capture():
        torch.cuda.synchronize()  # not allowed while a stream captures: the capture fails

    graphs, x = _graphs(sync_inside_capture)
    assert not graphs.capture()
    assert torch.equal(graphs.run(4), x[:4] * 3 + 1)  # eager
    draws = torch.randn(100000, device="cuda")
    assert 0.9 < draws.std().item() < 1.1


def test_failed_capture_without_the_restore_leaves_the_generator_unusable():
    """The twin: after a bare failed capture, a draw on the device raises until the state is put back."""
    rng = torch.cuda.default_generators[torch.cuda.current_device()]
    state = rng.clone_state()
    try:
        with pytest.raises(RuntimeError):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                torch.cuda.synchronize()
        with pytest.raises(RuntimeError, match="graph capture"):
            torch.randn(8, device="cuda")
    finally:
        rng.graphsafe_set_state(state)
    assert torch.randn(8, device="cuda").isfinite().all()
