"""Constrained decoding through the engine with the real runner on tiny random checkpoints: the grammar, not the
model, makes every output valid, in every state mode, with and without speculation and overlap; overlap scheduling
changes no constrained token, also where constrained rows join MTP verify steps chained in flight; with MTP or
n-gram drafts in every state mode, constrained greedy decoding equals constrained greedy decoding without
speculation, and scripted drafts the grammar refuses are rejected."""

from __future__ import annotations

import pytest

from lightllm.engine.sampling_params import SamplingParams
from lightllm.tools.make_tiny_model import tiny_model_dir
from unit_tests.helpers.constrained import (
    GRAMMAR,
    MAX_TOKENS,
    PROMPTS,
    counting_launches,
    make_engine,
    mixed_requests,
    run_all,
    staggered,
    text_of,
    valid,
)
from unit_tests.helpers.scripted_drafts import ScriptedDrafts, rotating_script

pytestmark = pytest.mark.usefixtures("one_torch_thread")

COMBOS = [
    ("qwen3_5", "native", {}),
    ("qwen3_5", "native", {"disable_overlap_schedule": True, "spec_ngram": 2}),
    ("qwen3_5", "compact", {"mtp_step": 2}),
    ("qwen3_5", "replay", {"mtp_step": 3}),
    ("qwen3_next", "replay", {"spec_ngram": 2}),
    ("kimi_linear", "compact", {"spec_ngram": 3}),
]


@pytest.mark.parametrize(
    "arch, mode, flags",
    COMBOS,
    ids=lambda v: str(v) if not isinstance(v, dict) else "-".join(f"{k}{x}" for k, x in v.items()) or "nospec",
)
def test_constrained_output_is_always_valid(arch, mode, flags):
    engine, info, tok = make_engine(arch, mode, **flags)
    prompts = {f"r{i}": p for i, p in enumerate(PROMPTS)}
    # sampled (seeded) and greedy requests with the grammar, and one free request batched beside them
    params = {
        rid: SamplingParams(temperature=0.0 if i == 0 else 1.0, seed=i, max_tokens=MAX_TOKENS, grammar=GRAMMAR)
        for i, rid in enumerate(prompts)
    }
    prompts["free"] = [7, 7, 7]
    params["free"] = SamplingParams(temperature=1.0, seed=9, max_tokens=24, ignore_eos=True)
    chunks, finished = run_all(engine, info, tok, params, prompts)
    eos = set(tok.eos_token_ids)
    for rid in prompts:
        if rid == "free":
            continue
        assert finished[rid].reason == "stop", (rid, finished[rid])
        text = text_of(tok, chunks[rid], eos)
        assert valid(text), (rid, text)
    # twin: the same requests without the grammar are not valid (the random model writes no JSON)
    engine, info, tok = make_engine(arch, mode, **flags)
    free = {rid: SamplingParams(temperature=p.temperature, seed=p.seed, max_tokens=24) for rid, p in params.items()}
    chunks, _ = run_all(engine, info, tok, free, {rid: prompts[rid] for rid in free})
    assert not any(valid(text_of(tok, chunks[rid], eos)) for rid in free)


OVERLAP_COMBOS = [
    ("native", {}),
    ("native", {"mtp_step": 2}),
    ("native", {"spec_ngram": 2}),
    ("compact", {"mtp_step": 2}),
    ("compact", {"spec_ngram": 2}),
    ("replay", {}),
    ("replay", {"mtp_step": 2}),
    ("replay", {"spec_ngram": 2}),
]


@pytest.mark.parametrize(
    "mode, spec", OVERLAP_COMBOS, ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}{x}" for k, x in v.items())
)
def test_constrained_output_with_overlap_equals_without(mode, spec):
    engine, info, tok = make_engine("qwen3_5", mode, disable_overlap_schedule=True, **spec)
    reference = staggered(engine, info, tok, mixed_requests())
    engine, info, tok = make_engine("qwen3_5", mode, **spec)
    launches = counting_launches(engine)
    overlapped = staggered(engine, info, tok, mixed_requests())
    assert overlapped == reference
    eos = set(tok.eos_token_ids)
    for rid, (ids, reason) in overlapped.items():
        if rid != "free":
            assert reason == "stop" and valid(text_of(tok, [ids], eos)), (rid, reason)
    # without drafts the constrained rows really ran overlapped (drafts make every step synchronous)
    assert sum(launches) >= (10 if not spec else 0)


