"""Prefill/decode roles in one process with the real ModelRunner on tiny checkpoints, the transfer encoded and
decoded as msgpack like on the wire: a request prefilled on one engine and decoded on another gives a monolithic
engine's greedy tokens and logprobs (1e-5) for every (prefill mode, decode mode) pair of the three state modes,
without drafts, with MTP and with n-gram drafts, on every architecture (also when the prefill node resumes the
prompt from its prefix cache); an all-zero transferred state breaks that equality; the state moved through a
device staging region (CUDA IPC's path, the region on the CPU) gives the same and frees its region; a seeded
request keeps its random stream; a decode node refuses a foreign header, and the prefill node then frees the slot
and fails the request; aborts on either side leave every pool empty."""

from __future__ import annotations

import msgspec
import pytest
import torch

from lightllm.cache.prefix.namespace import salt_namespace
from lightllm.engine.messages import Abort, Finished, NewRequest, TokenChunk
from lightllm.engine.sampling_params import SamplingParams
from lightllm.server.args import load_server_args
from lightllm.server.engine_process import build_engine
from lightllm.server.model_info import read_model_info
from lightllm.server.pd.cuda_ipc import CudaIpcHandle, CudaIpcReads
from lightllm.server.pd.header import runner_header
from lightllm.server.pd.messages import PdPrefill, PdTransfer
from lightllm.server.pd.nixl import NIXL_KIND, NixlEndpoint, NixlHandle, nixl_module_name
from lightllm.server.pd.roles import DecodeRole, PrefillRole
from lightllm.server.pd.staging import RegionReader, StagingBuffer
from lightllm.tools.make_tiny_model import tiny_model_dir
from lightllm.tools.tiny_model.sizes import ARCHS

pytestmark = pytest.mark.usefixtures("one_torch_thread")
REAL_RUNNER = "lightllm.server.runner_factory:create_runner"
MODES = ("native", "replay", "compact")
DRAFTS = {"no drafts": {}, "mtp": {"mtp_step": 2}, "ngram": {"spec_ngram": 2}}
PROMPTS = [[5, 9, 13, 2, 7, 8, 1, 3, 22, 41, 17, 6, 5, 4, 3, 2, 1, 9, 9, 30], [11, 12, 13, 14, 15]]
PARAMS = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)


def _engine(arch: str, mode: str, mtp_step: int = 0, spec_ngram: int = 0):
    args, info = load_server_args(
        [],
        model_dir=str(tiny_model_dir(arch)),
        device="cpu",
        ssm_state_mode=mode,
        mtp_step=mtp_step,
        spec_ngram=spec_ngram,
        max_running_requests=4,
        max_total_token_num=1024,
        chunked_prefill_size=16,
        prefix_cache_checkpoint_interval=8,
        prefix_cache_state_bytes=1 << 20,
    )
    return build_engine(args, info, REAL_RUNNER)


class WireTransport:
    """Delivers by address ("P" / "D") through msgpack, as the zmq transport would; `corrupt` edits transfers."""

    def __init__(self):
        self.queue: list[tuple[str, msgspec.Struct]] = []
        self.corrupt = None

    def send(self, addr: str, msg) -> None:
        msg = msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=type(msg))
        if isinstance(msg, PdTransfer) and self.corrupt is not None:
            self.corrupt(msg)
        self.queue.append((addr, msg))


