"""Sampling values at the edge of their ranges (`SamplingParams`, `Sampler.target_probs`): a temperature or top_p
below the greedy threshold samples the argmax, a repetition penalty outside [0.01, 10] is refused, and every
valid combination gives a finite distribution over random logits (no NaN row, which would draw token 0)."""

from __future__ import annotations

import random

import pytest
import torch

from lightllm.engine.sampler import RowContext, Sampler
from lightllm.engine.sampling_params import (
    GREEDY_TEMPERATURE,
    MIN_REPETITION_PENALTY,
    SamplingParams,
    SamplingParamsError,
)

VOCAB = 97


@pytest.mark.parametrize(
    "params", [dict(temperature=1e-300), dict(top_p=1e-300), dict(temperature=GREEDY_TEMPERATURE / 2)]
)
def test_degenerate_temperature_or_top_p_samples_the_argmax(params):
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 4
    rows = [RowContext(SamplingParams(**params), [1, 2], [3]) for _ in range(3)]
    assert all(r.params.greedy for r in rows)
    sampler = Sampler(seed=1)
    probs = sampler.target_probs(logits, rows)
    assert torch.isfinite(probs).all()
    assert sampler.draw_many(probs, rows) == logits.argmax(-1).tolist()
    # teeth: the same temperature applied literally overflows to NaN, and argmax of NaN picks token 0
    literal = torch.softmax(logits / 1e-300, dim=-1)
    assert torch.isnan(literal).all()


def test_a_small_but_real_temperature_still_samples():
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE * 10).greedy
    assert not SamplingParams(top_p=0.001).greedy


@pytest.mark.parametrize("value", [1e-300, 0.009, 10.5, float("inf")])
def test_a_meaningless_repetition_penalty_is_refused(value):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(repetition_penalty=value)
    assert err.value.field == "repetition_penalty" and "[0.01, 10]" in str(err.value)


def test_random_valid_parameters_give_finite_distributions():
    rng = random.Random(5)
    torch.manual_seed(5)
    sampler = Sampler(seed=2)
    for _ in range(60):
        params = SamplingParams(
            temperature=rng.choice([0.0, 1e-300, 1e-6, rng.uniform(0.01, 100.0)]),
            top_p=rng.choice([1e-300, 1e-6, rng.uniform(1e-4, 1.0), 1.0]),
            top_k=rng.choice([-1, 0, 1, 7, 2**31 - 1]),
            min_p=rng.choice([0.0, rng.uniform(0.0, 1.0), 1.0]),
            repetition_penalty=rng.choice([MIN_REPETITION_PENALTY, 10.0, rng.uniform(0.01, 10.0)]),
            presence_penalty=rng.uniform(-2.0, 2.0),
            frequency_penalty=rng.uniform(-2.0, 2.0),
        )
        logits = torch.randn(2, VOCAB) * rng.choice([1.0, 30.0])
        history = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 40))]
        rows = [RowContext(params, history[:5], history[5:]) for _ in range(2)]
        probs = sampler.target_probs(logits, rows)
        assert torch.isfinite(probs).all(), params
        assert torch.allclose(probs.sum(-1), torch.ones(2), atol=1e-4), params
