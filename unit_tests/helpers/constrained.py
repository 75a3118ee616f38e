"""Constrained decoding through the engine on tiny random checkpoints, shared by the CPU suite
(test/e2e/test_structured_output.py) and the GPU one (test/gpu/test_grammar_gpu.py): a JSON schema, its grammar,
the check that a text is valid for it, an engine, and a driver of requests arriving at given steps."""

from __future__ import annotations

import json

from lightllm.engine.messages import Finished, NewRequest, TokenChunk
from lightllm.engine.sampling_params import SamplingParams
from lightllm.server.args import load_server_args
from lightllm.server.engine_process import build_engine
from lightllm.server.http.structured import json_schema_grammar
from lightllm.server.tokenizer import Tokenizer
from lightllm.tools.make_tiny_model import tiny_model_dir

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


def valid(text: str) -> bool:
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


def make_engine(arch: str, mode: str, device: str = "cpu", **flags):
    args, info = load_server_args(
        [],
        model_dir=str(tiny_model_dir(arch)),
        device=device,
        data_type="float32",
        ssm_state_mode=mode,
        max_running_requests=4,
        chunked_prefill_size=16,
        max_total_token_num=1024,
        **flags,
    )
    return build_engine(args, info, "lightllm.server.runner_factory:create_runner"), info, Tokenizer(info)


def run_all(engine, info, tok, params_of: dict[str, SamplingParams], prompts: dict[str, list[int]]):
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


def text_of(tok, chunks: list[list[int]], eos) -> str:
    ids = [t for c in chunks for t in c]
    return tok.decode([t for t in ids if t not in eos])


def staggered(engine, info, tok, requests: list[tuple[int, str, list[int], SamplingParams]]):
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


def mixed_requests() -> list[tuple[int, str, list[int], SamplingParams]]:
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


def counting_launches(engine) -> list[bool]:
    """Records, for each overlapped launch, whether it chained from a step in flight with constrained rows."""
    launches: list[bool] = []
    launch = engine.overlap.launch

    def counted(plan, previous):
        launches.append(previous is not None and any(row.req.grammar is not None for row in plan.decode))
        return launch(plan, previous)

    engine.overlap.launch = counted
    return launches