def test_overlap_without_the_masks_is_caught(monkeypatch):
    """Teeth: the overlapped step's masked draw is what the comparison above checks."""
    from lightllm.engine.grammar_masks import MaskJob

    engine, info, tok = make_engine("qwen3_5", "native", disable_overlap_schedule=True)
    reference = staggered(engine, info, tok, mixed_requests())
    engine, info, tok = make_engine("qwen3_5", "native")
    monkeypatch.setattr(MaskJob, "apply", lambda job, logits: logits)
    launches = counting_launches(engine)
    broken = staggered(engine, info, tok, mixed_requests())
    # unmasked, an overlapped draw leaves the grammar: the matcher refuses it and the request fails
    assert sum(launches) >= 1 and broken != reference
    assert "error" in {reason for _, reason in broken.values()}


@pytest.mark.parametrize("mode", ["native", "replay"])
def test_grammar_after_a_start_token_with_overlap_equals_without(mode):
    """A grammar that starts after a token (a reasoning block's end): the output is free up to that token (the free
    greedy run's own tokens), JSON after it, and the same with overlap on, where the switch happens between an
    in-flight step's read-back and the next masked draw."""
    prompt = PROMPTS[1]
    engine, info, tok = make_engine("qwen3_5", mode)
    free = staggered(engine, info, tok, [(0, "free", prompt, SamplingParams(temperature=0.0, max_tokens=6))])
    start_token = free["free"][0][3]
    head = free["free"][0][: free["free"][0].index(start_token) + 1]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, grammar=GRAMMAR, grammar_start_token=start_token)
    requests = [(0, "r", prompt, params), *mixed_requests()[1:3]]
    engine, info, tok = make_engine("qwen3_5", mode, disable_overlap_schedule=True)
    reference = staggered(engine, info, tok, requests)
    engine, info, tok = make_engine("qwen3_5", mode)
    launches = counting_launches(engine)
    overlapped = staggered(engine, info, tok, requests)
    assert overlapped == reference and sum(launches) >= 10
    ids, reason = overlapped["r"]
    assert ids[: len(head)] == head and reason == "stop"
    assert valid(text_of(tok, [ids[len(head) :]], set(tok.eos_token_ids)))


@pytest.mark.parametrize("mode, flags", [("native", {}), ("replay", {"mtp_step": 2})], ids=["native", "replay-mtp2"])
def test_an_output_cannot_stop_before_its_grammar_starts(mode, flags):
    """The model's favourite token is the stop token, its second the reasoning block's end: the output may not
    stop inside the block (it closes it, then writes valid JSON, then stops); the twin without a grammar stops at
    once, as the model wants."""
    engine, info, tok = make_engine("qwen3_5", mode, **flags)
    (eos, *_), start = tok.eos_token_ids, 11
    bias = {eos: 100.0, start: 50.0}
    constrained = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, grammar=GRAMMAR, grammar_start_token=start, logit_bias=bias
    )
    free = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logit_bias=bias)
    out = staggered(engine, info, tok, [(0, "r", PROMPTS[1], constrained), (0, "free", PROMPTS[1], free)])
    ids, reason = out["r"]
    assert ids[0] == start and reason == "stop"
    assert valid(text_of(tok, [ids[1:]], set(tok.eos_token_ids)))
    assert out["free"] == ([eos], "stop")


def _chained_verify_run(mode: str, overlap: bool):
    """Two greedy free rows decoding with MTP through the fixed step buffers (eager on the CPU), so that with
    overlap on their verify steps chain in flight; constrained greedy requests arrive mid-chain. Each request's
    tokens and finish reason, and per overlapped verify launch whether it chained from one in flight."""
    flags = {} if overlap else {"disable_overlap_schedule": True}
    engine, info, tok = make_engine("qwen3_5", mode, mtp_step=2, **flags)
    assert engine.runner.init_decode_graphs(use_graphs=False)
    chained: list[bool] = []
    launch = engine.overlap.spec.launch

    def counted(plan, previous):
        chained.append(previous is not None)
        return launch(plan, previous)

    engine.overlap.spec.launch = counted
    free = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    requests = [
        (0, "a", PROMPTS[0], free),
        (0, "b", [7, 7, 7], free),
        (4, "json", PROMPTS[1], _greedy_constrained()),
        (9, "late", PROMPTS[2], _greedy_constrained()),
    ]
    return staggered(engine, info, tok, requests), chained, tok


@pytest.mark.parametrize("mode", ["native", "compact", "replay"])
def test_constrained_rows_joining_overlapped_mtp_chains_equal_overlap_off(mode):
    """MTP with overlap on: unconstrained greedy rows chain their verify steps on the device; a constrained row
    (which the device's verify cannot mask) makes the steps it shares synchronous, masked at every position, and
    the chain resumes once it has finished. Every token and finish equals overlap off."""
    reference, chained, tok = _chained_verify_run(mode, overlap=False)
    assert chained == []
    overlapped, chained, _ = _chained_verify_run(mode, overlap=True)
    assert overlapped == reference
    eos = set(tok.eos_token_ids)
    for rid in ("json", "late"):
        ids, reason = overlapped[rid]
        assert reason == "stop" and valid(text_of(tok, [ids], eos)), (rid, reason)
    # chains before the constrained rows arrived and after they finished
    assert chained[:3] == [False, True, True] and chained.count(False) >= 2 and sum(chained) >= 20


