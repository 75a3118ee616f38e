"""MTP drafts left on the device (`engine.speculative.device_drafts`) with the real runner on a tiny Qwen3.5: in
every state mode the engine emits the same tokens, log-probabilities and finish reasons as with the drafts read
back first (exactly) and as greedy decoding without speculation, with scripted drafts that keep 0 .. W - 1 of
their tokens, staggered arrivals, an abort, a stop token found inside a window, length limits and slot reuse; a
greedy speculative step reads the device once (the drafts are never read back on their own)."""

from __future__ import annotations

import pytest
import torch

from lightllm.engine.messages import Finished, NewRequest, TokenChunk
from lightllm.engine.sampling_params import SamplingParams
from lightllm.engine.speculative import MtpSpeculator
from lightllm.engine.speculative.acceptance import SimulatedAcceptance
from lightllm.engine.speculative.device_drafts import DraftBatch
from lightllm.server.args import load_server_args
from lightllm.server.engine_process import build_engine
from unit_tests.helpers.scripted_drafts import ScriptedDrafts
from unit_tests.models.conftest import case_dir

MTP_STEP = 2
# (request id, prompt, max_tokens, arrival step); four requests through two slots: slots are reused
REQUESTS = [
    ("a", [5, 6, 7, 8, 9], 12, 0),
    ("b", list(range(30, 49)), 7, 0),
    ("c", [11, 12], 10, 2),
    ("d", [3, 1, 4, 1, 5, 9, 2, 6], 9, 3),
]
# aborted between steps once it has this many tokens (while a window of it may be due)
ABORTED, ABORT_AFTER = "c", 3
STOPPED, STOP_AT = "d", 2
NUM_REFERENCE_TOKENS = 16


def _engine(
    mode: str,
    mtp_step: int,
    acceptance=None,
    fixed_buffers: bool = False,
    device: str = "cpu",
    max_running_requests: int = 2,
    max_req_total_len: int | None = None,
):
    """`fixed_buffers`: decode and draft steps through the buffers CUDA graphs replay (captured on CUDA, run
    eagerly on the CPU)."""
    limits = {} if max_req_total_len is None else {"max_req_total_len": max_req_total_len}
    args, info = load_server_args(
        [],
        model_dir=case_dir("qwen3_5-hv2"),
        device=device,
        data_type="float32",
        ssm_state_mode=mode,
        mtp_step=mtp_step,
        max_running_requests=max_running_requests,
        chunked_prefill_size=16,
        max_total_token_num=512,
        disable_cudagraph=not fixed_buffers,
        **limits,
    )
    engine = build_engine(args, info, "lightllm.server.runner_factory:create_runner", acceptance)
    if fixed_buffers and device == "cpu":
        assert engine.runner.init_decode_graphs(use_graphs=False)
    if fixed_buffers:
        assert engine.runner.decode_graphs is not None
        assert engine.runner.decode_graphs.use_graphs == (device == "cuda"), "capture failed (see the log)"
        spec_step = engine.runner.spec_step_graphs
        assert spec_step is None or spec_step.use_graphs == (device == "cuda"), "capture failed (see the log)"
    return engine


class _ScriptedOnDevice:
    """Real MTP drafting after every step (the runner's head bookkeeping runs), then scripted drafts put on the
    device as the verify windows' drafts: each window keeps a known number of them."""

    def __init__(self, mtp: MtpSpeculator, scripted: ScriptedDrafts, device: torch.device):
        self.num_drafts, self.mtp, self.scripted, self.device = mtp.num_drafts, mtp, scripted, device

    def propose(self, reqs):
        self.mtp.propose(reqs)
        self.scripted.propose(reqs)
        if not reqs:
            return
        rows = [list(r.draft_ids) + [-1] * (self.num_drafts - len(r.draft_ids)) for r in reqs]
        batch = DraftBatch(torch.tensor(rows, dtype=torch.long, device=self.device))
        if not self.mtp.keep_on_device:
            batch.host()
        for i, req in enumerate(reqs):
            req.draft_ids = batch.row(i, len(req.draft_ids))

    def after_step(self, runner, rows, hidden):
        self.mtp.after_step(runner, rows, hidden)

    def flush(self, reqs=None):
        self.mtp.flush(reqs)


