"""The acceptance-length histogram counts drafted decode windows only: a window without drafts always yields one
token and says nothing about how well drafts are accepted."""

from __future__ import annotations

from lightllm.engine.sampling_params import SamplingParams
from unit_tests.engine.fake_runner import FakeRunner
from unit_tests.engine.helpers import make_engine, run


def test_acceptance_histogram_counts_drafted_windows_only():
    # the fake model falls into a cycle after a few tokens: the first decode steps find no n-gram to draft from
    prompts = {"a": [5, 6, 7]}
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    engine = make_engine(FakeRunner(max_width=5), spec_ngram=4)
    tokens, _ = run(engine, prompts, params)
    s = engine.stats
    decode_steps = s.num_steps - 1
    assert s.num_spec_windows > 0
    assert sum(s.accepted_length_counts) == s.num_spec_windows
    # twin: some decode steps had no drafts, so counting every step would give a different histogram
    assert decode_steps > s.num_spec_windows
    produced = sum((i + 1) * c for i, c in enumerate(s.accepted_length_counts))
    assert produced == s.num_spec_windows + s.num_accepted_draft_tokens
