"""Constrained decoding through the engine with the real runner on tiny random checkpoints: the grammar, not the
model, makes every output valid, in every state mode, with and without speculation and overlap; overlap scheduling
changes no constrained token; under MTP with replay, constrained greedy decoding equals constrained greedy decoding
without speculation, and scripted drafts the grammar refuses are rejected."""

from __future__ import annotations

import json

import pytest

from lightllm.engine.messages import Finished, NewRequest, TokenChunk
from lightllm.engine.sampling_params import SamplingParams
from lightllm.server.args import load_server_args
from lightllm.server.engine_process import build_engine
from lightllm.server.http.structured import json_schema_grammar
from lightllm.server.tokenizer import Tokenizer
from lightllm.tools.make_tiny_model import tiny_model_dir
from unit_tests.helpers.scripted_drafts import ScriptedDrafts, rotating_script

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"enum": ["red", "blue"]},
        "ok": {"type": "boolean"},
    },
    "required": ["n", "tag", "ok"],
    "additionalProperties": False,
}
GRAMMAR = json_schema_grammar(SCHEMA)
PROMPTS = ([5, 6, 7, 8, 9], list(range(30, 53)), [11, 12])
MAX_TOKENS = 80


def _valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (
        isinstance(value, dict)
        and set(value) == {"n", "tag", "ok"}
        and isinstance(value["n"], int)
        and 0 <= value["n"] <= 999
        and value["tag"] in ("red", "blue")
        and isinstance(value["ok"], bool)
    )


def _engine(arch: str, mode: str, **flags):
    args, info = load_server_args(
        [],
        model_dir=str(tiny_model_dir(arch)),
        device="cpu",
        data_type="float32",
        ssm_state_mode=mode,
        max_running_requests=4,
        chunked_prefill_size=16,
        max_total_token_num=1024,
        **flags,
    )
    return build_engine(args, info, "lightllm.server.runner_factory:create_runner"), info, Tokenizer(info)


def _run(engine, info, tok, params_of: dict[str, SamplingParams], prompts: dict[str, list[int]]):
    chunks: dict[str, list[list[int]]] = {rid: [] for rid in prompts}
    finished: dict[str, Finished] = {}
    for rid, ids in prompts.items():
        msg = NewRequest(rid, ids, params_of[rid], list(tok.eos_token_ids), tokenizer_dir=info.model_dir)
        assert engine.add_request(msg) == []
    while engine.has_work():
        for out in engine.step():
            if isinstance(out, TokenChunk):
                chunks[out.req_id].append(out.token_ids)
            elif isinstance(out, Finished):
                finished[out.req_id] = out
    return chunks, finished


def _text(tok, chunks: list[list[int]], eos) -> str:
    ids = [t for c in chunks for t in c]
    return tok.decode([t for t in ids if t not in eos])


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
    engine, info, tok = _engine(arch, mode, **flags)
    prompts = {f"r{i}": p for i, p in enumerate(PROMPTS)}
    # sampled (seeded) and greedy requests with the grammar, and one free request batched beside them
    params = {
        rid: SamplingParams(temperature=0.0 if i == 0 else 1.0, seed=i, max_tokens=MAX_TOKENS, grammar=GRAMMAR)
        for i, rid in enumerate(prompts)
    }
    prompts["free"] = [7, 7, 7]
    params["free"] = SamplingParams(temperature=1.0, seed=9, max_tokens=24, ignore_eos=True)
    chunks, finished = _run(engine, info, tok, params, prompts)
    eos = set(tok.eos_token_ids)
    for rid in prompts:
        if rid == "free":
            continue
        assert finished[rid].reason == "stop", (rid, finished[rid])
        text = _text(tok, chunks[rid], eos)
        assert _valid(text), (rid, text)
    # twin: the same requests without the grammar are not valid (the random model writes no JSON)
    engine, info, tok = _engine(arch, mode, **flags)
    free = {rid: SamplingParams(temperature=p.temperature, seed=p.seed, max_tokens=24) for rid, p in params.items()}
    chunks, _ = _run(engine, info, tok, free, {rid: prompts[rid] for rid in free})
    assert not any(_valid(_text(tok, chunks[rid], eos)) for rid in free)


def _staggered(engine, info, tok, requests: list[tuple[int, str, list[int], SamplingParams]]):
    """Drive `requests` (arrival step, id, prompt, params) to the end: each id's tokens and finish reason."""
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    step = 0
    while engine.has_work() or any(at >= step for at, *_ in requests):
        for at, rid, ids, params in requests:
            if at == step:
                msg = NewRequest(rid, ids, params, list(tok.eos_token_ids), tokenizer_dir=info.model_dir)
                assert engine.add_request(msg) == []
        for out in engine.step():
            if isinstance(out, TokenChunk):
                tokens.setdefault(out.req_id, []).extend(out.token_ids)
            elif isinstance(out, Finished):
                reasons[out.req_id] = out.reason
        step += 1
    return {rid: (tokens.get(rid, []), reasons[rid]) for rid in reasons}