class Pair:
    def __init__(
        self,
        arch: str,
        p_mode: str,
        d_mode: str,
        mtp_step: int,
        engines=None,
        staging_bytes: int = 0,
        nixl=False,
        reader_kinds=("cuda_ipc@this host",),
        decode_budget=None,
    ):
        self.prefill, self.decode = engines or (_engine(arch, p_mode, mtp_step), _engine(arch, d_mode, mtp_step))
        self.wire = WireTransport()
        fingerprint = runner_header(self.prefill.runner, str(tiny_model_dir(arch))).fingerprint()
        # a staging buffer on the CPU, read by NIXL (two agents of this process), or as CUDA IPC reads it with the
        # "opened" peer buffer being the staging buffer itself
        self.staging = reader = None
        self.reads: list[str] = []
        if staging_bytes:
            buffer = torch.full((staging_bytes,), 0xFF, dtype=torch.uint8)
            if nixl:
                endpoint = NixlEndpoint("prefill")
                self.staging = StagingBuffer(buffer, endpoint.share(buffer), NIXL_KIND, sharer=endpoint)
                reader = RegionReader("cpu", {NixlHandle: NixlEndpoint("decode").read}, [NIXL_KIND])
            else:
                handle = CudaIpcHandle("cpu", b"buffer", staging_bytes, 0, b"", 0, b"", False)
                self.staging = StagingBuffer(buffer, handle, "cuda_ipc@this host")
                reader = RegionReader("cpu", {CudaIpcHandle: CudaIpcReads(open=lambda _: buffer)}, list(reader_kinds))
            self.reads = reader.kinds
        self.p = PrefillRole(self.prefill, self.wire, fingerprint, "P", transfer_timeout_s=30.0, staging=self.staging)
        self.d = DecodeRole(self.decode, self.wire, fingerprint, reader, device_budget_bytes=decode_budget)
        # where each region copy went: True = host memory (past the decode node's device budget)
        self.pulled_to_host: list[bool] = []
        if reader is not None:
            pull = reader.pull

            def recording_pull(region, host=False):
                self.pulled_to_host.append(host)
                return pull(region, host=host)

            reader.pull = recording_pull

    def run(self, prompts, params=PARAMS, between=None, prefix="r", cache_salt=None):
        tokens: dict[str, list[tuple[int, float]]] = {}
        finished: dict[str, Finished] = {}

        def absorb(outputs):
            for out in outputs:
                if isinstance(out, TokenChunk):
                    tokens.setdefault(out.req_id, []).extend(zip(out.token_ids, out.logprobs or [0.0] * 99))
                elif isinstance(out, Finished):
                    assert out.req_id not in finished, f"{out.req_id} finished twice"
                    finished[out.req_id] = out

        for k, prompt in enumerate(prompts):
            request = NewRequest(f"{prefix}{k}", prompt, params, cache_salt=cache_salt)
            absorb(self.p.on_message(PdPrefill(request, "D", self.reads)))
        for _ in range(500):
            if len(finished) == len(prompts):
                break
            if between is not None:
                absorb(between(self))
            if self.p.has_work() and self.prefill.has_work():
                absorb(self.p.after_step(self.prefill.step()))
            while self.wire.queue:
                addr, msg = self.wire.queue.pop(0)
                absorb((self.d if addr == "D" else self.p).on_message(msg))
            absorb(self.d.admit())
            if self.decode.has_work():
                absorb(self.decode.step())
        return tokens, finished

    def assert_pools_empty(self):
        for engine in (self.prefill, self.decode):
            # the last step's publishes and releases run in one more step, which emits nothing
            if engine.has_work():
                assert engine.step() == []
            assert not engine.requests and not engine.has_work()
            assert engine.runner.num_free_requests() == 4
            engine.runner.evict_prefix_cache()
            assert engine.runner.kv.num_free_tokens() == 1024
        assert not self.p.held and not self.d.pending and not self.d._regions
        assert self.d.device_region_bytes == 0 and not self.d._device_region_sizes
        if self.staging is not None:
            assert self.staging.allocator.num_free_bytes() == self.staging.buffer.numel()


def _monolithic(arch, mode, prompts, params=PARAMS, mtp_step=0, spec_ngram=0):
    engine = _engine(arch, mode, mtp_step, spec_ngram)
    tokens: dict[str, list[tuple[int, float]]] = {}
    for k, prompt in enumerate(prompts):
        engine.add_request(NewRequest(f"r{k}", prompt, params))
    while engine.has_work():
        for out in engine.step():
            if isinstance(out, TokenChunk):
                tokens.setdefault(out.req_id, []).extend(zip(out.token_ids, out.logprobs))
    return tokens


