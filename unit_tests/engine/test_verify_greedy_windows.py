"""Greedy acceptance counted on the device (`verify_greedy_windows`) equals window-by-window verification: random
windows of every width, drafts that match a random prefix of the argmax, NaN windows failing alone."""

from __future__ import annotations

import pytest
import torch

from lightllm.engine.sampler import RowContext, Sampler
from lightllm.engine.sampling_params import SamplingParams
from lightllm.engine.speculative.verify import verify_full_windows_on_device, verify_greedy_windows, verify_window

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


def _full_windows(seed: int, num_drafts: int):
    """Windows of `num_drafts` drafts each (the overlapped path's shape), every kept count present, two NaN rows."""
    g = torch.Generator().manual_seed(seed)
    n, w = 30, num_drafts + 1
    logits = torch.randn(n * w, VOCAB, generator=g)
    argmax = logits.argmax(-1).view(n, w)
    drafts = argmax[:, :num_drafts].clone()
    for i in range(n):
        keep = i % w
        if keep < num_drafts:
            drafts[i, keep] = (drafts[i, keep] + 1) % VOCAB
    for i in (4, 11):
        logits[i * w + int(torch.randint(0, w, (1,), generator=g)), 3] = float("nan")
    return logits, drafts


@pytest.mark.parametrize("num_drafts", [1, 2, 3])
def test_verify_full_windows_on_device_equals_verify_greedy_windows(num_drafts):
    """`verify_full_windows_on_device` (the overlapped MTP step's acceptance, nothing read back) gives the counts
    and tokens of `verify_greedy_windows`; a window with a NaN is flagged and keeps one token; the first `count`
    pair tokens are what the window emits."""
    logits, drafts = _full_windows(5, num_drafts)
    w = num_drafts + 1
    n = drafts.shape[0]
    expected = verify_greedy_windows([i * w for i in range(n)], [w] * n, drafts.tolist(), logits)
    counts, next_tokens, pairs, bad = verify_full_windows_on_device(logits, drafts)
    for i, result in enumerate(expected):
        if result is None:
            assert bad[i] and counts[i] == 1
            continue
        assert not bad[i]
        assert counts[i] == result.num_accepted and next_tokens[i] == result.token_ids[-1]
        assert pairs[i, : counts[i]].tolist() == result.token_ids
    assert set(counts[~bad].tolist()) == set(range(1, w + 1))


def test_verify_full_windows_on_device_twin_shifted_drafts():
    """Twin: the drafts moved by one token no longer keep what the host's verification keeps."""
    logits, drafts = _full_windows(5, 2)
    n = drafts.shape[0]
    expected = verify_greedy_windows([i * 3 for i in range(n)], [3] * n, drafts.tolist(), logits)
    counts, *_ = verify_full_windows_on_device(logits, (drafts + 1) % VOCAB)
    assert counts.tolist() != [1 if r is None else r.num_accepted for r in expected]
