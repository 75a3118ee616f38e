"""Overlap scheduling changes no output: the engine with the real runner on a tiny checkpoint (dense, MoE,
Kimi-Linear) gives the same tokens and finish reasons with overlap on and off, through staggered arrivals (prefill
chunks launched beside decode rows whose tokens are still on the device), stop tokens, length limits, an abort, a
seeded sampled request (drawn on the device under overlap) and a penalized one that forces synchronous steps in
between; and every pool is whole again afterwards."""

from __future__ import annotations

import numpy as np
import pytest

from lightllm.engine.engine import Engine
from lightllm.engine.messages import Finished, NewRequest, TokenChunk
from lightllm.engine.sampling_params import SamplingParams
from lightllm.server.args import load_server_args
from lightllm.server.engine_process import build_engine
from lightllm.server.runner_factory import DEFAULT_RUNNER_FACTORY
from lightllm.tools.make_tiny_model import tiny_model_dir

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _engine(mode: str, overlap: bool, arch: str = "qwen3_5") -> Engine:
    args, info = load_server_args(
        [],
        model_dir=str(tiny_model_dir(arch)),
        device="cpu",
        ssm_state_mode=mode,
        max_running_requests=4,
        chunked_prefill_size=16,
        max_total_token_num=400,
        prefix_cache_state_bytes=1 << 20,
        disable_overlap_schedule=not overlap,
    )
    return build_engine(args, info, DEFAULT_RUNNER_FACTORY)


def _requests(vocab: int, seed: int, stop_token: int | None) -> list[tuple[int, NewRequest]]:
    """(arrival step, request): greedy requests of random lengths, one stopping on `stop_token`, one sampled with
    a seed, one with a repetition penalty."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(7):
        prompt = rng.integers(3, vocab - 3, size=int(rng.integers(3, 20))).tolist()
        params = SamplingParams(temperature=0, max_tokens=int(rng.integers(3, 14)), ignore_eos=True)
        if i == 2 and stop_token is not None:
            params.stop_token_ids = [stop_token]
            params.max_tokens = 30
        if i == 3:
            params.max_tokens = 60
        if i == 5:
            params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
        if i == 6:
            params = SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=5, ignore_eos=True)
        out.append((int(rng.integers(0, 12)), NewRequest(f"r{i}", prompt, params)))
    return out


def _drive(engine: Engine, requests, abort_at: dict[int, str]) -> dict[str, tuple[list[int], str]]:
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    step = 0
    while step < 200 and (engine.has_work() or any(at >= step for at, _ in requests)):
        for at, msg in requests:
            if at == step:
                assert engine.add_request(msg) == []
        outputs = engine.abort(abort_at[step]) if step in abort_at else []
        outputs += engine.step()
        for out in outputs:
            if isinstance(out, TokenChunk):
                tokens.setdefault(out.req_id, []).extend(out.token_ids)
            elif isinstance(out, Finished):
                assert out.req_id not in reasons, f"{out.req_id} finished twice"
                reasons[out.req_id] = out.reason
        step += 1
    assert not engine.has_work()
    return {rid: (tokens.get(rid, []), reasons[rid]) for rid in reasons}


def _run(mode: str, overlap: bool, stop_token: int | None, corrupt: bool = False, arch: str = "qwen3_5"):
    engine = _engine(mode, overlap, arch)
    runner = engine.runner
    free_start = (runner.num_free_requests(), runner.num_free_kv_tokens())
    launches = []
    launch = engine.overlap.launch

    def counted(plan, previous):
        launches.append((previous is not None, bool(plan.prefill)))
        if corrupt and previous is not None:
            # the chained step's input only: the tokens read back and emitted are the host copy's
            previous.tokens = (previous.tokens + 1) % runner.vocab_size
        return launch(plan, previous)

    engine.overlap.launch = counted
    result = _drive(engine, _requests(runner.vocab_size, 11, stop_token), abort_at={40: "r3"})
    runner.evict_prefix_cache()
    assert (runner.num_free_requests(), runner.num_free_kv_tokens()) == free_start, "a pool leaked"
    return result, launches


# the dense layout in both modes; a MoE model and Kimi-Linear (MLA, KDA) in replay
@pytest.mark.parametrize(
    "arch, mode",
    [("qwen3_5", "native"), ("qwen3_5", "replay"), ("qwen3_5_moe", "replay"), ("kimi_linear", "replay")],
)
def test_overlap_gives_the_same_tokens_as_stepping_one_at_a_time(arch, mode):
    cold, launches = _run(mode, overlap=False, stop_token=None, arch=arch)
    assert launches == []
    # r2 stops on the 4th token of its cold continuation: a stop the overlapped step learns one step late
    stop_token = cold["r2"][0][3]
    reference, _ = _run(mode, overlap=False, stop_token=stop_token, arch=arch)
    overlapped, launches = _run(mode, overlap=True, stop_token=stop_token, arch=arch)
    assert reference["r2"][1] == "stop" and reference["r3"][1] == "abort"
    # an abort lands between engine calls, and with overlap the call's tokens are the previous step's: the aborted
    # request may have one token fewer, of the same continuation
    aborted, kept = overlapped.pop("r3"), reference.pop("r3")
    assert aborted[1] == "abort" and len(aborted[0]) >= len(kept[0]) - 1 and kept[0][: len(aborted[0])] == aborted[0]
    assert overlapped == reference
    # the overlap really ran: steps launched before the step before was read back (prefill chunks among them,
    # beside decode rows), and first launches from the host
    chained = [prefill for was_chained, prefill in launches if was_chained]
    assert len(chained) >= 10 and sum(chained) >= 3 and len(launches) - len(chained) >= 2


def test_a_wrong_device_token_changes_the_output():
    """Teeth: the chained step's input tokens are what the comparison above checks."""
    reference, _ = _run("replay", overlap=False, stop_token=None)
    corrupted, launches = _run("replay", overlap=True, stop_token=None, corrupt=True)
    assert sum(chained for chained, _ in launches) >= 10
    # compared without the aborted request, whose length may differ by one with overlap whatever the tokens
    corrupted.pop("r3"), reference.pop("r3")
    assert corrupted != reference


