"""Sampler knobs against direct torch computations, seeded determinism, rejection sampling statistics."""

from __future__ import annotations

import pytest
import torch

from lightllm.engine.sampler import RowContext, Sampler, apply_penalties, compute_logprobs, filter_probs
from lightllm.engine.sampling_params import SamplingParams
from lightllm.engine.speculative.verify import verify_window


def _logits(vocab: int = 11, seed: int = 0) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 2


def _row(**kw) -> RowContext:
    return RowContext(SamplingParams(**kw), prompt_ids=[1, 2], output_ids=[2, 3, 3, 7])


def test_target_probs_temperature_matches_softmax():
    x = _logits()
    probs = Sampler().target_probs(x[None], [_row(temperature=0.7)])[0]
    torch.testing.assert_close(probs, torch.softmax(x / 0.7, -1))


def test_target_probs_greedy_is_one_hot_argmax():
    x = _logits()
    probs = Sampler().target_probs(x[None], [_row(temperature=0.0)])[0]
    assert probs.sum() == 1 and probs[int(torch.argmax(x))] == 1


def test_filter_top_k():
    p = torch.softmax(_logits(), -1)
    out = filter_probs(p, top_k=3, top_p=1.0, min_p=0.0)
    top = torch.topk(p, 3).indices
    expected = torch.zeros_like(p)
    expected[top] = p[top] / p[top].sum()
    torch.testing.assert_close(out, expected)


def test_filter_top_p_keeps_smallest_prefix_reaching_mass():
    p = torch.tensor([0.05, 0.4, 0.3, 0.15, 0.1])
    out = filter_probs(p, top_k=-1, top_p=0.8, min_p=0.0)
    # sorted: 0.4, 0.3 (0.7 < 0.8), 0.15 (reaches 0.85) → keep three
    torch.testing.assert_close(out, torch.tensor([0.0, 0.4, 0.3, 0.15, 0.0]) / 0.85)


def test_filter_min_p():
    p = torch.tensor([0.5, 0.3, 0.12, 0.08])
    out = filter_probs(p, top_k=-1, top_p=1.0, min_p=0.2)
    # threshold 0.2 * 0.5 = 0.1
    torch.testing.assert_close(out, torch.tensor([0.5, 0.3, 0.12, 0.0]) / 0.92)


def test_penalties_match_direct_formula():
    x = _logits()
    row = _row(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(x[None].clone(), [row])[0]
    expected = x.clone()
    for t in {1, 2, 3, 7}:
        expected[t] = expected[t] / 1.3 if expected[t] > 0 else expected[t] * 1.3
    counts = {2: 1, 3: 2, 7: 1}
    for t, c in counts.items():
        expected[t] -= 0.25 * c + 0.5
    torch.testing.assert_close(out, expected)


def test_seeded_draws_are_deterministic_and_seed_dependent():
    probs = torch.softmax(_logits(vocab=50), -1)

    def draws(seed):
        row = RowContext(SamplingParams(seed=seed), [], [], torch.Generator().manual_seed(seed))
        return [Sampler().draw(probs, row) for _ in range(20)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_draw_follows_distribution():
    probs = torch.tensor([0.1, 0.6, 0.3, 0.0])
    sampler = Sampler(seed=3)
    row = _row(temperature=1.0)
    counts = torch.bincount(torch.tensor([sampler.draw(probs, row) for _ in range(4000)]), minlength=4).float()
    assert counts[3] == 0
    torch.testing.assert_close(counts / 4000, probs, atol=0.025, rtol=0)


def test_compute_logprobs_raw_log_softmax():
    x = torch.stack([_logits(seed=1), _logits(seed=2)])
    chosen, tops = compute_logprobs(x, [4, 9], num_top=3)
    ref = torch.log_softmax(x, -1)
    assert chosen == pytest.approx([float(ref[0, 4]), float(ref[1, 9])], abs=1e-6)
    assert [t for t, _ in tops[1]] == torch.topk(ref[1], 3).indices.tolist()


def test_verify_greedy_accepts_exactly_the_argmax_prefix():
    # one-hot targets: argmax 3, then 5, then 1, then 2
    probs = torch.zeros(4, 8)
    probs[0, 3] = probs[1, 5] = probs[2, 1] = probs[3, 2] = 1.0
    row = _row(temperature=0.0)
    assert verify_window(Sampler(), probs, [3, 5, 1], row).token_ids == [3, 5, 1, 2]
    assert verify_window(Sampler(), probs, [3, 6, 1], row).token_ids == [3, 5]
    assert verify_window(Sampler(), probs, [0, 5, 1], row).token_ids == [3]


@pytest.mark.parametrize("draft", [0, 2, 3], ids=["likely-draft", "unlikely-draft", "zero-prob-draft"])
def test_verify_rejection_sampling_preserves_target_distribution(draft):
    # first emitted token of a window must follow p_0 whatever the (point-mass) draft is
    p0 = torch.tensor([0.5, 0.2, 0.3, 0.0])
    p1 = torch.tensor([0.25, 0.25, 0.25, 0.25])
    probs = torch.stack([p0, p1])
    sampler = Sampler(seed=11)
    row = _row(temperature=1.0)
    n = 6000
    first = [verify_window(sampler, probs, [draft], row).token_ids[0] for _ in range(n)]
    freq = torch.bincount(torch.tensor(first), minlength=4).float() / n
    torch.testing.assert_close(freq, p0, atol=0.02, rtol=0)


def test_verify_rejection_sampling_second_token_distribution():
    # when the draft is accepted, the bonus token follows p_1
    p0 = torch.tensor([0.7, 0.3, 0.0])
    p1 = torch.tensor([0.1, 0.1, 0.8])
    sampler = Sampler(seed=5)
    row = _row(temperature=1.0)
    seconds = []
    for _ in range(6000):
        tokens = verify_window(sampler, torch.stack([p0, p1]), [0], row).token_ids
        if len(tokens) == 2:
            seconds.append(tokens[1])
    assert len(seconds) == pytest.approx(0.7 * 6000, rel=0.05)
    freq = torch.bincount(torch.tensor(seconds), minlength=3).float() / len(seconds)
    torch.testing.assert_close(freq, p1, atol=0.025, rtol=0)
