"""Overlapped MTP steps (`engine.spec_overlap`) on the decode node of a prefill/decode hand-off, in one process with
the real ModelRunner on the tiny Qwen3.5 (which has an MTP head), the transfers encoded and decoded as msgpack like
on the wire. The decode engine runs its decode steps through the fixed step buffers (eager on the CPU), so a
request's windows after its import, the transferred drafts first, are launched before the host reads the step
before. Requests arrive at the prefill node at different steps, one waits on the decode node for a state slot, one
stops on a token the host reads while its next window is already in flight. For state-mode pairs whose decode
side is replay, compact or native, with the model's own acceptance and with seeded simulated acceptance over the
real MTP drafts (windows keep 0 .. 2 of them, so the imported MTP head's KV shapes the text), the decode node
emits a monolithic engine's synchronous tokens, finish reasons and acceptance counts, log-probabilities to 1e-5,
and leaves every pool empty. Twins: a transfer with its linear state zeroed, or (simulated acceptance) its MTP
head's KV zeroed, decodes other tokens."""

from __future__ import annotations

import functools

import msgspec
import pytest
import torch

from lightllm.engine.messages import Finished, NewRequest, TokenChunk
from lightllm.engine.sampling_params import SamplingParams
from lightllm.engine.speculative.acceptance import SimulatedAcceptance
from lightllm.server.args import load_server_args
from lightllm.server.engine_process import build_engine
from lightllm.server.pd.header import runner_header
from lightllm.server.pd.messages import PdPrefill, PdTransfer
from lightllm.server.pd.roles import DecodeRole, PrefillRole
from lightllm.tools.make_tiny_model import tiny_model_dir

pytestmark = pytest.mark.usefixtures("one_torch_thread")
REAL_RUNNER = "lightllm.server.runner_factory:create_runner"
MTP_STEP = 2
MAX_TOKENS_IN_KV = 1024
# the decode node holds fewer requests than arrive: the last one waits for a slot a finished request frees
PREFILL_SLOTS, DECODE_SLOTS = 4, 3
# (request id, prompt, max_tokens, arrival step at the prefill node); "d" stops on its STOP_AT + 1st token
REQUESTS = [
    ("a", [5, 9, 13, 2, 7, 8, 1, 3, 22, 41, 17, 6, 5, 4, 3, 2, 1, 9, 9, 30], 11, 0),
    ("b", [11, 12, 13, 14, 15], 16, 0),
    ("c", [3, 1, 4, 1, 5, 9, 2, 6], 9, 2),
    ("d", [7, 7, 8, 21, 40], 30, 4),
]
STOPPED, STOP_AT = "d", 14
# simulated acceptance: each draft kept with this probability, coins seeded per request and window
KEEP_PROBABILITY, SEED = 0.6, 3
MODE_PAIRS = [("native", "replay"), ("replay", "compact"), ("compact", "native")]


def _engine(mode: str, slots: int, acceptance=None, fixed_buffers: bool = False):
    """`fixed_buffers`: decode and draft steps through the buffers CUDA graphs replay (eager on the CPU), which
    overlapped MTP steps need."""
    args, info = load_server_args(
        [],
        model_dir=str(tiny_model_dir("qwen3_5")),
        device="cpu",
        ssm_state_mode=mode,
        mtp_step=MTP_STEP,
        max_running_requests=slots,
        max_total_token_num=MAX_TOKENS_IN_KV,
        chunked_prefill_size=16,
        prefix_cache_checkpoint_interval=8,
        prefix_cache_state_bytes=1 << 20,
        disable_cudagraph=not fixed_buffers,
    )
    engine = build_engine(args, info, REAL_RUNNER, acceptance)
    if fixed_buffers:
        assert engine.runner.init_decode_graphs(use_graphs=False)
        assert engine.runner.spec_step_graphs is not None
    return engine


def _coins(acceptance: str) -> SimulatedAcceptance | None:
    return SimulatedAcceptance(KEEP_PROBABILITY, seed=SEED) if acceptance == "simulated" else None


def _params(rid: str, max_tokens: int, stop_ids: list[int]) -> SamplingParams:
    stops = stop_ids if rid == STOPPED else []
    return SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2, ignore_eos=True, stop_token_ids=stops)