def drive(engine, stop_ids: dict[str, list[int]], abort: bool = True, requests=REQUESTS, abort_after=ABORT_AFTER):
    """Run `requests` (default REQUESTS; ABORTED aborted once it has `abort_after` tokens) (arrivals by step number, the abort by progress); per request its tokens, logprobs, (finish reason,
    output count) and the length of each of its chunks (one per step that gave it tokens)."""
    tokens = {rid: [] for rid, *_ in requests}
    chunks = {rid: [] for rid, *_ in requests}
    logprobs = {rid: [] for rid, *_ in requests}
    finished: dict[str, Finished] = {}
    step = 0
    while step <= max(s for *_, s in requests) or engine.has_work():
        for rid, prompt, max_tokens, arrival in requests:
            if arrival == step:
                params = SamplingParams(
                    temperature=0, max_tokens=max_tokens, logprobs=2, stop_token_ids=stop_ids.get(rid, [])
                )
                assert engine.add_request(NewRequest(rid, prompt, params)) == []
        due = abort and len(tokens[ABORTED]) >= abort_after and ABORTED not in finished
        outputs = engine.abort(ABORTED) if due else []
        outputs += engine.step()
        for out in outputs:
            if isinstance(out, TokenChunk):
                tokens[out.req_id] += out.token_ids
                logprobs[out.req_id] += out.logprobs
                chunks[out.req_id].append(len(out.token_ids))
            elif isinstance(out, Finished):
                finished[out.req_id] = out
        step += 1
        assert step < 500, "engine did not drain"
    return tokens, logprobs, {rid: (f.reason, f.num_output_tokens) for rid, f in finished.items()}, chunks


