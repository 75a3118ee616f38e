"""`logit_bias` and `min_tokens`' bans: what the sampler adds to (or bans from) each row's logits, the order
against penalties and temperature, the fast paths such rows must leave, and the parameters' checks."""

from __future__ import annotations

import pytest
import torch

from lightllm.engine.sampler import RowContext, Sampler, apply_bans, apply_logit_bias
from lightllm.engine.sampling_params import MAX_LOGIT_BIAS_TOKENS, SamplingParams, SamplingParamsError

VOCAB = 13


def _logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def _bias(seed: int, count: int) -> dict[int, float]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randperm(VOCAB, generator=g)[:count].tolist()
    return {t: float(v) for t, v in zip(tokens, (torch.rand(count, generator=g) * 200 - 100).tolist())}


def _row(**kw) -> RowContext:
    return RowContext(SamplingParams(**kw), prompt_ids=[1, 2], output_ids=[2, 3, 3, 7])


def _dense(bias: dict[int, float]) -> torch.Tensor:
    out = torch.zeros(VOCAB)
    for t, v in bias.items():
        out[t] = v
    return out


@pytest.mark.parametrize("seed", range(3))
def test_each_row_gets_its_own_bias_and_no_other(seed):
    biases = [_bias(seed, 4), {}, _bias(seed + 10, 1), _bias(seed + 20, VOCAB)]
    x = _logits(len(biases), seed)
    out = apply_logit_bias(x.clone(), [_row(logit_bias=b) for b in biases])
    expected = x + torch.stack([_dense(b) for b in biases])
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_teeth_bias_on_the_wrong_row_is_seen():
    biases = [_bias(0, 4), _bias(1, 4)]
    x = _logits(2, 0)
    out = apply_logit_bias(x.clone(), [_row(logit_bias=b) for b in reversed(biases)])
    assert not torch.equal(out, x + torch.stack([_dense(b) for b in biases]))


def test_rows_at_the_entry_limit_get_their_own_biases():
    """Rows of up to MAX_LOGIT_BIAS_TOKENS biases each, unbiased rows between them, over a wider vocabulary: each
    row is its logits plus its own biases (twin: the same biases one row down are not)."""
    vocab, g = 4 * MAX_LOGIT_BIAS_TOKENS, torch.Generator().manual_seed(3)
    counts = [MAX_LOGIT_BIAS_TOKENS, 0, 7, MAX_LOGIT_BIAS_TOKENS, 0, 1]
    dense = torch.zeros(len(counts), vocab)
    biases = []
    for i, count in enumerate(counts):
        tokens = torch.randperm(vocab, generator=g)[:count]
        values = torch.rand(count, generator=g) * 200 - 100
        dense[i, tokens] = values
        biases.append(dict(zip(tokens.tolist(), values.tolist())))
    x = torch.randn(len(counts), vocab, generator=g)
    out = apply_logit_bias(x.clone(), [_row(logit_bias=b) for b in biases])
    torch.testing.assert_close(out, x + dense, rtol=0, atol=0)
    assert not torch.equal(out, x + dense.roll(1, 0))


@pytest.mark.parametrize("seed", range(3))
def test_sampled_rows_draw_from_the_biased_distribution(seed):
    """Bias first, then penalties (a repetition penalty scales the biased logit), then temperature: the
    distribution equals that computation done by hand."""
    bias = _bias(seed, 5)
    row = _row(logit_bias=bias, temperature=0.8, repetition_penalty=1.3, presence_penalty=0.4)
    x = _logits(1, seed)[0]
    biased = x + _dense(bias)
    seen = torch.zeros(VOCAB, dtype=torch.bool)
    seen[[1, 2, 3, 7]] = True
    counts = torch.bincount(torch.tensor([2, 3, 3, 7]), minlength=VOCAB).float()
    penalised = torch.where(seen, torch.where(biased > 0, biased / 1.3, biased * 1.3), biased) - 0.4 * (counts > 0)
    probs = Sampler().target_probs(x[None], [row])[0]
    torch.testing.assert_close(probs, torch.softmax(penalised / 0.8, -1))


