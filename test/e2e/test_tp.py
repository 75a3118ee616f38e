"""Tensor parallelism on CPU (gloo, real follower processes): a `--tp 2` engine's greedy tokens equal a `--tp 1`
engine's for every architecture × state mode × speculation, with chunked prefill, batching and prefix-cache
resumes; `--tp 4` where the tiny heads divide; checkpoints leave a TP-2 engine laid out by global head.

One 2-rank group serves every engine of the module: each engine builds its runners on the same processes."""

from __future__ import annotations

import re

import msgspec
import pytest
import torch

from lightllm.engine.batch import ForwardBatch
from lightllm.engine.messages import Finished, NewRequest, TokenChunk
from lightllm.engine.sampling_params import SamplingParams
from lightllm.linear_att.base import Checkpoint
from lightllm.models.tp import TPInfo
from lightllm.server.args import load_server_args
from lightllm.server.engine_process import engine_for_runner
from lightllm.server.pd.header import runner_header
from lightllm.server.pd.messages import PdPrefill
from lightllm.server.pd.roles import DecodeRole, PrefillRole
from lightllm.server.runner_factory import build_rank_runner, create_tp_runner
from lightllm.tools.make_tiny_model import tiny_model_dir
from lightllm.worker.tp.group import Plan, TPGroup
from lightllm.worker.tp.layout import merge_checkpoints, split_checkpoint
from lightllm.worker.tp.lockstep import GLOBAL_LAYOUT, LOCAL, LOCKSTEP, SHUT_DOWN, START_UP, LockstepRunner

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NUM_TOKENS = 8
# the third prompt extends the second: it resumes from the prefix cache the second one filled
FIRST = ([5, 6, 7, 8, 9], list(range(30, 53)))
SECOND = (list(range(30, 53)) + [7, 7, 9, 11, 13, 15, 17, 19, 21],)
COMBOS = [
    ("native", {}),
    ("native", {"spec_ngram": 2}),
    ("native", {"mtp_step": 2}),
    ("compact", {"spec_ngram": 2}),
    ("compact", {"mtp_step": 2}),
    ("replay", {}),
    ("replay", {"spec_ngram": 2}),
    ("replay", {"mtp_step": 3}),
]
ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "kimi_linear")


def _combo_id(combo) -> str:
    mode, spec = combo
    return "-".join([mode, *(f"{k}{v}" for k, v in spec.items())]) if spec else f"{mode}-nospec"


def _cases():
    for arch in ARCHS:
        for combo in COMBOS:
            # the tiny Kimi checkpoint has no MTP head
            if arch == "kimi_linear" and "mtp_step" in combo[1]:
                continue
            yield pytest.param(arch, combo, id=f"{arch}-{_combo_id(combo)}")


@pytest.fixture(scope="module")
def tp_groups():
    """`get(size)`: the module's group of that size; one process group at a time, so another size replaces it."""
    current: list[TPGroup] = []

    def get(size: int) -> TPGroup:
        if current and current[0].size != size:
            current.pop().shutdown()
        if not current:
            # a follower that dies fails the test through its next collective instead of ending the test process
            current.append(TPGroup(size, "cpu", num_threads=1, on_rank_exit=lambda rank, code: None))
        return current[0]

    yield get
    if current:
        current[0].shutdown()


@pytest.fixture
def tp2(tp_groups):
    return tp_groups(2)


@pytest.fixture
def tp4(tp_groups):
    return tp_groups(4)


def _args(model_dir: str, mode: str, spec: dict, tp: int):
    args, info = load_server_args(
        [],
        model_dir=model_dir,
        device="cpu",
        tp=tp,
        ssm_state_mode=mode,
        max_running_requests=4,
        chunked_prefill_size=8,
        max_total_token_num=512,
        prefix_cache_state_bytes=1 << 20,
        prefix_cache_checkpoint_interval=8,
        **spec,
    )
    return args, info


def _run(engine, prompts, tag: str, cache_salt: str | None = None) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts):
        assert engine.add_request(NewRequest(f"{tag}{i}", p, params, cache_salt=cache_salt)) == []
    out = {f"{tag}{i}": [] for i in range(len(prompts))}
    while engine.has_work():
        for o in engine.step():
            if isinstance(o, TokenChunk):
                out[o.req_id] += o.token_ids
            else:
                assert getattr(o, "reason", "length") == "length", o
    return [out[f"{tag}{i}"] for i in range(len(prompts))]