def _assert_close(expected, found, case=""):
    assert sorted(expected) == sorted(found), case
    for req_id, pairs in expected.items():
        assert [t for t, _ in found[req_id]] == [t for t, _ in pairs], (case, req_id)
        assert max(abs(a - b) for (_, a), (_, b) in zip(found[req_id], pairs)) < 1e-5, (case, req_id)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_mode_pair_and_draft_method_equals_monolithic(arch):
    """Per draft method: two engines per state mode (a prefill one and a decode one) serve all pairs in turn; the
    prefill engines' prefix caches are warm after their first pair."""
    has_mtp = read_model_info(str(tiny_model_dir(arch))).has_mtp
    for drafts, flags in DRAFTS.items():
        if drafts == "mtp" and not has_mtp:
            continue
        # compact differs from native only under speculation and is refused without it
        modes = [m for m in MODES if flags or m != "compact"]
        expected = _monolithic(arch, "native", PROMPTS, **flags)
        prefill = {m: _engine(arch, m, **flags) for m in modes}
        decode = {m: _engine(arch, m, **flags) for m in modes}
        pairs = [(p, d) for p in modes for d in modes]
        for p_mode, d_mode in pairs:
            pair = Pair(arch, p_mode, d_mode, 0, engines=(prefill[p_mode], decode[d_mode]))
            tokens, finished = pair.run(PROMPTS, prefix="x")
            case = f"{drafts}: {p_mode} -> {d_mode}"
            _assert_close(expected, {f"r{k[1:]}": v for k, v in tokens.items()}, case)
            assert [f.num_output_tokens for f in finished.values()] == [12, 12], case
            pair.assert_pools_empty()


NO_NIXL = pytest.mark.skipif(nixl_module_name() is None, reason="no NIXL package installed (nixl-cu13)")


@pytest.mark.parametrize(
    "staging_bytes, nixl, reader_kinds, decode_budget",
    [
        pytest.param(1 << 20, False, ["cuda_ipc@this host"], None, id="device-region"),
        pytest.param(1 << 20, False, ["cuda_ipc@this host"], 0, id="device-region-waits-in-host-memory"),
        pytest.param(1 << 20, False, ["cuda_ipc@another host"], None, id="reader-elsewhere-goes-host"),
        pytest.param(1024, False, ["cuda_ipc@this host"], None, id="region-full-goes-host"),
        pytest.param(1 << 20, True, [], None, id="nixl", marks=NO_NIXL),
    ],
)
def test_a_transfer_through_a_device_region_equals_monolithic_and_frees_it(
    staging_bytes, nixl, reader_kinds, decode_budget
):
    """`decode_budget` 0: the decode node keeps every waiting region copy in host memory (its device budget for
    them is spent), and imports from there."""
    expected = _monolithic("qwen3_5", "native", PROMPTS, mtp_step=2)
    pair = Pair(
        "qwen3_5",
        "native",
        "compact",
        2,
        staging_bytes=staging_bytes,
        nixl=nixl,
        reader_kinds=reader_kinds,
        decode_budget=decode_budget,
    )
    sent: list[PdTransfer] = []
    pair.wire.corrupt = sent.append
    tokens, _ = pair.run(PROMPTS)
    _assert_close(expected, tokens)
    pair.assert_pools_empty()
    assert len(sent) == 2
    assert pair.pulled_to_host == [decode_budget == 0] * len(pair.pulled_to_host)
    if staging_bytes == 1024 or reader_kinds == ["cuda_ipc@another host"]:
        # nothing fits, or the decode node cannot read this buffer: both went host-staged
        assert all(t.region is None and t.state.ssm.data for t in sent)
        return
    assert len(pair.pulled_to_host) == 2
    # the messages carry shapes and offsets only; the bytes were read out of the region
    for transfer in sent:
        assert transfer.region is not None and transfer.region.nbytes > 0
        blobs = [*transfer.state.kv, transfer.state.conv, transfer.state.ssm, *transfer.state.mtp_kv]
        assert all(b.data == b"" and b.offset is not None for b in [*blobs, transfer.state.mtp_hidden])

    # teeth: the linear state zeroed in the region (after staging, before the decode node reads it)
    def zero_state_in_region(transfer: PdTransfer) -> None:
        for blob in (transfer.state.ssm, transfer.state.conv):
            start = transfer.region.offset + blob.offset
            pair.staging.buffer[start : start + blob.nbytes] = 0

    pair.wire.corrupt = zero_state_in_region
    zeroed, _ = pair.run(PROMPTS, prefix="z")
    zeroed = {f"r{k[1:]}": v for k, v in zeroed.items()}
    assert max(abs(a - b) for k in expected for (_, a), (_, b) in zip(zeroed[k], expected[k])) > 1e-2
    pair.assert_pools_empty()