class Outcome:
    """Per request: its tokens, their log-probabilities and its (finish reason, output count)."""

    def __init__(self):
        self.tokens: dict[str, list[int]] = {rid: [] for rid, *_ in REQUESTS}
        self.logprobs: dict[str, list[float]] = {rid: [] for rid, *_ in REQUESTS}
        self.finished: dict[str, tuple[str, int]] = {}

    def absorb(self, outputs) -> None:
        for out in outputs:
            if isinstance(out, TokenChunk):
                self.tokens[out.req_id] += out.token_ids
                self.logprobs[out.req_id] += out.logprobs
            elif isinstance(out, Finished):
                assert out.req_id not in self.finished, f"{out.req_id} finished twice"
                self.finished[out.req_id] = (out.reason, out.num_output_tokens)

    def differences(self, other: Outcome) -> list[str]:
        """What differs from `other` (empty: tokens and finishes equal, log-probabilities within 1e-5)."""
        found = []
        for rid, *_ in REQUESTS:
            if self.tokens[rid] != other.tokens[rid]:
                found.append(f"{rid}: tokens {self.tokens[rid]} != {other.tokens[rid]}")
            elif not torch.allclose(torch.tensor(self.logprobs[rid]), torch.tensor(other.logprobs[rid]), atol=1e-5):
                found.append(f"{rid}: log-probabilities")
            if self.finished.get(rid) != other.finished.get(rid):
                found.append(f"{rid}: finished {self.finished.get(rid)} != {other.finished.get(rid)}")
        return found


def monolithic(mode: str, acceptance: str, stop_ids: list[int]) -> tuple[Outcome, list[int]]:
    """REQUESTS through one engine stepping synchronously (overlap off, no fixed buffers), arriving at the same
    steps; the outcome and its decode windows by accepted tokens."""
    engine = _engine(mode, PREFILL_SLOTS, _coins(acceptance))
    engine.overlap_schedule = False
    outcome, step = Outcome(), 0
    while step <= REQUESTS[-1][3] or engine.has_work():
        for rid, prompt, max_tokens, arrival in REQUESTS:
            if arrival == step:
                assert engine.add_request(NewRequest(rid, prompt, _params(rid, max_tokens, stop_ids))) == []
        outcome.absorb(engine.step())
        step += 1
        assert step < 500, "engine did not drain"
    return outcome, engine.stats.accepted_length_counts


@functools.cache
def reference(mode: str, acceptance: str) -> tuple[list[int], Outcome, list[int]]:
    """STOPPED's stop token (its output token STOP_AT in a run without one), and the monolithic run with it."""
    free, _ = monolithic("native", acceptance, [])
    text = free.tokens[STOPPED]
    assert len(text) > STOP_AT and text[STOP_AT] not in text[:STOP_AT], "pick another STOP_AT"
    stop_ids = [text[STOP_AT]]
    outcome, counts = monolithic(mode, acceptance, stop_ids)
    assert outcome.finished[STOPPED] == ("stop", STOP_AT + 1)
    return stop_ids, outcome, counts


class Wire:
    """Delivers by address ("P" / "D") through msgpack, as the zmq transport would; `corrupt` edits transfers."""

    def __init__(self, corrupt=None):
        self.queue: list[tuple[str, msgspec.Struct]] = []
        self.corrupt = corrupt

    def send(self, addr: str, msg) -> None:
        msg = msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=type(msg))
        if isinstance(msg, PdTransfer) and self.corrupt is not None:
            self.corrupt(msg)
        self.queue.append((addr, msg))


class Trace:
    """What the decode engine's overlapped MTP path did: every launch (chained from a step in flight or not), the
    requests whose first window after the import was launched overlapped, and the rows of requests that had
    finished by the time their step was read back (they rode along, their tokens dropped)."""

    def __init__(self, engine):
        self.launches: list[bool] = []
        self.first_windows: set[str] = set()
        self.rode_along: list[str] = []
        # requests whose transfer waited on the decode node for a state slot
        self.waited: set[str] = set()
        spec = engine.overlap.spec
        launch, complete = spec.launch, spec.complete

        def counted_launch(plan, previous):
            self.launches.append(previous is not None)
            # a request holding only the prefill node's token: this window verifies the transferred drafts
            self.first_windows.update(row.req.req_id for row in plan.decode if len(row.req.output_ids) == 1)
            return launch(plan, previous)

        def reading(inflight):
            self.rode_along += [row.req.req_id for row in inflight.plan.decode if row.req.is_finished]
            return complete(inflight)

        spec.launch, spec.complete = counted_launch, reading