def _stop_run(overlap: bool, stop_token: int | None):
    """Three greedy requests decoding together, nothing waiting; r1 stops on `stop_token`. The result and, per
    launch, (chained, its decode rows' request ids, the sampling rows' ids of the step it chained from)."""
    engine = _engine("replay", overlap)
    vocab = engine.runner.vocab_size
    rng = np.random.default_rng(5)
    requests = []
    for i, max_tokens in enumerate((16, 30, 22)):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        if i == 1 and stop_token is not None:
            params.stop_token_ids = [stop_token]
        requests.append((0, NewRequest(f"r{i}", rng.integers(3, vocab - 3, size=9).tolist(), params)))
    launches = []
    launch = engine.overlap.launch

    def counted(plan, previous):
        rows = {row.req.req_id for row in plan.decode}
        launches.append((previous is not None, rows, {req.req_id for req in previous.windows} if previous else set()))
        return launch(plan, previous)

    engine.overlap.launch = counted
    return _drive(engine, requests, abort_at={}), launches


def test_a_stopped_row_is_left_out_of_the_next_chained_step():
    """A row that stops rides along in the step launched before its stop token was read, and the step after that
    chains on without it (the chain does not end) with the synchronous tokens; twin: the stop token is what ends
    r1, and without it no step leaves a row out."""
    cold, _ = _stop_run(overlap=False, stop_token=None)
    stop_token = cold["r1"][0][5]
    assert stop_token not in cold["r1"][0][:5]
    reference, _ = _stop_run(overlap=False, stop_token=stop_token)
    overlapped, launches = _stop_run(overlap=True, stop_token=stop_token)
    assert overlapped == reference and reference["r1"] == (cold["r1"][0][:6], "stop")
    assert any(_left_out_early("r1", *launch) for launch in launches), launches
    _, free_launches = _stop_run(overlap=True, stop_token=None)
    assert not any(_left_out_early("r1", *launch) for launch in free_launches), free_launches


def _left_out_early(req_id: str, chained: bool, rows: set[str], before: set[str]) -> bool:
    """A chained step without `req_id`, which the step before had, while others go on (r1 has the longest length
    limit: without its stop token it is the last to leave)."""
    return chained and req_id in before and req_id not in rows and bool(rows)
