"""`logit_bias` through the engine with the real runner on a tiny Qwen3.5 against transformers: a greedy request
whose bias bans tokens of its unbiased continuation and lifts another by a few logits decodes to transformers'
greedy over the biased logits, beside an unbiased request in the same steps that keeps its own continuation, in
every state mode, plain (overlapped steps through the fixed buffers) and with MTP drafts (a biased row is verified
on the host, not by the device's raw argmax). Twin: a sampler that drops the bias gives the unbiased text."""

from __future__ import annotations

import pytest

from lightllm.engine import sampler
from lightllm.engine.messages import NewRequest, TokenChunk
from lightllm.engine.sampling_params import SamplingParams
from unit_tests.models.conftest import case_oracle
from unit_tests.models.test_device_drafts_engine import _engine

CASE = "qwen3_5-hv2"
BIASED, PLAIN = [5, 6, 7, 8, 9], [3, 1, 4, 1, 5, 9, 2, 6]
NUM_TOKENS = 10
# a lift small enough that the lifted token wins only where the model's margin is narrow
LIFT = 2.5


def biased_greedy(oracle, prompt: list[int], bias: dict[int, float], num_tokens: int) -> list[int]:
    """transformers' greedy continuation with `bias` added to every position's logits (one full forward a token)."""
    ids = list(prompt)
    for _ in range(num_tokens):
        logits = oracle.prefill_logits(ids)[0, -1].clone()
        for token, value in bias.items():
            logits[token] += value
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def reference():
    oracle = case_oracle(CASE)
    plain_biased, plain_other = oracle.greedy(BIASED, NUM_TOKENS), oracle.greedy(PLAIN, NUM_TOKENS)
    # ban the first three tokens the unbiased continuation picks; lift the runner-up of its first position
    first = oracle.prefill_logits(BIASED)[0, -1]
    bias = {t: -100.0 for t in plain_biased[:3]}
    bias[int(first.topk(2).indices[1])] = LIFT
    expected = biased_greedy(oracle, BIASED, bias, NUM_TOKENS)
    assert expected != plain_biased, "the bias must change the continuation"
    return bias, expected, plain_biased, plain_other


def run(mode: str, mtp_step: int, bias: dict[int, float], device: str = "cpu", graphs: bool = True):
    """The two requests' tokens; `graphs`: decode steps through the fixed buffers (CUDA graphs on CUDA) with
    overlap scheduling, else eager synchronous steps."""
    engine = _engine(mode, mtp_step, fixed_buffers=graphs, device=device)
    engine.overlap_schedule = graphs
    for rid, prompt, b in (("biased", BIASED, bias), ("plain", PLAIN, {})):
        params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logit_bias=b)
        assert engine.add_request(NewRequest(rid, prompt, params)) == []
    # steps left in flight whose tokens were drawn on the device with the biased row among them
    overlapped = []
    draw = engine.overlap._draw_on_device
    engine.overlap._draw_on_device = lambda windows, logits: (
        overlapped.append(any(r.params.logit_bias for r in windows)) or draw(windows, logits)
    )
    out = {"biased": [], "plain": []}
    while engine.has_work():
        for o in engine.step():
            if isinstance(o, TokenChunk):
                out[o.req_id] += o.token_ids
    # without drafts the biased row's steps stay in flight; MTP verify steps of a biased row run on the host
    assert any(overlapped) == (graphs and mtp_step == 0), overlapped
    return out


# compact differs from native only under speculation (the server refuses it without)
@pytest.mark.parametrize("mode, mtp_step", [("native", 0), ("replay", 0), ("native", 2), ("compact", 2), ("replay", 2)])
def test_biased_greedy_equals_transformers_over_biased_logits(mode, mtp_step, reference):
    bias, expected, _, plain_other = reference
    out = run(mode, mtp_step, bias)
    assert out["biased"] == expected
    assert out["plain"] == plain_other


def test_teeth_a_sampler_that_drops_the_bias_gives_the_unbiased_text(reference, monkeypatch):
    bias, expected, plain_biased, _ = reference
    monkeypatch.setattr(sampler, "apply_logit_bias", lambda logits, rows: logits)
    out = run("replay", 0, bias)
    assert out["biased"] != expected
    assert out["biased"] == plain_biased


def test_an_id_past_the_vocabulary_fails_its_request_alone():
    engine = _engine("replay", 0)
    vocab = engine.runner.vocab_size
    bad = SamplingParams(temperature=0, max_tokens=4, logit_bias={vocab: 1.0})
    refused = engine.add_request(NewRequest("bad", BIASED, bad))
    assert len(refused) == 1 and refused[0].reason == "error" and f"[0, {vocab})" in refused[0].error
    good = SamplingParams(temperature=0, max_tokens=4, logit_bias={vocab - 1: 1.0})
    assert engine.add_request(NewRequest("good", BIASED, good)) == []
    tokens = []
    while engine.has_work():
        tokens += [t for o in engine.step() if isinstance(o, TokenChunk) for t in o.token_ids]
    assert len(tokens) == 4 and all(0 <= t < vocab for t in tokens)