def pd_run(p_mode: str, d_mode: str, acceptance: str, stop_ids: list[int], corrupt=None):
    """REQUESTS through a prefill node and a decode node whose overlapped MTP steps are on; the outcome, the decode
    engine's windows by accepted tokens, and its `Trace`."""
    # simulated acceptance draws a window's coins by request and window index, the prefill's last chunk being a
    # request's first window: one coin source for both nodes draws the monolithic engine's coins
    coins = _coins(acceptance)
    prefill = _engine(p_mode, PREFILL_SLOTS, coins)
    decode = _engine(d_mode, DECODE_SLOTS, coins, fixed_buffers=True)
    # the server's default
    assert decode.overlap_schedule
    wire = Wire(corrupt)
    fingerprint = runner_header(prefill.runner, str(tiny_model_dir("qwen3_5"))).fingerprint()
    p = PrefillRole(prefill, wire, fingerprint, "P", transfer_timeout_s=30.0)
    d = DecodeRole(decode, wire, fingerprint)
    trace = Trace(decode)
    outcome, step = Outcome(), 0
    while len(outcome.finished) < len(REQUESTS):
        for rid, prompt, max_tokens, arrival in REQUESTS:
            if arrival == step:
                msg = PdPrefill(NewRequest(rid, prompt, _params(rid, max_tokens, stop_ids)), "D")
                outcome.absorb(p.on_message(msg))
        if prefill.has_work():
            outcome.absorb(p.after_step(prefill.step()))
        while wire.queue:
            addr, msg = wire.queue.pop(0)
            outcome.absorb((d if addr == "D" else p).on_message(msg))
        outcome.absorb(d.admit())
        trace.waited.update(transfer.request.req_id for transfer in d.pending)
        if decode.has_work():
            outcome.absorb(decode.step())
        step += 1
        assert step < 500, "the pair did not drain"
    assert not p.held and not d.pending
    for engine, slots in ((prefill, PREFILL_SLOTS), (decode, DECODE_SLOTS)):
        # the last step's publishes and releases run in one more step, which emits nothing
        if engine.has_work():
            assert engine.step() == []
        assert not engine.requests and not engine.has_work()
        assert engine.runner.num_free_requests() == slots
        engine.runner.evict_prefix_cache()
        assert engine.runner.kv.num_free_tokens() == MAX_TOKENS_IN_KV
    return outcome, decode.stats.accepted_length_counts, trace


@pytest.mark.parametrize("acceptance", ["model", "simulated"])
@pytest.mark.parametrize("p_mode, d_mode", MODE_PAIRS, ids=[f"{p}-to-{d}" for p, d in MODE_PAIRS])
def test_overlapped_decode_after_a_hand_off_equals_monolithic(p_mode, d_mode, acceptance):
    stop_ids, expected, expected_counts = reference(d_mode, acceptance)
    found, counts, trace = pd_run(p_mode, d_mode, acceptance, stop_ids)
    assert found.differences(expected) == []
    # every decode window of the hand-off's requests, the first ones included, was where the monolithic run had it
    assert counts == expected_counts
    assert found.finished["a"] == ("length", 11) and found.finished[STOPPED] == ("stop", STOP_AT + 1)
    assert trace.waited == {"d"}, trace.waited
    # the overlapped path ran: each request's first window on the decode node (the transferred drafts) was launched
    # overlapped, and steps were chained before their predecessor was read
    assert trace.first_windows == {rid for rid, *_ in REQUESTS}
    assert sum(trace.launches) >= 8, trace.launches
    # the stop token was read while the request's next window was in flight: that window rode along, dropped
    assert STOPPED in trace.rode_along, trace.rode_along
    if acceptance == "simulated":
        # windows kept 0, 1 and 2 of the MTP head's drafts
        assert all(c > 0 for c in counts), counts
    else:
        # a random-weight head's drafts are almost never the model's choice: nearly every window keeps none
        assert counts[0] > 2 * sum(counts[1:]), counts


def _zero(blob) -> None:
    blob.data = bytes(len(blob.data))


def zero_linear_state(transfer: PdTransfer) -> None:
    _zero(transfer.state.ssm)
    _zero(transfer.state.conv)


def zero_mtp_kv(transfer: PdTransfer) -> None:
    for blob in transfer.state.mtp_kv:
        _zero(blob)


@pytest.mark.parametrize(
    "acceptance, corrupt",
    [("model", zero_linear_state), ("simulated", zero_linear_state), ("simulated", zero_mtp_kv)],
    ids=["linear-state", "linear-state-simulated", "mtp-kv-simulated"],
)
def test_twin_a_corrupted_hand_off_decodes_other_tokens(acceptance, corrupt):
    """Twin: the same overlapped decode node fed a transfer whose linear state, or whose MTP head's KV (which only
    kept drafts reveal), lost its values emits tokens the monolithic engine does not."""
    p_mode, d_mode = MODE_PAIRS[0]
    stop_ids, expected, _ = reference(d_mode, acceptance)
    found, _, trace = pd_run(p_mode, d_mode, acceptance, stop_ids, corrupt=corrupt)
    assert sum(trace.launches) >= 4
    assert any(found.tokens[rid] != expected.tokens[rid] for rid, *_ in REQUESTS), found.tokens
    assert found.differences(expected)