def test_a_constrained_row_let_into_an_overlapped_verify_is_caught(monkeypatch):
    """Twin: a chained verify that takes the constrained rows too (the device's acceptance has no masks) draws
    tokens outside the grammar: those requests fail."""
    from lightllm.engine.spec_overlap import SpecOverlap

    reference, _, _ = _chained_verify_run("replay", overlap=False)
    rows_fit = SpecOverlap._rows_fit

    def ignoring_grammars(self, reqs):
        grammars = [req.grammar for req in reqs]
        for req in reqs:
            req.grammar = None
        try:
            return rows_fit(self, reqs)
        finally:
            for req, g in zip(reqs, grammars):
                req.grammar = g

    monkeypatch.setattr(SpecOverlap, "_rows_fit", ignoring_grammars)
    broken, _, _ = _chained_verify_run("replay", overlap=True)
    assert broken != reference
    assert {broken[rid][1] for rid in ("json", "late")} == {"error"}


class _BadDrafts:
    """The engine's own drafting after every step (the MTP head's bookkeeping runs), verify windows drafted from the
    known continuation with one draft of every other window replaced by a token the grammar never allows."""

    def __init__(self, speculator, scripted: ScriptedDrafts, bad_token: int):
        self.num_drafts, self.speculator = speculator.num_drafts, speculator
        self.scripted, self.bad_token = scripted, bad_token

    def propose(self, reqs):
        self.speculator.flush()
        self.scripted.propose(reqs)
        for req in reqs:
            wrong = rotating_script(self.scripted._windows[req.req_id], len(req.draft_ids))
            if wrong is not None:
                req.draft_ids[wrong] = self.bad_token

    def after_step(self, runner, rows, hidden):
        self.speculator.after_step(runner, rows, hidden)

    def flush(self, reqs=None):
        self.speculator.flush(reqs)


# every state mode with each kind of drafts (compact exists only with drafts)
SPEC_COMBOS = [
    ("replay", {"mtp_step": 2}),
    ("native", {"mtp_step": 2}),
    ("compact", {"mtp_step": 3}),
    ("native", {"spec_ngram": 2}),
    ("compact", {"spec_ngram": 3}),
    ("replay", {"spec_ngram": 2}),
]


def _spec_id(value) -> str:
    return value if isinstance(value, str) else "-".join(f"{k}{x}" for k, x in value.items())


def _greedy_reference(prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """Constrained greedy tokens without speculation."""
    engine, info, tok = make_engine("qwen3_5", "native")
    chunks, _ = run_all(engine, info, tok, dict.fromkeys(prompts, _greedy_constrained()), prompts)
    eos = set(tok.eos_token_ids)
    assert all(valid(text_of(tok, chunks[rid], eos)) for rid in prompts)
    return {rid: [t for c in chunks[rid] for t in c] for rid in prompts}


def _with_bad_drafts(mode: str, spec: dict, prompts: dict[str, list[int]], expected: dict[str, list[int]]):
    """Constrained greedy decoding whose drafts are the expected tokens, one of every other window replaced by a
    token the grammar refuses; the chunks, finishes, script and engine."""
    engine, info, tok = make_engine("qwen3_5", mode, **spec)
    (bad_token,) = tok.encode_rendered("@")
    continuations = {tuple(prompts[rid]): expected[rid] + [0] * 4 for rid in prompts}
    scripted = ScriptedDrafts(continuations, engine.speculator.num_drafts, engine.runner.vocab_size)
    engine.speculator = _BadDrafts(engine.speculator, scripted, bad_token)
    chunks, finished = run_all(engine, info, tok, dict.fromkeys(prompts, _greedy_constrained()), prompts)
    return chunks, finished, scripted, engine


@pytest.mark.parametrize("mode, spec", SPEC_COMBOS, ids=_spec_id)
def test_constrained_greedy_with_drafts_equals_no_speculation(mode, spec):
    prompts = {f"r{i}": p for i, p in enumerate(PROMPTS)}
    expected = _greedy_reference(prompts)
    chunks, _, scripted, engine = _with_bad_drafts(mode, spec, prompts, expected)
    for rid in prompts:
        assert [t for c in chunks[rid] for t in c] == expected[rid]
        # each window emitted exactly the drafts before the refused one, plus one token
        windows = scripted.expected_tokens_per_window[rid]
        assert [len(c) for c in chunks[rid][1:]] == [min(w, n) for w, n in zip(windows, _left(chunks[rid][1:]))]
    assert engine.stats.num_accepted_draft_tokens > 0

    # twin: without the grammar the same greedy decoding is something else (the constraint did the work)
    engine, info, tok = make_engine("qwen3_5", "native")
    free, _ = run_all(
        engine, info, tok, dict.fromkeys(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)), prompts
    )
    assert all([t for c in free[rid] for t in c] != expected[rid] for rid in prompts)


