"""Greedy acceptance counted on the device (`verify_greedy_windows`) equals window-by-window verification: random
windows of every width, drafts that match a random prefix of the argmax, NaN windows failing alone."""

from __future__ import annotations

import torch

from lightllm.engine.sampler import RowContext, Sampler
from lightllm.engine.sampling_params import SamplingParams
from lightllm.engine.speculative.verify import verify_greedy_windows, verify_window

VOCAB = 50


def _windows(seed: int):
    g = torch.Generator().manual_seed(seed)
    widths = torch.randint(1, 5, (40,), generator=g).tolist()
    starts = [sum(widths[:i]) for i in range(len(widths))]
    logits = torch.randn(sum(widths), VOCAB, generator=g)
    argmax = logits.argmax(-1).tolist()
    drafts = []
    for start, width in zip(starts, widths):
        # the first `keep` drafts follow the argmax, the next one (if any) is wrong
        keep = int(torch.randint(0, width, (1,), generator=g))
        row = [argmax[start + j] for j in range(width - 1)]
        if keep < width - 1:
            row[keep] = (row[keep] + 1) % VOCAB
        drafts.append(row)
    for i in (3, 17):
        logits[starts[i] + widths[i] - 1, 7] = float("nan")
    return starts, widths, drafts, logits


def _reference(starts, widths, drafts, logits):
    row = RowContext(SamplingParams(temperature=0), [1], [])
    out = []
    for start, width, d in zip(starts, widths, drafts):
        window = logits[start : start + width]
        if torch.isnan(window).any():
            out.append(None)
            continue
        probs = torch.nn.functional.one_hot(window.argmax(-1), VOCAB).float()
        out.append(verify_window(Sampler(), probs, d, row).token_ids)
    return out


def test_device_acceptance_equals_window_by_window_verification():
    for seed in range(5):
        starts, widths, drafts, logits = _windows(seed)
        got = [r if r is None else r.token_ids for r in verify_greedy_windows(starts, widths, drafts, logits)]
        want = _reference(starts, widths, drafts, logits)
        assert got == want
        assert sum(r is None for r in got) == 2 and any(r is not None and len(r) > 1 for r in got)


def test_windows_read_at_the_wrong_rows_disagree():
    """Teeth: shifting every window by one row changes the outcome."""
    starts, widths, drafts, logits = _windows(0)
    shifted = [min(s + 1, logits.shape[0] - w) for s, w in zip(starts, widths)]
    got = [r if r is None else r.token_ids for r in verify_greedy_windows(shifted, widths, drafts, logits)]
    assert got != _reference(starts, widths, drafts, logits)
