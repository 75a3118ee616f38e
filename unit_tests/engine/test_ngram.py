"""Prompt-lookup draft proposals."""

from __future__ import annotations

from lightllm.engine.speculative.ngram import propose_ngram


def test_propose_ngram_takes_latest_longest_match():
    ids = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 1, 2, 3]
    # tail [1, 2, 3] last occurred at index 5, followed by 4, 5, 1
    assert propose_ngram(ids, 3) == [4, 5, 1]
    assert propose_ngram(ids, 10) == [4, 5, 1, 2, 3]


def test_propose_ngram_falls_back_to_shorter_match():
    ids = [7, 8, 4, 6, 0, 8, 4]
    # no earlier [0, 8, 4] or [6, 0, 8, 4]; [8, 4] occurred at index 1
    assert propose_ngram(ids, 2) == [6, 0]


def test_propose_ngram_no_match_or_no_budget():
    assert propose_ngram([1, 2, 3, 4], 3) == []
    assert propose_ngram([1, 2, 1, 2], 0) == []
    assert propose_ngram([1], 3) == []