def _generate(engine) -> list[list[int]]:
    tokens = _run(engine, FIRST, "a") + _run(engine, SECOND, "b")
    stats = engine.runner.prefix_cache_stats()
    assert stats is not None and stats["num_hit_tokens"] > 0, f"the second round did not resume from the cache: {stats}"
    return tokens


def _single(model_dir: str, mode: str, spec: dict) -> list[list[int]]:
    args, info = _args(model_dir, mode, spec, 1)
    return _generate(engine_for_runner(args, build_rank_runner(args, info)))


def _sharded(group: TPGroup, model_dir: str, mode: str, spec: dict) -> list[list[int]]:
    args, info = _args(model_dir, mode, spec, group.size)
    runner = create_tp_runner(args, info, group)
    try:
        return _generate(engine_for_runner(args, runner))
    finally:
        runner.close()


@pytest.mark.parametrize("arch, combo", list(_cases()))
def test_tp2_greedy_equals_tp1(tp2, arch, combo):
    model_dir = str(tiny_model_dir(arch))
    mode, spec = combo
    expected = _single(model_dir, mode, spec)
    assert _sharded(tp2, model_dir, mode, spec) == expected


def _salted(engine) -> list[list[int]]:
    """FIRST under one salt, SECOND under another (which resumes nothing), then SECOND under the first salt (which
    resumes what FIRST cached)."""
    tokens = _run(engine, FIRST, "a", "tenant-a") + _run(engine, SECOND, "b", "tenant-b")
    assert engine.runner.prefix_cache_stats()["num_hit_tokens"] == 0
    tokens += _run(engine, SECOND, "c", "tenant-a")
    assert engine.runner.prefix_cache_stats()["num_hit_tokens"] > 0
    return tokens


def test_tp2_cache_salts_keep_every_ranks_cache_in_step(tp2):
    """Every rank resumes from its own tree in the request's namespace: a run that misses one salt's cache and hits
    another's gives TP1's tokens."""
    model_dir = str(tiny_model_dir("qwen3_5"))
    args, info = _args(model_dir, "replay", {"spec_ngram": 2}, 1)
    expected = _salted(engine_for_runner(args, build_rank_runner(args, info)))
    args, info = _args(model_dir, "replay", {"spec_ngram": 2}, 2)
    runner = create_tp_runner(args, info, tp2)
    try:
        assert _salted(engine_for_runner(args, runner)) == expected
    finally:
        runner.close()


def test_tp2_with_a_wrong_shard_differs(tp2):
    """Teeth: the follower loads another seed's weights (same shapes) while rank 0 loads the served ones."""
    model_dir, other = str(tiny_model_dir("qwen3_5")), str(tiny_model_dir("qwen3_5", seed=1))
    expected = _single(model_dir, "native", {})
    args, info = _args(model_dir, "native", {}, 2)
    tp2.send(Plan("build", (_args(other, "native", {}, 2)[0], info)))
    runner = LockstepRunner(build_rank_runner(args, info, 0, 2), tp2)
    try:
        assert _generate(engine_for_runner(args, runner)) != expected
    finally:
        runner.close()


def _prefill(runner, prompt: list[int]) -> int:
    handle = runner.add_request()
    batch = ForwardBatch([handle], [len(prompt)], [0], 1, torch.tensor(prompt, dtype=torch.int64))
    runner.forward(batch)
    return handle


def _swap_ranks(ckpt: Checkpoint, local, size: int) -> Checkpoint:
    parts = [split_checkpoint(ckpt, local, TPInfo(r, size)) for r in range(size)]
    return merge_checkpoints(parts[::-1], local)


