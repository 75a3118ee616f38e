"""Drive an Engine to completion in tests."""

from __future__ import annotations

from lightllm.engine.engine import Engine
from lightllm.engine.messages import Finished, NewRequest, TokenChunk
from lightllm.engine.sampling_params import SamplingParams
from unit_tests.engine.fake_runner import FakeRunner


def make_engine(
    runner: FakeRunner,
    *,
    max_running_requests: int = 8,
    chunked_prefill_size: int = 64,
    max_req_total_len: int = 256,
    mtp_step: int = 0,
    spec_ngram: int = 0,
) -> Engine:
    return Engine(
        runner,
        max_running_requests=max_running_requests,
        chunked_prefill_size=chunked_prefill_size,
        max_req_total_len=max_req_total_len,
        mtp_step=mtp_step,
        spec_ngram=spec_ngram,
    )


def run(
    engine: Engine,
    prompts: dict[str, list[int]],
    params: SamplingParams,
    eos: list[int] | None = None,
    max_steps: int = 10_000,
) -> tuple[dict[str, list[int]], dict[str, Finished]]:
    """Submit every prompt, step until idle; returns tokens and the Finished message per request id."""
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    finished: dict[str, Finished] = {}
    for rid, ids in prompts.items():
        for out in engine.add_request(NewRequest(rid, ids, params, eos or [])):
            finished[out.req_id] = out
    for _ in range(max_steps):
        if not engine.has_work():
            break
        for out in engine.step():
            if isinstance(out, TokenChunk):
                tokens[out.req_id] += out.token_ids
            elif isinstance(out, Finished):
                finished[out.req_id] = out
    assert not engine.has_work(), "engine did not drain"
    return tokens, finished