def test_prefix_cache_resume_and_a_zeroed_state():
    arch, p_mode, d_mode, mtp_step = "qwen3_5", "native", "replay", 2
    expected = _monolithic(arch, p_mode, PROMPTS, mtp_step=mtp_step)
    pair = Pair(arch, p_mode, d_mode, mtp_step)
    tokens, finished = pair.run(PROMPTS)
    _assert_close(expected, tokens)
    assert {f.reason for f in finished.values()} == {"length"}
    assert [finished[f"r{k}"].num_output_tokens for k in range(2)] == [12, 12]
    # again: now the prefill node resumes the long prompt from its prefix cache (shared KV, imported checkpoint)
    again, _ = pair.run(PROMPTS, prefix="h")
    _assert_close(expected, {f"r{k[1:]}": v for k, v in again.items()})
    # both prompts resume just before their last token (their prefill ends, checkpointed by the first run)
    assert pair.prefill.runner.prefix_cache_stats()["num_hit_tokens"] == (20 - 1) + (5 - 1)
    pair.assert_pools_empty()

    # teeth: the same transfer with its linear state zeroed decodes something else
    def zero_state(transfer: PdTransfer) -> None:
        for blob in (transfer.state.ssm, transfer.state.conv):
            blob.data = bytes(len(blob.data))

    pair.wire.corrupt = zero_state
    zeroed, _ = pair.run(PROMPTS, prefix="z")
    zeroed = {f"r{k[1:]}": v for k, v in zeroed.items()}
    assert any([t for t, _ in zeroed[k]] != [t for t, _ in expected[k]] for k in expected)
    assert max(abs(a - b) for k in expected for (_, a), (_, b) in zip(zeroed[k], expected[k])) > 1e-2


def test_a_salted_request_keeps_its_namespace_on_both_nodes():
    """A salted request's prefill node publishes under its salt, and the decode node publishes what it imported
    under it too: another salt resumes nothing on the prefill node, the same salt resumes the prompts' ends; every
    run gives the monolithic tokens."""
    arch, mode = "qwen3_5", "replay"
    expected = _monolithic(arch, mode, PROMPTS)
    pair = Pair(arch, mode, mode, 0)
    salted = salt_namespace("tenant-a")
    _assert_close(expected, pair.run(PROMPTS, cache_salt="tenant-a")[0])
    pair.decode.step()
    trees = [engine.runner.prefix_cache.cache.tree for engine in (pair.prefill, pair.decode)]
    for tree in trees:
        assert tree.nodes() and {tree.namespace(node) for node in tree.nodes()} == {salted}
    other, _ = pair.run(PROMPTS, prefix="b", cache_salt="tenant-b")
    _assert_close(expected, {f"r{k[1:]}": v for k, v in other.items()})
    assert pair.prefill.runner.prefix_cache_stats()["num_hit_tokens"] == 0
    again, _ = pair.run(PROMPTS, prefix="a", cache_salt="tenant-a")
    _assert_close(expected, {f"r{k[1:]}": v for k, v in again.items()})
    assert pair.prefill.runner.prefix_cache_stats()["num_hit_tokens"] == (20 - 1) + (5 - 1)
    pair.assert_pools_empty()


def test_foreign_header_is_refused_and_the_prefill_slot_freed():
    pair = Pair("qwen3_5", "native", "replay", 2)
    pair.d.fingerprint = "0123456789abcdef"
    tokens, finished = pair.run(PROMPTS[:1])
    assert finished["r0"].reason == "error" and "refused the transfer: header" in finished["r0"].error
    assert not tokens
    pair.assert_pools_empty()