@pytest.mark.parametrize("arch", ["qwen3_next", "kimi_linear"])
def test_checkpoints_leave_and_enter_by_global_head(tp2, arch):
    """A TP-2 runner's exported checkpoint equals the TP-1 runner's after the same prompt (every head in global
    order); importing it into another slot and exporting again gives it back."""
    model_dir = str(tiny_model_dir(arch))
    prompt = list(range(40, 61))
    args, info = _args(model_dir, "replay", {"spec_ngram": 2}, 1)
    single = build_rank_runner(args, info)
    expected = single.export_checkpoint([_prefill(single, prompt)])
    args, info = _args(model_dir, "replay", {"spec_ngram": 2}, 2)
    runner = create_tp_runner(args, info, tp2)
    try:
        got = runner.export_checkpoint([_prefill(runner, prompt)])
        assert got.conv.shape == expected.conv.shape and got.ssm.shape == expected.ssm.shape
        torch.testing.assert_close(got.conv, expected.conv, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.ssm, expected.ssm, rtol=1e-4, atol=1e-5)
        # teeth: the same tensors with the ranks' heads in the wrong order are far off
        swapped = _swap_ranks(got, runner.linear_spec, 2)
        assert not torch.allclose(swapped.ssm, expected.ssm, rtol=1e-2, atol=1e-3)
        assert not torch.allclose(swapped.conv, expected.conv, rtol=1e-2, atol=1e-3)
        other = runner.add_request()
        runner.import_checkpoint([other], expected)
        again = runner.export_checkpoint([other])
        assert torch.equal(again.conv, expected.conv) and torch.equal(again.ssm, expected.ssm)
    finally:
        runner.close()


def test_every_runner_method_is_placed():
    """A new ModelRunner method (its own or a mixin's) must say whether it changes state on every rank or is a
    rank-0 read."""
    from lightllm.worker.runner import ModelRunner

    public = {
        n
        for cls in ModelRunner.__mro__
        if cls.__module__.startswith("lightllm.")
        for n, v in vars(cls).items()
        if callable(v) and not n.startswith("_")
    }
    assert {"verify_on_device", "settle", "forward"} <= public
    placed = LOCKSTEP | GLOBAL_LAYOUT | LOCAL | START_UP | SHUT_DOWN
    assert public - placed == set(), f"unplaced runner methods: {sorted(public - placed)}"


@pytest.mark.parametrize(
    "arch, tp, named",
    [("qwen3_5", 4, "linear-attention key heads = 2"), ("kimi_linear", 3, "attention heads (num_attention_heads) = 4")],
)
def test_non_dividing_heads_refused_at_start_up(arch, tp, named):
    with pytest.raises(ValueError, match=rf"--tp {tp} does not split this model evenly: .*{re.escape(named)}"):
        load_server_args([], model_dir=str(tiny_model_dir(arch)), device="cpu", tp=tp)
    # twin: the same checkpoint at a dividing size starts
    assert load_server_args([], model_dir=str(tiny_model_dir(arch)), device="cpu", tp=2)[0].tp == 2


# 4 linear key heads (8 value heads) split over 4 ranks; the 2 attention KV heads are each replicated on 2 ranks
QWEN_TP4_SIZES = {"linear_num_key_heads": 4, "linear_num_value_heads": 8}


@pytest.mark.parametrize(
    "arch, sizes, combo",
    [
        ("qwen3_5", QWEN_TP4_SIZES, ("compact", {"mtp_step": 2})),
        ("kimi_linear", {}, ("replay", {"spec_ngram": 2})),
    ],
    ids=["qwen3_5-compact-mtp2", "kimi_linear-replay-ngram2"],
)
def test_tp4_greedy_equals_tp1(tp4, arch, sizes, combo):
    model_dir = str(tiny_model_dir(arch, **sizes))
    mode, spec = combo
    assert _sharded(tp4, model_dir, mode, spec) == _single(model_dir, mode, spec)


class _Wire:
    """Delivers role messages by address ("P" / "D") through msgpack, as the zmq transport would."""

    def __init__(self):
        self.queue = []

    def send(self, addr: str, msg) -> None:
        self.queue.append((addr, msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=type(msg))))


