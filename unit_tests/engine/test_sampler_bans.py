"""The sampler's token rules on their own: bad words' bans against a brute-force reading of the rule over the whole
output, `allowed_token_ids` against a per-row mask, and a ban that would leave a position no token yielding there
(twins: a rule left out, a shifted tail)."""

from __future__ import annotations

import random

import torch

from lightllm.engine.sampler import RowContext, Sampler, allowed_mask, apply_allowed, bad_word_bans
from lightllm.engine.sampling_params import SamplingParams


def brute_bans(sequences, output):
    """Each sequence's last token where the whole output ends with the rest of the sequence."""
    banned = set()
    for seq in sequences:
        body = seq[:-1]
        if not body or (len(output) >= len(body) and output[len(output) - len(body) :] == body):
            banned.add(seq[-1])
    return banned


def test_bad_word_bans_match_the_rule_over_the_whole_output():
    rng = random.Random(3)
    hits = 0
    for _ in range(2000):
        output = [rng.randrange(4) for _ in range(rng.randrange(0, 9))]
        drafts = [rng.randrange(4) for _ in range(rng.randrange(0, 4))]
        sequences = [[rng.randrange(4) for _ in range(rng.randrange(1, 5))] for _ in range(rng.randrange(1, 4))]
        got = bad_word_bans(sequences, output, drafts)
        assert got == brute_bans(sequences, output + drafts)
        hits += any(len(s) > 1 and s[-1] in got for s in sequences)
        # twin: the drafts left out change the answer wherever a multi-token word ends across them
        if drafts and got != brute_bans(sequences, output):
            assert bad_word_bans(sequences, output, []) != got
    assert hits > 100, "multi-token words must match often enough to test the tail"


def _row(params: SamplingParams, width: int = 50, banned=()) -> RowContext:
    ids = params.allowed_token_ids
    mask = None if ids is None else allowed_mask(ids, width, torch.device("cpu"))
    return RowContext(params, [1, 2], [], banned_ids=tuple(banned), allowed_mask=mask)


def _rows(params_list):
    return [_row(p) for p in params_list]


def test_allowed_ids_mask_each_row_alone():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    allowed = [[4, 9, 33], None, [0, 49]]
    rows = _rows([SamplingParams(allowed_token_ids=a) for a in allowed])
    out = apply_allowed(logits.clone(), rows)
    for i, ids in enumerate(allowed):
        expected = logits[i].clone()
        if ids is not None:
            keep = torch.zeros(50, dtype=torch.bool)
            keep[ids] = True
            expected[~keep] = float("-inf")
        assert torch.equal(out[i], expected)
    # twin: a row's mask is its own, not its neighbour's
    swapped = _rows([SamplingParams(allowed_token_ids=a) for a in (allowed[2], None, allowed[0])])
    assert not torch.equal(apply_allowed(logits.clone(), swapped), out)


def test_greedy_rows_take_the_best_allowed_token_and_bans_apply_after():
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(1))
    # the unrestricted argmax lies outside the allowed set
    logits[0, 20] = 10.0
    allowed = [5, 6, 7, 30]
    best = max(allowed, key=lambda t: logits[0, t])
    runner_up = max(set(allowed) - {best}, key=lambda t: logits[0, t])
    greedy = SamplingParams(temperature=0, allowed_token_ids=allowed)
    rows = [_row(greedy, 40), _row(greedy, 40, banned=(best,))]
    probs = Sampler().target_probs(torch.stack([logits[0], logits[0]]), rows)
    assert probs.argmax(-1).tolist() == [best, runner_up]
    # twin: without the limit the argmax is the unrestricted one
    free = Sampler().target_probs(logits[:1], [RowContext(SamplingParams(temperature=0), [], [])])
    assert int(free.argmax()) == 20


def test_a_ban_that_leaves_nothing_yields():
    """allowed {3, 8} with both banned: the row samples as if unbanned (no NaN); a neighbour's ban still holds."""
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=1.0, allowed_token_ids=[3, 8])
    rows = [_row(params, 20, banned=(3, 8)), _row(params, 20, banned=(3,))]
    probs = Sampler().target_probs(logits, rows)
    assert torch.isfinite(probs).all()
    unbanned = torch.softmax(logits[0, [3, 8]], -1)
    torch.testing.assert_close(probs[0, [3, 8]], unbanned)
    assert probs[1, 3] == 0 and probs[1, 8] == 1
    assert probs[0].sum().item() == probs[0, [3, 8]].sum().item()


def test_a_mask_narrower_than_the_logits_keeps_the_padding_out():
    """Logits padded past the vocabulary (a mask of the vocabulary's width): the padded columns are outside."""
    logits = torch.zeros(1, 12)
    logits[0, 11] = 5.0
    row = RowContext(
        SamplingParams(temperature=0, allowed_token_ids=[2]),
        [],
        [],
        allowed_mask=allowed_mask([2], 10, torch.device("cpu")),
    )
    out = apply_allowed(logits.clone(), [row])
    assert torch.isfinite(out[0]).tolist() == [i == 2 for i in range(12)]
