"""Simulated acceptance for benchmarks: each draft position is accepted with a fixed probability, whatever the model
says, so the speed of speculation can be measured at a chosen acceptance rate on any checkpoint (random weights
accept almost nothing).

A window `[last, d_1, ..., d_k]` keeps its first n drafts, n being the number of leading successes of k
independent coins of probability p (so n = j with probability p^j (1 - p) for j < k, and n = k with p^k), then
one token drawn from the model's distribution at window position n (the first rejected position, or the bonus
position after the last draft). The emitted tokens are therefore always what the state holds: an accepted
position emits its draft, the following token is the model's own choice given those drafts. A draft that is a stop
token where min_tokens bans stop tokens is never kept (the run ends before it): the request must not end there.

A window's coins depend only on the seed, its request and the window's index among that request's windows, never
on which other rows share its step, so a step that chains windows before the host has read its predecessor (overlap)
keeps the same drafts as a synchronous step.

Reached only by an engine built with it (`Engine(..., acceptance=SimulatedAcceptance(p, seed))`), which the
offline benchmark does; the server has no flag for it, since its outputs are not the model's.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import numpy as np
import torch

from lightllm.cache.device_copy import list_to_device
from lightllm.engine.request import Request
from lightllm.engine.sampler import RowContext, Sampler
from lightllm.engine.speculative.device_drafts import draft_matrix
from lightllm.engine.speculative.verify import WindowResult, read_with_drafts, window_nan_counts

# (request, first logits row, window width, drafts) as the engine lists the windows of a step
Window = tuple[Request, int, int, list[int]]

_MASK64 = (1 << 64) - 1
# coin counters of one window: index * _MAX_DRAFTS + position (no window has this many drafts)
_MAX_DRAFTS = 1 << 16


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser over uint64 arrays (wrapping arithmetic): a counter-based source of coins."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _short_of_banned(req: Request, drafts, n: int) -> int:
    """`n` kept drafts cut before the first stop token at a position min_tokens still bans it from: kept, it would
    end the request early, where the model's own verification never keeps it (its target gives it no mass)."""
    early = min(n, req.params.min_tokens - len(req.output_ids))
    if early <= 0:
        return n
    return next((i for i, token in enumerate(drafts[:early]) if token in req.stop_ids), n)


class SimulatedAcceptance:
    """Acceptance strategy: accept each draft position with probability `probability` (seeded, host-side coins)."""

    def __init__(self, probability: float, seed: int = 0):
        if not 0.0 <= probability <= 1.0:
            raise ValueError(f"simulated acceptance probability must be in [0, 1], got {probability}")
        self.probability = probability
        self._seed = np.uint64(seed & _MASK64)
        # windows drawn so far per request id (a benchmark's requests: a few thousand entries)
        self._windows: dict[str, int] = {}

    def num_kept_drafts(self, req_ids: list[str], num_drafts: list[int]) -> list[int]:
        """For each request's next window, how many of its `num_drafts[i]` drafts are kept: the run of successes
        its coins start with."""
        k = max(num_drafts, default=0)
        index = np.asarray([self._next_window(r) for r in req_ids], dtype=np.uint64)
        if k == 0:
            return [0] * len(num_drafts)
        keys = _mix(np.asarray([zlib.crc32(r.encode()) for r in req_ids], dtype=np.uint64) ^ self._seed)
        counters = index[:, None] * np.uint64(_MAX_DRAFTS) + np.arange(k, dtype=np.uint64)[None, :]
        uniform = (_mix(_mix(keys[:, None] ^ counters)) >> np.uint64(11)).astype(np.float64) * 2.0**-53
        runs = np.cumprod(uniform < self.probability, axis=1).sum(axis=1)
        return [min(int(run), n) for run, n in zip(runs, num_drafts)]

    def _next_window(self, req_id: str) -> int:
        n = self._windows.get(req_id, 0)
        self._windows[req_id] = n + 1
        return n

    def verify(
        self,
        windows: list[Window],
        logits: torch.Tensor,
        sampler: Sampler,
        row_context: Callable[[Request, list[int], torch.device], RowContext],
    ) -> list[WindowResult | None]:
        """The tokens of every window (see the module docstring); None for a window whose logits hold a NaN, as
        the model's own verification does. One host transfer for the whole step."""
        if not windows:
            return []
        device = logits.device
        kept = self.num_kept_drafts([req.req_id for req, *_ in windows], [len(drafts) for *_, drafts in windows])
        kept = [_short_of_banned(req, drafts, n) for (req, _, _, drafts), n in zip(windows, kept)]
        positions = list_to_device([start + n for (_, start, _, _), n in zip(windows, kept)], torch.long, device)
        rows = logits[positions]
        if all(req.params.takes_raw_argmax for req, *_ in windows):
            next_tokens = rows.argmax(dim=-1)
        else:
            # only penalties and min_tokens look at the kept drafts (which such a row reads on the host)
            contexts = [
                row_context(req, list(drafts[:n]) if req.params.needs_output_history else [], device)
                for (req, _, _, drafts), n in zip(windows, kept)
            ]
            next_tokens = sampler.draw_tokens(sampler.target_probs(rows, contexts), contexts)
        starts = [start for _, start, _, _ in windows]
        widths = [width for _, _, width, _ in windows]
        nans = window_nan_counts(
            logits, list_to_device(starts, torch.long, device), list_to_device(widths, torch.long, device)
        )
        drafts = [d for *_, d in windows]
        padded = draft_matrix(drafts, device)
        host = read_with_drafts(torch.stack([next_tokens, nans], dim=1), padded, drafts)
        return [
            None if bad else WindowResult([*d[:n], t])
            for d, n, (t, bad) in zip(host.drafts, kept, host.rows, strict=True)
        ]
