"""`allowed_token_ids` and bad words through the engine with the real runner on a tiny Qwen3.5 against transformers:
a greedy request limited to a set of tokens, and one whose bad words ban tokens of its unrestricted continuation
(a one-token word, and a two-token word whose last token is banned only after its first), decode to transformers'
greedy under the same rules, beside an unrestricted request in the same steps that keeps its own continuation, in
every state mode, plain (overlapped steps through the fixed buffers) and with MTP drafts (verified on the host).
A sampled request with allowed tokens draws only those. Twin: a sampler that drops the rules gives the unrestricted
text."""

from __future__ import annotations

import pytest
import torch

from lightllm.engine import sampler
from lightllm.engine.messages import NewRequest
from lightllm.engine.sampling_params import SamplingParams
from unit_tests.models.conftest import case_oracle
from unit_tests.models.test_device_drafts_engine import _engine, engine_tokens

CASE = "qwen3_5-hv2"
LIMITED, BANNED, PLAIN = [5, 6, 7, 8, 9], [4, 4, 2, 8, 1], [3, 1, 4, 1, 5, 9, 2, 6]
NUM_TOKENS = 10


def restricted_greedy(oracle, prompt: list[int], num_tokens: int, allowed=None, bad=()) -> list[int]:
    """transformers' greedy continuation where only `allowed` may be picked and, for each bad sequence, its last
    token may not be picked where the output so far ends with the rest of it (one full forward a token)."""
    out: list[int] = []
    for _ in range(num_tokens):
        logits = oracle.prefill_logits(list(prompt) + out)[0, -1].clone().float()
        if allowed is not None:
            keep = torch.zeros_like(logits, dtype=torch.bool)
            keep[list(allowed)] = True
            logits[~keep] = float("-inf")
        for seq in bad:
            if len(seq) == 1 or (len(out) >= len(seq) - 1 and out[-(len(seq) - 1) :] == seq[:-1]):
                logits[seq[-1]] = float("-inf")
        out.append(int(logits.argmax()))
    return out


@pytest.fixture(scope="module")
def reference():
    oracle = case_oracle(CASE)
    plain_limited = oracle.greedy(LIMITED, NUM_TOKENS)
    plain_banned = oracle.greedy(BANNED, NUM_TOKENS)
    # the limited request may not take its continuation's first token, nor most of the vocabulary
    vocab = oracle.prefill_logits(LIMITED).shape[-1]
    allowed = sorted({t for t in plain_limited[1:]} | set(range(7, vocab, 5)) - {plain_limited[0]})
    # a one-token word from late in the continuation, and a two-token word ending in the third token
    bad = [[plain_banned[6]], [plain_banned[1], plain_banned[2]]]
    expected = {
        "limited": restricted_greedy(oracle, LIMITED, NUM_TOKENS, allowed=allowed),
        "banned": restricted_greedy(oracle, BANNED, NUM_TOKENS, bad=bad),
        "plain": oracle.greedy(PLAIN, NUM_TOKENS),
    }
    assert expected["limited"] != plain_limited and set(expected["limited"]) <= set(allowed)
    assert expected["banned"] != plain_banned
    unrestricted = {"limited": plain_limited, "banned": plain_banned, "plain": expected["plain"]}
    return allowed, bad, expected, unrestricted


def run(mode: str, mtp_step: int, allowed, bad, graphs: bool = True, device: str = "cpu") -> dict[str, list[int]]:
    """The three requests' tokens; `graphs`: decode steps through the fixed buffers (CUDA graphs on CUDA) with
    overlap scheduling, else eager synchronous steps."""
    engine = _engine(mode, mtp_step, fixed_buffers=graphs, device=device, max_running_requests=3)
    engine.overlap_schedule = graphs
    rules = {
        "limited": (LIMITED, dict(allowed_token_ids=list(allowed))),
        "banned": (BANNED, dict(bad_words_token_ids=[list(s) for s in bad])),
        "plain": (PLAIN, {}),
    }
    return engine_tokens(
        engine,
        {
            rid: (prompt, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, **extra))
            for rid, (prompt, extra) in rules.items()
        },
    )


# compact differs from native only under speculation (the server refuses it without)
@pytest.mark.parametrize("mode, mtp_step", [("native", 0), ("replay", 0), ("native", 2), ("compact", 2), ("replay", 2)])
def test_restricted_greedy_equals_transformers_under_the_same_rules(mode, mtp_step, reference):
    allowed, bad, expected, _ = reference
    assert run(mode, mtp_step, allowed, bad) == expected


def test_synchronous_steps_too(reference):
    allowed, bad, expected, _ = reference
    assert run("replay", 0, allowed, bad, graphs=False) == expected


def test_teeth_a_sampler_that_drops_the_rules_gives_the_unrestricted_text(reference, monkeypatch):
    allowed, bad, _, unrestricted = reference
    monkeypatch.setattr(sampler, "apply_allowed", lambda logits, rows: logits)
    monkeypatch.setattr(sampler, "apply_bans", lambda logits, rows: logits)
    assert run("replay", 0, allowed, bad) == unrestricted


def test_sampled_rows_draw_only_allowed_tokens():
    """Seeded sampling at temperature 1.5 over a handful of allowed tokens stays inside them (twin: the same seed
    without the limit leaves them)."""
    allowed = [3, 11, 12, 40]
    tokens = {}
    for name, extra in (("limited", dict(allowed_token_ids=allowed)), ("free", {})):
        engine = _engine("replay", 0, fixed_buffers=True)
        engine.overlap_schedule = True
        params = SamplingParams(temperature=1.5, seed=7, max_tokens=24, ignore_eos=True, **extra)
        tokens |= engine_tokens(engine, {name: (LIMITED, params)})
    assert len(tokens["limited"]) == 24 and set(tokens["limited"]) <= set(allowed)
    assert len(set(tokens["limited"])) > 1, "sampled, not pinned to one token"
    assert not set(tokens["free"]) <= set(allowed)


def test_ids_past_the_vocabulary_fail_their_request_alone():
    engine = _engine("replay", 0)
    vocab = engine.runner.vocab_size
    for field, value in (("allowed_token_ids", [1, vocab]), ("bad_words_token_ids", [[2, vocab]])):
        refused = engine.add_request(NewRequest(field, LIMITED, SamplingParams(max_tokens=4, **{field: value})))
        assert (
            len(refused) == 1
            and refused[0].reason == "error"
            and f"{field} must be in [0, {vocab})" in (refused[0].error)
        )
