"""No request parameter may fail another request: a request whose knobs slipped past the front-end's checks
finishes alone with an error, and the requests batched with it produce exactly what they produce alone."""

from __future__ import annotations

import msgspec
import pytest
import torch

from lightllm.engine.messages import EngineInput, NewRequest
from lightllm.engine.sampler import RowContext, Sampler
from lightllm.engine.sampling_params import SamplingParams, SamplingParamsError
from lightllm.server.engine_loop import ServingRole, dispatch
from unit_tests.engine.fake_runner import FakeRunner
from unit_tests.engine.helpers import make_engine, run

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = {f"ok{i}": [i + 1, i + 2, i + 3] for i in range(6)}


def _absurd(**knobs) -> SamplingParams:
    # set after construction: what a front-end that skipped its checks could hand the engine
    params = SamplingParams(temperature=1.0, max_tokens=12)
    for name, value in knobs.items():
        setattr(params, name, value)
    return params


def _reference() -> dict[str, list[int]]:
    return {rid: FakeRunner().greedy(ids, 12) for rid, ids in PROMPTS.items()}


@pytest.mark.parametrize(
    "knobs, field",
    [
        ({"top_k": 2**63}, "top_k"),
        ({"top_k": 2**64 + 5}, "top_k"),
        ({"seed": 2**64}, "seed"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"temperature": float("nan")}, "temperature"),
        ({"max_tokens": "16"}, "max_tokens"),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else None,
)
def test_absurd_request_fails_alone_and_batch_is_unchanged(knobs, field):
    engine = make_engine(FakeRunner())
    early = engine.add_request(NewRequest("bad", [7, 8, 9], _absurd(**knobs), []))
    assert len(early) == 1 and early[0].reason == "error" and early[0].error.startswith(f"{field}=")
    tokens, finished = run(engine, PROMPTS, GREEDY)
    assert tokens == _reference()
    assert all(f.reason == "length" for f in finished.values())


def test_reference_depends_on_the_prompt():
    # twin of the batch check: a changed prompt changes the text, so the equality above is not vacuous
    engine = make_engine(FakeRunner())
    shifted = {rid: [t + 1 for t in ids] for rid, ids in PROMPTS.items()}
    tokens, _ = run(engine, shifted, GREEDY)
    assert tokens != _reference()


def test_engine_process_answers_a_request_it_cannot_decode():
    # off the wire, msgspec runs the same checks while decoding: the request still gets its error reply
    engine = make_engine(FakeRunner())
    good = msgspec.to_builtins(NewRequest("wire", [1, 2], GREEDY, []))
    good["params"]["top_k"] = 2**63
    out = dispatch(ServingRole(engine), msgspec.msgpack.Decoder(EngineInput), msgspec.msgpack.encode(good))
    assert len(out) == 1 and out[0].req_id == "wire" and out[0].reason == "error" and "top_k" in out[0].error
    assert not engine.has_work()
    good["params"]["top_k"] = 5
    assert dispatch(ServingRole(engine), msgspec.msgpack.Decoder(EngineInput), msgspec.msgpack.encode(good)) == []
    assert engine.has_work()


def test_sampler_survives_top_k_beyond_int64():
    # defence in depth: even unvalidated, a huge top_k means "keep everything" instead of an overflow
    logits = torch.randn(2, 64)
    rows = [RowContext(_absurd(top_k=2**63), [1], []), RowContext(_absurd(top_k=1), [1], [])]
    probs = Sampler().target_probs(logits, rows)
    assert torch.allclose(probs[0], torch.softmax(logits[0], -1))
    assert torch.count_nonzero(probs[1]) == 1


@pytest.mark.parametrize(
    "knobs, field",
    [
        ({"top_k": 2**31}, "top_k"),
        ({"seed": 2**63 - 1, "n": 2}, "seed"),
        ({"stop": ["a", ""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"n": True}, "n"),
        ({"temperature": float("inf")}, "temperature"),
    ],
    ids=lambda v: "-".join(v) if isinstance(v, dict) else None,
)
def test_sampling_params_refuse_with_field(knobs, field):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**knobs)
    assert info.value.field == field


def test_sampling_params_accept_the_edges():
    p = SamplingParams(top_k=2**31 - 1, seed=2**63 - 2, n=2, stop=["a"], stop_token_ids=[0])
    assert (p.top_k, p.seed, p.n) == (2**31 - 1, 2**63 - 2, 2)
