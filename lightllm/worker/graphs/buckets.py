"""One CUDA graph per bucket of a forward over fixed-address buffers: batch buckets, capture, replay.

The decode forward (`DecodeGraphs`), the MTP draft (`DraftGraphs`) and the short prefill (`PrefillGraphs`, whose
buckets count tokens) run on persistent buffers whose first entries a step fills; each captures its forward once per bucket and replays it, or runs it eagerly where
no graph exists (CPU, graphs off, a failed capture).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """Row counts a graph is captured for: powers of two to 16, then steps of 8 to 64, then of 32."""
    sizes = [1, 2, 4, 8, 16] + list(range(24, 65, 8)) + list(range(96, max(max_batch, 96) + 1, 32))
    return sorted({min(s, max_batch) for s in sizes if s <= max_batch} | {max_batch})


class BucketGraphs:
    """`forward(size)` captured per bucket of `buckets` (ascending sizes: rows of a batch, or tokens);
    `fill_hold(size)` loads inputs that change no state."""

    def __init__(
        self, buckets: list[int], forward: Callable[[int], object], fill_hold: Callable[[int], None], what: str
    ):
        self.buckets = buckets
        self._forward, self._fill_hold, self._what = forward, fill_hold, what
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, object] = {}
        # the memory pool of the captured graphs (None before a capture)
        self.pool = None

    def bucket(self, size: int) -> int | None:
        """The smallest bucket holding `size`; None when it is larger than every bucket."""
        for b in self.buckets:
            if b >= size:
                return b
        return None

    def capture(self, pool=None) -> bool:
        """One graph per bucket, largest first (the smaller ones reuse its memory pool). Call after the kernels'
        warm-up/autotune. A failure is logged and leaves every bucket eager; returns whether graphs exist.
        `pool`: another set's pool to capture into, for sets whose replays never overlap and whose outputs are
        used before any other graph of the pool replays."""
        # Python's collector must not run mid-capture: a dead engine's graph it destroys frees its memory pool, an
        # illegal call while a stream captures, which invalidates this capture
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()
        rng = torch.cuda.default_generators[torch.cuda.current_device()]
        rng_state = rng.clone_state()
        try:
            for rows in reversed(self.buckets):
                self._fill_hold(rows)
                # eager once: compiles kernels and settles allocations before capture
                self._forward(rows)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._outputs[rows] = self._forward(rows)
                pool = graph.pool()
                self._graphs[rows] = graph
            torch.cuda.synchronize()
            self.pool = pool
        except Exception:
            logger.exception("CUDA graph capture of %s failed; it runs eagerly", self._what)
            self._graphs.clear()
            self._outputs.clear()
            # a capture that ends in an error leaves the generator marked as capturing, and every later random
            # draw on the device raises: the eager fallback gets the state from before the capture back
            rng.graphsafe_set_state(rng_state)
        finally:
            if collecting:
                gc.enable()
        return bool(self._graphs)

    def run(self, rows: int):
        """The forward of a bucket over the buffers as filled: its graph's outputs, or an eager run."""
        if rows in self._graphs:
            self._graphs[rows].replay()
            return self._outputs[rows]
        return self._forward(rows)