def _mixed_requests() -> list[tuple[int, str, list[int], SamplingParams]]:
    """Constrained greedy, seeded sampled and top-k rows beside a free row, arriving while others decode, one
    more than fits at once (it waits for a slot)."""

    def constrained(**kw):
        return SamplingParams(max_tokens=MAX_TOKENS, grammar=GRAMMAR, **kw)

    return [
        (0, "greedy", PROMPTS[0], constrained(temperature=0.0)),
        (0, "sampled", PROMPTS[1], constrained(temperature=1.0, seed=1)),
        (0, "free", [7, 7, 7], SamplingParams(temperature=1.0, seed=9, max_tokens=30, ignore_eos=True)),
        (3, "top_k", PROMPTS[2], constrained(temperature=0.8, top_k=20, seed=5)),
        (6, "late", [40, 41, 42, 43], constrained(temperature=0.0)),
    ]


def _counting_launches(engine) -> list[bool]:
    """Records, for each overlapped launch, whether it chained from a step in flight with constrained rows."""
    launches: list[bool] = []
    launch = engine.overlap.launch

    def counted(plan, previous):
        launches.append(previous is not None and any(row.req.grammar is not None for row in plan.decode))
        return launch(plan, previous)

    engine.overlap.launch = counted
    return launches


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
    engine, info, tok = _engine("qwen3_5", mode, disable_overlap_schedule=True, **spec)
    reference = _staggered(engine, info, tok, _mixed_requests())
    engine, info, tok = _engine("qwen3_5", mode, **spec)
    launches = _counting_launches(engine)
    overlapped = _staggered(engine, info, tok, _mixed_requests())
    assert overlapped == reference
    eos = set(tok.eos_token_ids)
    for rid, (ids, reason) in overlapped.items():
        if rid != "free":
            assert reason == "stop" and _valid(_text(tok, [ids], eos)), (rid, reason)
    # without drafts the constrained rows really ran overlapped (drafts make every step synchronous)
    assert sum(launches) >= (10 if not spec else 0)


def test_overlap_without_the_masks_is_caught():
    """Teeth: the overlapped step's masked draw is what the comparison above checks."""
    engine, info, tok = _engine("qwen3_5", "native", disable_overlap_schedule=True)
    reference = _staggered(engine, info, tok, _mixed_requests())
    engine, info, tok = _engine("qwen3_5", "native")
    engine.overlap._masked = lambda plan, logits: logits
    launches = _counting_launches(engine)
    broken = _staggered(engine, info, tok, _mixed_requests())
    # unmasked, an overlapped draw leaves the grammar: the matcher refuses it and the request fails
    assert sum(launches) >= 1 and broken != reference
    assert "error" in {reason for _, reason in broken.values()}


class _BadDrafts:
    """MTP drafting after every step, verify windows drafted from the known continuation with one draft of every
    other window replaced by a token the grammar never allows."""

    def __init__(self, mtp, scripted: ScriptedDrafts, bad_token: int):
        self.num_drafts, self.mtp, self.scripted, self.bad_token = mtp.num_drafts, mtp, scripted, bad_token

    def propose(self, reqs):
        self.mtp.flush()
        self.scripted.propose(reqs)
        for req in reqs:
            wrong = rotating_script(self.scripted._windows[req.req_id], len(req.draft_ids))
            if wrong is not None:
                req.draft_ids[wrong] = self.bad_token

    def after_step(self, runner, rows, hidden):
        self.mtp.after_step(runner, rows, hidden)

    def flush(self, reqs=None):
        self.mtp.flush(reqs)


def test_constrained_greedy_with_mtp_and_replay_equals_no_speculation():
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, grammar=GRAMMAR)
    prompts = {f"r{i}": p for i, p in enumerate(PROMPTS)}
    engine, info, tok = _engine("qwen3_5", "native")
    reference, _ = _run(engine, info, tok, dict.fromkeys(prompts, greedy), prompts)
    expected = {rid: [t for c in reference[rid] for t in c] for rid in prompts}
    eos = set(tok.eos_token_ids)
    assert all(_valid(_text(tok, reference[rid], eos)) for rid in prompts)

    engine, info, tok = _engine("qwen3_5", "replay", mtp_step=2)
    (bad_token,) = tok.encode_rendered("@")
    continuations = {tuple(prompts[rid]): expected[rid] + [0] * 4 for rid in prompts}
    scripted = ScriptedDrafts(continuations, 2, engine.runner.vocab_size)
    engine.speculator = _BadDrafts(engine.speculator, scripted, bad_token)
    chunks, finished = _run(engine, info, tok, dict.fromkeys(prompts, greedy), prompts)
    for rid in prompts:
        assert [t for c in chunks[rid] for t in c] == expected[rid]
        # each window emitted exactly the drafts before the refused one, plus one token
        windows = scripted.expected_tokens_per_window[rid]
        assert [len(c) for c in chunks[rid][1:]] == [min(w, n) for w, n in zip(windows, _left(chunks[rid][1:]))]
    assert engine.stats.num_accepted_draft_tokens > 0

    # twin: without the grammar the same greedy decoding is something else (the constraint did the work)
    engine, info, tok = _engine("qwen3_5", "native")
    free, _ = _run(
        engine, info, tok, dict.fromkeys(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)), prompts
    )
    assert all([t for c in free[rid] for t in c] != expected[rid] for rid in prompts)


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
    assert all(_valid(o.text) for o in result.outputs)