@pytest.mark.parametrize("mode, spec", [("replay", {"mtp_step": 2}), ("native", {"spec_ngram": 2})], ids=_spec_id)
def test_drafts_verified_without_their_masks_are_caught(mode, spec, monkeypatch):
    """Twin of the test above: a step that masks only each window's first position lets a draft position take a
    token outside the grammar, which the matcher refuses (the request fails) instead of giving the expected tokens."""
    from lightllm.engine import grammar

    prompts = {f"r{i}": p for i, p in enumerate(PROMPTS)}
    expected = _greedy_reference(prompts)
    mask_windows = grammar.mask_windows

    def first_positions_only(windows, logits):
        return mask_windows([(req, start, 1, []) for req, start, _, _ in windows], logits)

    monkeypatch.setattr(grammar, "mask_windows", first_positions_only)
    chunks, finished, _, _ = _with_bad_drafts(mode, spec, prompts, expected)
    assert all([t for c in chunks[rid] for t in c] != expected[rid] for rid in prompts)
    assert {finished[rid].reason for rid in prompts} == {"error"}


def _left(chunks: list[list[int]]) -> list[int]:
    """Tokens remaining before each chunk (a window's emission is cut at the end of the output)."""
    total = sum(len(c) for c in chunks)
    out = []
    for c in chunks:
        out.append(total)
        total -= len(c)
    return out


def test_offline_llm_generates_to_the_grammar():
    from lightllm.server.llm import LLM

    llm = LLM(str(tiny_model_dir("kimi_linear")), device="cpu", max_total_token_num=1024)
    params = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=MAX_TOKENS, grammar=GRAMMAR)
    (result,) = llm.generate([[5, 6, 7]], params)
    assert [o.finish_reason for o in result.outputs] == ["stop", "stop"]
    assert all(valid(o.text) for o in result.outputs)


def test_a_slow_grammar_compile_holds_only_its_own_request(monkeypatch):
    """Grammars compile in the background: while one request's compile is held, a free request beside it keeps
    decoding; once released, the constrained request gives the tokens it gives with an immediate compile. A grammar
    that does not compile fails its own request only, and an abort during a compile finishes that request."""
    import threading

    from lightllm.engine import grammar as grammar_module
    from lightllm.engine.messages import Finished, NewRequest, TokenChunk

    engine, info, tok = make_engine("qwen3_5", "replay")
    reference = staggered(engine, info, tok, [(0, "json", list(PROMPTS[0]), _greedy_constrained())])
    release = threading.Event()
    compile_now = grammar_module._compile

    def held(tokenizer, text):
        release.wait(timeout=60)
        return compile_now(tokenizer, text)

    engine, info, tok = make_engine("qwen3_5", "replay")
    monkeypatch.setattr(grammar_module, "_compile", held)
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    bad = SamplingParams(max_tokens=8, grammar='{"grammars": [{"json_schema": {"type": "objectx"}}]}')
    for rid, ids, params in (
        ("json", PROMPTS[0], _greedy_constrained()),
        ("free", [7, 7, 7], free),
        ("bad", [3, 4], bad),
        ("gone", [9, 9], _greedy_constrained()),
    ):
        msg = NewRequest(rid, list(ids), params, list(tok.eos_token_ids), tokenizer_dir=info.model_dir)
        assert engine.add_request(msg) == []
    tokens: dict[str, list[int]] = {"json": [], "free": []}
    finished: dict[str, Finished] = {}

    def drive(outputs):
        for out in outputs:
            if isinstance(out, TokenChunk):
                tokens[out.req_id] += out.token_ids
            elif isinstance(out, Finished):
                finished[out.req_id] = out

    drive(engine.abort("gone"))
    while "free" not in finished:
        drive(engine.step())
    # the free request ran to its end while every compile was held
    assert len(tokens["free"]) == 12 and tokens["json"] == [] and finished["gone"].reason == "abort"
    assert engine.snapshot().num_waiting == 2
    release.set()
    while engine.has_work():
        drive(engine.step())
    assert finished["bad"].reason == "error" and "grammar" in finished["bad"].error
    assert (tokens["json"], finished["json"].reason) == reference["json"]
    # twin: the constrained request's tokens are not the free model's
    assert (
        tokens["json"]
        != staggered(engine, info, tok, [(0, "x", list(PROMPTS[0]), free)])["x"][0][: len(tokens["json"])]
    )


def _greedy_constrained() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, grammar=GRAMMAR)
