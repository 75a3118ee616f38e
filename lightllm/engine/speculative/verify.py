"""Decide how much of a draft window the target model keeps.

A decode window is `[last, d_1, ..., d_k]`; the target distribution at window position j, `p_j`, is the model's
next-token distribution given everything up to and including the window's token j. Drafts here (n-gram lookup
or greedy MTP chains) are deterministic, so the draft distribution is a point mass on `d_{j+1}` and the
rejection test reduces to: accept `d_{j+1}` with probability `p_j(d_{j+1})`; on rejection draw from `p_j` with
`d_{j+1}` removed and renormalised. The emitted tokens are then distributed exactly as if each had been sampled
from the target one at a time. Greedy rows (one-hot `p_j`) accept exactly the drafts that equal the argmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightllm.cache.device_copy import list_to_device
from lightllm.engine.logits_check import nonfinite_rows
from lightllm.engine.sampler import RowContext, Sampler
from lightllm.engine.speculative.device_drafts import draft_matrix, has_device_drafts


@dataclass
class WindowResult:
    # tokens emitted by this window: accepted drafts, then one corrected or bonus token
    token_ids: list[int]

    @property
    def num_accepted(self) -> int:
        """Window tokens whose state is kept: the last accepted token plus every accepted draft."""
        return len(self.token_ids)

    @property
    def num_accepted_drafts(self) -> int:
        return len(self.token_ids) - 1


def verify_window(
    sampler: Sampler, probs: torch.Tensor, draft_ids: list[int], row: RowContext, argmax: list[int] | None = None
) -> WindowResult:
    """Verify one window. `probs` [W, V] are the target distributions, `draft_ids` the W - 1 drafts.

    For a greedy row `argmax` (the W argmax tokens, computed for the whole batch at once) avoids a device sync
    per position; it is derived from `probs` when not given.
    """
    assert probs.shape[0] == len(draft_ids) + 1, f"{probs.shape[0]} distributions for {len(draft_ids)} drafts"
    if row.params.greedy:
        targets = argmax if argmax is not None else probs.argmax(dim=-1).tolist()
        accepted = 0
        while accepted < len(draft_ids) and draft_ids[accepted] == targets[accepted]:
            accepted += 1
        return WindowResult([*draft_ids[:accepted], targets[accepted]])
    tokens: list[int] = []
    for j, draft in enumerate(draft_ids):
        p = probs[j]
        if sampler.uniform(row, p.device) < float(p[draft]):
            tokens.append(draft)
            continue
        residual = p.clone()
        residual[draft] = 0.0
        total = residual.sum()
        # p was (almost) a point mass on the draft: a rounding-level rejection falls back to p itself
        residual = residual / total if total > 0 else p
        tokens.append(sampler.draw(residual, row))
        return WindowResult(tokens)
    tokens.append(sampler.draw(probs[len(draft_ids)], row))
    return WindowResult(tokens)


def verify_greedy_windows(
    starts: list[int], widths: list[int], drafts: list[Sequence[int]], logits: torch.Tensor
) -> list[WindowResult | None]:
    """Greedy verification of every window at once, counted on the logits' device: window i spans logits rows
    `starts[i] .. starts[i] + widths[i] - 1` and keeps its drafts while each equals the argmax before it. One host
    transfer brings back each window's accepted count, next token and NaN flag (and the drafts themselves when
    some are still on the device); None marks a window whose logits hold a NaN (that request fails alone)."""
    num = len(starts)
    if num == 0:
        return []
    device = logits.device
    argmax = logits.argmax(dim=-1)
    start = list_to_device(starts, torch.long, device)
    width = list_to_device(widths, torch.long, device)
    max_drafts = max(len(d) for d in drafts)
    padded = draft_matrix(drafts, device, max_drafts)
    if max_drafts:
        position = (start[:, None] + torch.arange(max_drafts, device=device)[None, :]).clamp(max=argmax.numel() - 1)
        kept = (padded == argmax[position]) & (padded >= 0)
        accepted = kept.long().cumprod(dim=-1).sum(dim=-1)
    else:
        accepted = torch.zeros(num, dtype=torch.long, device=device)
    nan_in_window = window_nan_counts(logits, start, width)
    host = read_with_drafts(torch.stack([accepted, argmax[start + accepted], nan_in_window], dim=1), padded, drafts)
    return [
        None if bad else WindowResult([*d[:n], nxt]) for (n, nxt, bad), d in zip(host.rows, host.drafts, strict=True)
    ]


@dataclass
class ReadBack:
    # per window, the values read back (one row of the step's figures)
    rows: list[list[int]]
    # per window, its drafts as host lists
    drafts: list[list[int]]


def read_with_drafts(figures: torch.Tensor, padded: torch.Tensor, drafts: list[Sequence[int]]) -> ReadBack:
    """One host transfer of `figures` [windows, F] and, when some drafts are still on the device, of `padded`
    [windows, D] (their `draft_matrix`) beside them: the step's one wait for the device."""
    if not has_device_drafts(drafts):
        return ReadBack(figures.tolist(), [list(d) for d in drafts])
    host = torch.cat([figures, padded.to(figures.dtype)], dim=1).tolist()
    f = figures.shape[1]
    return ReadBack([row[:f] for row in host], [row[f : f + len(d)] for row, d in zip(host, drafts)])