def test_a_bias_forces_and_bans_greedy_tokens():
    x = _logits(3, 5)
    top = x.argmax(-1).tolist()
    rows = [
        _row(temperature=0, logit_bias={top[0]: -100.0}),
        _row(temperature=0, logit_bias={(top[1] + 1) % VOCAB: 100.0}),
        _row(temperature=0),
    ]
    tokens = Sampler().sample(x.clone(), rows)
    assert tokens[0] == int((x[0] - 100 * torch.nn.functional.one_hot(torch.tensor(top[0]), VOCAB)).argmax())
    assert tokens[0] != top[0]
    assert tokens[1] == (top[1] + 1) % VOCAB
    assert tokens[2] == top[2]


def test_a_biased_greedy_row_leaves_the_raw_argmax_paths():
    assert SamplingParams(temperature=0).takes_raw_argmax
    assert not SamplingParams(temperature=0, logit_bias={3: 0.5}).takes_raw_argmax
    assert not SamplingParams(temperature=0, presence_penalty=0.5).takes_raw_argmax
    assert not SamplingParams(temperature=1.0).takes_raw_argmax


@pytest.mark.parametrize(
    "bias",
    [
        {-1: 1.0},
        {3: 100.5},
        {3: -101.0},
        {3: float("nan")},
        {3: float("inf")},
        {"3": 1.0},
        {3: True},
        {3: "1"},
        [3],
        {t: 1.0 for t in range(MAX_LOGIT_BIAS_TOKENS + 1)},
    ],
    ids=["negative-id", "over", "under", "nan", "inf", "str-key", "bool", "str-value", "list", "too-many"],
)
def test_bad_biases_are_refused_naming_the_field(bias):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(logit_bias=bias)
    assert err.value.field == "logit_bias"


def test_edge_biases_are_accepted():
    SamplingParams(logit_bias={0: -100.0, 2**31 - 1: 100, 7: 0.0})
    SamplingParams(logit_bias={t: 1.0 for t in range(MAX_LOGIT_BIAS_TOKENS)})


def test_vocab_problem_names_ids_past_the_vocabulary():
    assert SamplingParams(logit_bias={VOCAB - 1: 1.0}).vocab_problem(VOCAB) is None
    message, field = SamplingParams(logit_bias={VOCAB: 1.0}).vocab_problem(VOCAB)
    assert field == "logit_bias" and f"[0, {VOCAB})" in message
    assert SamplingParams(stop_token_ids=[VOCAB]).vocab_problem(VOCAB)[1] == "stop_token_ids"


def test_banned_ids_get_no_mass_and_other_rows_keep_theirs():
    x = _logits(3, 9)
    rows = [
        RowContext(SamplingParams(temperature=0.7), [1], [], banned_ids=(2, 5)),
        RowContext(SamplingParams(temperature=0.7), [1], []),
        RowContext(SamplingParams(temperature=0), [1], [], banned_ids=(int(x[2].argmax()),)),
    ]
    out = apply_bans(x.clone(), rows)
    expected = x.clone()
    expected[0, [2, 5]] = float("-inf")
    expected[2, int(x[2].argmax())] = float("-inf")
    assert torch.equal(out, expected)
    probs = Sampler().target_probs(x.clone(), rows)
    assert probs[0, [2, 5]].sum() == 0 and torch.allclose(probs[1], torch.softmax(x[1] / 0.7, -1))
    # the banned argmax gives way to the runner-up
    assert int(probs[2].argmax()) == int(x[2].topk(2).indices[1])


def test_a_banned_id_past_the_vocabulary_is_left_out():
    x = _logits(1, 4)
    out = apply_bans(x.clone(), [RowContext(SamplingParams(), [1], [], banned_ids=(3, VOCAB, VOCAB + 7))])
    expected = x.clone()
    expected[0, 3] = float("-inf")
    assert torch.equal(out, expected)


def test_min_tokens_rows_leave_the_fast_and_overlapped_paths():
    assert SamplingParams(temperature=0, min_tokens=3).needs_output_history
    assert not SamplingParams(temperature=0, min_tokens=3).takes_raw_argmax
    assert not SamplingParams(temperature=0).needs_output_history


@pytest.mark.parametrize(
    "kw",
    [{"min_tokens": -1}, {"min_tokens": 5, "max_tokens": 4}, {"min_tokens": 1.5}, {"min_tokens": 2, "grammar": "x"}],
    ids=["negative", "over-max", "float", "grammar"],
)
def test_bad_min_tokens_are_refused_naming_the_field(kw):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**kw)
    assert err.value.field == "min_tokens"
    SamplingParams(min_tokens=4, max_tokens=4)
    SamplingParams(min_tokens=4, max_tokens=None)