def test_aborts_on_either_side_leave_every_pool_empty():
    pair = Pair("qwen3_5", "native", "replay", 2)
    calls = []

    def abort_r0_mid_prefill(p: Pair):
        # r0 (20 tokens, chunks of 16) after its first chunk: the prefill node drops it
        calls.append(1)
        if len(calls) == 2:
            assert p.prefill.requests["r0"].num_computed_tokens == 16
            return p.p.on_message(Abort("r0")) + p.d.on_message(Abort("r0"))
        return []

    # r1's abort reaches the decode node before its transfer (and never the prefill node): the transfer is
    # confirmed, which frees the prefill slot, and dropped
    assert pair.d.on_message(Abort("r1")) == []
    tokens, finished = pair.run(PROMPTS, between=abort_r0_mid_prefill)
    assert finished["r0"].reason == "abort" and finished["r1"].reason == "abort"
    assert "r0" not in tokens and "r1" not in tokens
    pair.assert_pools_empty()
    # an abort while the decode node runs the request
    tokens, finished = pair.run(
        PROMPTS[1:], between=lambda p: p.d.on_message(Abort("s0")) if "s0" in p.decode.requests else [], prefix="s"
    )
    assert finished["s0"].reason == "abort" and 1 <= len(tokens["s0"]) < 12
    pair.assert_pools_empty()


def test_a_seeded_request_samples_on_as_if_it_had_not_moved():
    params = SamplingParams(temperature=1.0, top_k=50, seed=7, max_tokens=12, logprobs=0, ignore_eos=True)
    expected = _monolithic("qwen3_next", "native", PROMPTS, params)
    pair = Pair("qwen3_next", "native", "replay", 0)
    tokens, _ = pair.run(PROMPTS, params)
    _assert_close(expected, tokens)

    # teeth: without the generator's state the decode node restarts the seed's stream and samples other tokens
    def drop_generator(transfer: PdTransfer) -> None:
        transfer.generator_state = None

    pair.wire.corrupt = drop_generator
    fresh, _ = pair.run(PROMPTS, params, prefix="g")
    assert any([t for t, _ in fresh[f"g{k}"]] != [t for t, _ in expected[f"r{k}"]] for k in range(2))


def test_a_constrained_request_keeps_its_grammar_across_the_hand_off(monkeypatch):
    """The decode node's matcher resumes after the prefill node's first token: constrained greedy decoding moved
    between nodes equals one engine's, and every output is valid for the schema."""
    import functools
    import json

    from lightllm.server.http.structured import json_schema_grammar
    from lightllm.server.tokenizer import Tokenizer

    schema = {"type": "object", "properties": {"n": {"enum": [1, 22, 333]}}, "required": ["n"]}
    schema["additionalProperties"] = False
    model_dir = str(tiny_model_dir("qwen3_next"))
    tok = Tokenizer(load_server_args([], model_dir=model_dir, device="cpu")[1])
    eos = list(tok.eos_token_ids)
    monkeypatch.setitem(
        globals(), "NewRequest", functools.partial(NewRequest, eos_token_ids=eos, tokenizer_dir=model_dir)
    )
    params = SamplingParams(temperature=0, max_tokens=24, grammar=json_schema_grammar(schema), logprobs=0)
    expected = _monolithic("qwen3_next", "native", PROMPTS, params)
    pair = Pair("qwen3_next", "native", "replay", 0)
    tokens, finished = pair.run(PROMPTS, params)
    _assert_close(expected, tokens)

    def text(pairs) -> str:
        return tok.decode([t for t, _ in pairs if t not in eos])

    assert all(finished[r].reason == "stop" and json.loads(text(p))["n"] in (1, 22, 333) for r, p in tokens.items())
    pair.assert_pools_empty()

    # teeth: a decode node that drops the grammar decodes freely after the first token
    def drop_grammar(transfer: PdTransfer) -> None:
        transfer.request.params.grammar = None

    pair.wire.corrupt = drop_grammar
    free, _ = pair.run(PROMPTS, params, prefix="g")
    assert any(text(free[f"g{k}"]) != text(expected[f"r{k}"]) for k in range(len(PROMPTS)))

    # a grammar the decode node cannot compile fails those requests there, with the reason; the nodes go on
    def break_grammar(transfer: PdTransfer) -> None:
        transfer.request.params.grammar = '{"grammars": [{"json_schema": {"type": "objectx"}}]}'

    pair.wire.corrupt = break_grammar
    _, failed = pair.run(PROMPTS, params, prefix="b")
    assert all(f.reason == "error" and "grammar" in f.error for f in failed.values()) and len(failed) == len(PROMPTS)
    pair.assert_pools_empty()