def _disaggregated(prefill, decode, model_dir: str, prompts) -> list[list[int]]:
    """Prefill on one engine, decode on the other (roles as on the nodes), greedy tokens per prompt."""
    wire = _Wire()
    fingerprint = runner_header(prefill.runner, model_dir).fingerprint()
    assert fingerprint == runner_header(decode.runner, model_dir).fingerprint()
    p = PrefillRole(prefill, wire, fingerprint, "P", 30.0)
    d = DecodeRole(decode, wire, fingerprint)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    out = {f"pd{i}": [] for i in range(len(prompts))}
    finished = set()

    def absorb(outputs):
        for o in outputs:
            if isinstance(o, TokenChunk):
                out[o.req_id] += o.token_ids
            elif isinstance(o, Finished):
                assert o.reason == "length", o
                finished.add(o.req_id)

    for i, prompt in enumerate(prompts):
        absorb(p.on_message(PdPrefill(NewRequest(f"pd{i}", prompt, params), "D")))
    for _ in range(500):
        if len(finished) == len(prompts):
            break
        if p.has_work() and prefill.has_work():
            absorb(p.after_step(prefill.step()))
        while wire.queue:
            addr, msg = wire.queue.pop(0)
            absorb((d if addr == "D" else p).on_message(msg))
        absorb(d.admit())
        if decode.has_work():
            absorb(decode.step())
    for engine in (prefill, decode):  # the last step's publishes and releases run in one more step
        if engine.has_work():
            assert engine.step() == []
    assert not p.held and prefill.runner.num_free_requests() == decode.runner.num_free_requests() == 4
    return [out[f"pd{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize(
    "arch, mode, spec",
    [("qwen3_5", "replay", {"mtp_step": 2}), ("kimi_linear", "compact", {"spec_ngram": 2})],
    ids=["qwen3_5-replay-mtp2", "kimi_linear-compact-ngram2"],
)
def test_pd_between_tp_sizes_equals_monolithic(tp2, arch, mode, spec):
    """A TP-2 prefill node feeds a TP-1 decode node and a TP-1 prefill node a TP-2 decode node (the request
    state moves laid out by global head): both give the monolithic TP-1 engine's greedy tokens."""
    model_dir = str(tiny_model_dir(arch))
    expected = _run(engine_for_runner(*_tp1_engine_args(model_dir, mode, spec)), FIRST, "pd")
    args, info = _args(model_dir, mode, spec, 2)
    sharded = engine_for_runner(args, create_tp_runner(args, info, tp2))
    try:
        single = engine_for_runner(*_tp1_engine_args(model_dir, mode, spec))
        assert _disaggregated(sharded, single, model_dir, FIRST) == expected
        assert _disaggregated(single, sharded, model_dir, FIRST) == expected
    finally:
        sharded.runner.close()


def _tp1_engine_args(model_dir: str, mode: str, spec: dict):
    args, info = _args(model_dir, mode, spec, 1)
    return args, build_rank_runner(args, info)


def test_pd_with_heads_out_of_order_differs(tp2, monkeypatch):
    """Teeth: a TP-2 prefill node that merged its ranks' heads in the wrong order misleads the TP-1 decode node."""
    from lightllm.worker.tp import lockstep as tp_runner

    merge = tp_runner.merge_request_states
    monkeypatch.setattr(tp_runner, "merge_request_states", lambda parts, runner: merge(parts[::-1], runner))
    model_dir = str(tiny_model_dir("qwen3_5"))
    expected = _run(engine_for_runner(*_tp1_engine_args(model_dir, "native", {})), FIRST, "pd")
    args, info = _args(model_dir, "native", {}, 2)
    sharded = engine_for_runner(args, create_tp_runner(args, info, tp2))
    try:
        single = engine_for_runner(*_tp1_engine_args(model_dir, "native", {}))
        assert _disaggregated(sharded, single, model_dir, FIRST) != expected
    finally:
        sharded.runner.close()


def test_plan_tensors_broadcast_on_the_model_group(tp2, monkeypatch):
    """The path of CUDA tensors in a plan (the overlap schedule's in-flight tokens), taken by every tensor here:
    they follow the plan as broadcasts on the model's group and the followers still match TP-1 (plain decode: the
    engine's overlapped steps pass their tokens as `decode_input_ids`)."""
    from lightllm.worker.tp import lockstep as tp_runner

    sent = []
    monkeypatch.setattr(tp_runner, "stays_on_device", lambda t: sent.append(t.shape) is None)
    model_dir = str(tiny_model_dir("qwen3_5"))
    assert _sharded(tp2, model_dir, "native", {}) == _single(model_dir, "native", {})
    assert len(sent) > 10