def engine_tokens(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    """Submit `requests` (id: prompt, params), each accepted, and step the engine until idle: each one's tokens."""
    for rid, (prompt, params) in requests.items():
        assert engine.add_request(NewRequest(rid, prompt, params)) == []
    out = {rid: [] for rid in requests}
    while engine.has_work():
        for o in engine.step():
            if isinstance(o, TokenChunk):
                out[o.req_id] += o.token_ids
    return out


def greedy_continuations(
    device: str = "cpu", requests=REQUESTS, num_tokens: int = NUM_REFERENCE_TOKENS, stop_at: int = STOP_AT
):
    """Greedy continuations of `requests` without speculation (the scripted drafts' truth, `num_tokens` each) and
    the stop token of STOPPED (its output token `stop_at`)."""
    engine = _engine("native", 0, device=device)
    for rid, prompt, _, _ in requests:
        params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
        engine.add_request(NewRequest(rid, prompt, params))
    out = {rid: [] for rid, *_ in requests}
    while engine.has_work():
        for o in engine.step():
            if isinstance(o, TokenChunk):
                out[o.req_id] += o.token_ids
    stop = out[STOPPED][stop_at]
    assert stop not in out[STOPPED][:stop_at], "pick another stop_at: the stop token occurs earlier"
    return {tuple(p): out[rid] for rid, p, _, _ in requests}, {STOPPED: [stop]}


@pytest.fixture(scope="module")
def continuations():
    return greedy_continuations()


def scripted_run(
    mode: str, keep_on_device: bool, continuations, stop_ids, monkeypatch, fixed_buffers=False, device="cpu"
):
    """A run of REQUESTS with scripted drafts on the device (or read back first); its result, the script and the
    number of draft read-backs."""
    engine = _engine(mode, MTP_STEP, fixed_buffers=fixed_buffers, device=device)
    mtp = engine.speculator
    mtp.keep_on_device = keep_on_device
    scripted = ScriptedDrafts(continuations, MTP_STEP, engine.runner.vocab_size)
    engine.speculator = _ScriptedOnDevice(mtp, scripted, engine.runner.device)
    reads, fed = [], []
    original = DraftBatch.host
    monkeypatch.setattr(DraftBatch, "host", lambda self: reads.append(1) or original(self))
    if fixed_buffers:
        graphs = engine.runner.decode_graphs
        run = graphs.run
        # the drafts are the seventh argument
        graphs.run = lambda *a, **k: fed.append(a[6] is not None) or run(*a, **k)
    result = drive(engine, stop_ids)
    monkeypatch.setattr(DraftBatch, "host", original)
    # the fixed buffers took drafts from the device (when they stayed there)
    assert not fixed_buffers or any(fed) == keep_on_device
    return result, scripted, len(reads)


@pytest.mark.parametrize(
    "mode, fixed_buffers",
    [("native", False), ("compact", False), ("replay", False), ("replay", True), ("compact", True)],
    ids=["native", "compact", "replay", "replay-fixed-buffers", "compact-fixed-buffers"],
)
def test_device_drafts_equal_host_drafts_and_greedy(mode, fixed_buffers, continuations, monkeypatch):
    truth, stop_ids = continuations
    on_device, scripted, reads = scripted_run(mode, True, truth, stop_ids, monkeypatch, fixed_buffers)
    on_host, _, host_reads = scripted_run(mode, False, truth, stop_ids, monkeypatch, fixed_buffers)
    # the same windows, the same arithmetic: exactly equal
    assert on_device == on_host
    # the drafts on the device were never read on their own; read back first, once per drafting call
    assert reads == 0 and host_reads > 0
    tokens, logprobs, finished, chunks = on_device
    assert windows_follow_script(chunks, scripted)
    # the script made windows keep every count of drafts, 0 .. MTP_STEP
    kept = {n - 1 for windows in scripted.expected_tokens_per_window.values() for n in windows}
    assert kept == set(range(MTP_STEP + 1))
    # greedy without speculation: the same tokens and reasons, log-probabilities to rounding
    # (compact differs from native only under speculation: the reference runs native)
    reference = drive(_engine("native" if mode == "compact" else mode, 0), stop_ids)
    for rid, prompt, _, _ in REQUESTS:
        if rid == ABORTED:
            assert finished[rid][0] == "abort" and len(tokens[rid]) >= ABORT_AFTER
            assert tokens[rid] == truth[tuple(prompt)][: len(tokens[rid])]
            continue
        assert tokens[rid] == reference[0][rid], rid
        assert finished[rid] == reference[2][rid], rid
        assert torch.allclose(torch.tensor(logprobs[rid]), torch.tensor(reference[1][rid]), atol=1e-4), rid
    assert finished[STOPPED] == ("stop", STOP_AT + 1)
    assert finished["a"] == ("length", 12) and finished["b"] == ("length", 7)


def windows_follow_script(chunks: dict[str, list[int]], scripted: ScriptedDrafts) -> bool:
    """Whether each request's windows (its chunks after the prefill's) emitted what its script kept (the last may
    be cut by a stop token)."""
    for rid, lengths in chunks.items():
        expected = scripted.expected_tokens_per_window.get(rid, [])
        windows = lengths[1:]
        if windows[:-1] != expected[: len(windows) - 1] or (windows and windows[-1] > expected[len(windows) - 1]):
            return False
    return True


def test_device_drafts_twin_verify_the_device_values(continuations, monkeypatch):
    """Twin: device drafts whose values differ from the script's (each moved by one token) are what the windows
    verify: the windows no longer keep what the script says, while greedy text stays the model's."""
    truth, stop_ids = continuations
    original = DraftBatch.__init__

    def shifted(self, tensor):
        original(self, torch.where(tensor > 0, tensor - 1, tensor + 1))

    monkeypatch.setattr(DraftBatch, "__init__", shifted)
    (tokens, _, _, chunks), scripted, _ = scripted_run("replay", True, truth, stop_ids, monkeypatch)
    assert not windows_follow_script(chunks, scripted)
    assert tokens["a"] == truth[tuple(REQUESTS[0][1])][:12]


@pytest.mark.parametrize("mode", ["compact", "replay"])
def test_simulated_acceptance_with_device_drafts_equals_host_drafts(mode, monkeypatch):
    """Real MTP drafts kept by seeded coins (windows keep 0 .. W - 1 drafts whatever the head guessed): the kept
    drafts come back with the verify's read-back and equal a run whose drafts were read first."""
    runs = []
    for keep_on_device in (True, False):
        engine = _engine(mode, MTP_STEP, SimulatedAcceptance(0.6, seed=3))
        engine.speculator.keep_on_device = keep_on_device
        runs.append((drive(engine, {}, abort=False), engine.stats.accepted_length_counts))
    assert runs[0] == runs[1]
    counts = runs[0][1]
    assert all(c > 0 for c in counts), counts