def window_nan_counts(logits: torch.Tensor, starts: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """[windows] int64 on the logits' device: how many of the rows `starts[i] .. starts[i] + widths[i] - 1` of
    `logits` cannot be sampled from (a NaN or +inf, or nothing finite: `logits_check.nonfinite_rows`)."""
    # such rows summed per window through a prefix sum: [0, n_0, n_0 + n_1, ...]
    flags = nonfinite_rows(logits).long()
    nan_before = torch.cat([flags.new_zeros(1), flags.cumsum(0)])
    return nan_before[starts + widths] - nan_before[starts]


def verify_full_windows_on_device(
    logits: torch.Tensor, drafts: torch.Tensor, kept: torch.Tensor | None = None, max_kept: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy verification left on the device, for windows that all hold K drafts: row i's window spans logits rows
    `i * W .. i * W + K` (W = K + 1), `drafts [n, K]` on the device. A window keeps its drafts while each equals the
    argmax before it (or `kept[i]` of them where `kept [n]` is not negative: simulated acceptance), at most
    `max_kept [n]` (a window cut at the request's length limit), then the argmax after the last kept one.

    Returns, all on the device: accepted counts `[n]` int64 (kept drafts + 1; 1 for a window whose logits cannot
    be sampled from, as `verify_greedy_windows` accepts for it), next tokens `[n]`, pair tokens `[n, W]` (the
    token following each window position: the kept drafts, then the next token; the places after it hold what is
    left of the window and are never read) and non-finite flags `[n]` bool. The first `counts[i]` pair tokens are
    what the window emits."""
    n, k = drafts.shape
    w = k + 1
    argmax = logits.argmax(dim=-1).view(n, w)
    natural = (drafts == argmax[:, :k]).long().cumprod(dim=1).sum(dim=1)
    kept = natural if kept is None else torch.where(kept >= 0, kept, natural)
    if max_kept is not None:
        kept = torch.minimum(kept, max_kept).clamp(min=0)
    bad = nonfinite_rows(logits).view(n, w).any(dim=1)
    # the next token's window position: after the kept drafts (0 for a window that cannot be sampled from)
    last = torch.where(bad, 0, kept.to(torch.long))[:, None]
    next_tokens = argmax.gather(1, last)
    pairs = torch.cat([drafts, next_tokens], dim=1).scatter(1, last, next_tokens)
    return last.squeeze(1) + 1, next_tokens.squeeze(1), pairs, bad


@dataclass(frozen=True)
class VerifyFigures:
    """The layout of an overlapped verify step's figures `[rows, 2 W + 2]` int64 (`verify_on_device` of the
    runner): each row's next window first (its next token, then the MTP head's drafts: what the step after it
    verifies), then what the host reads (kept count, non-finite flag, and the W pair tokens: the token after each
    window position, of which the first `count` are emitted)."""

    width: int

    def pack(
        self, next_tokens: torch.Tensor, drafts: torch.Tensor, counts: torch.Tensor, bad: torch.Tensor, pairs
    ) -> torch.Tensor:
        return torch.cat([next_tokens[:, None], drafts, counts[:, None], bad.long()[:, None], pairs], dim=1)

    def window(self, figures: torch.Tensor) -> torch.Tensor:
        """[rows, W]: each row's next window."""
        return figures[:, : self.width]

    def counts(self, figures: torch.Tensor) -> torch.Tensor:
        """[rows]: tokens each row kept."""
        return figures[:, self.width]

    def read(self, row: list[int]) -> tuple[int, bool, list[int]]:
        """One row of the figures on the host: (kept count, non-finite flag, pair tokens)."""
        count, bad, *pairs = row[self.width :]
        return count, bool(bad), pairs
