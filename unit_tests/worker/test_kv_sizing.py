"""KV-cache sizing: the arithmetic of `lightllm.worker.kv_sizing` and the runner sizing its KV cache after weights and
state are loaded (one load), with a fake memory probe standing in for the device; request slots lowered where their
linear state does not fit beside the weights, never a failed start while one fits."""

from __future__ import annotations

import pytest

from lightllm.server.args import load_server_args
from lightllm.server.runner_factory import create_runner
from lightllm.worker.config import RunnerConfig
from lightllm.worker.kv_sizing import (
    ACTIVATION_RESERVE_BYTES,
    CPU_MAX_KV_TOKENS,
    STATE_SHARE,
    DeviceMemory,
    cpu_kv_tokens,
    fitted_request_slots,
    kv_tokens_for_memory,
)
from lightllm.worker.runner import ModelRunner
from unit_tests.models.conftest import case_dir
from unit_tests.models.drive import make_runner

GIB = 1 << 30


def test_cpu_rule_is_every_slot_at_full_length_capped():
    assert cpu_kv_tokens(4, 512) == 2048
    assert cpu_kv_tokens(16, 4096) == CPU_MAX_KV_TOKENS == 65536
    assert cpu_kv_tokens(16, 8192) == 65536


def _rule(free: int, total: int, own: int, **kw) -> int:
    return kv_tokens_for_memory(DeviceMemory(free, total, own), **kw)


def test_memory_rule_counts_own_reserve_and_fixed_bytes_and_floors():
    # 8 GiB x 0.75 = 6 GiB; 2 GiB held by this process, 1 GiB reserve, 1000 fixed bytes -> 3 GiB - 1000 bytes
    # for 1024-byte tokens
    tokens = _rule(
        6 * GIB, 8 * GIB, 2 * GIB, mem_fraction=0.75, bytes_per_token=1024, fixed_bytes=1000, max_req_total_len=4096
    )
    assert tokens == 3 * 1024 * 1024 - 1  # (3 GiB - 1000) // 1024
    assert ACTIVATION_RESERVE_BYTES == GIB
    # a custom reserve
    tokens = _rule(
        6 * GIB,
        8 * GIB,
        2 * GIB,
        mem_fraction=0.75,
        bytes_per_token=1024,
        fixed_bytes=0,
        max_req_total_len=1,
        reserve_bytes=0,
    )
    assert tokens == 4 * 1024 * 1024


def test_memory_share_is_per_process_but_never_more_than_is_free():
    """Two servers on one device at 0.4 each: the second's share does not shrink by what the first holds, as long
    as that much is free; once other processes leave less free than the share, free memory is the limit."""
    rule = dict(mem_fraction=0.4, bytes_per_token=GIB // 1024, fixed_bytes=0, max_req_total_len=1, reserve_bytes=0)
    alone = _rule(9 * GIB, 10 * GIB, GIB, **rule)
    beside_another = _rule(5 * GIB, 10 * GIB, GIB, **rule)  # another server holds 4 GiB
    assert alone == beside_another == 3 * 1024  # 4 GiB share - 1 GiB own
    assert _rule(2 * GIB, 10 * GIB, GIB, **rule) == 2 * 1024  # 2 GiB free < 3 GiB left of the share
    with pytest.raises(ValueError, match=r"0.0 GiB free on the device \(9.0 GiB held by other processes\)"):
        _rule(0, 10 * GIB, GIB, **rule)


def test_memory_rule_accepts_exactly_one_max_length_request():
    total, per_token, max_len = 4 * GIB, 512, 32768
    own = total // 2 - GIB - per_token * max_len  # at 0.5 with the 1 GiB reserve: room for exactly max_len tokens
    rule = dict(mem_fraction=0.5, bytes_per_token=per_token, fixed_bytes=0, max_req_total_len=max_len)
    assert _rule(total - own, total, own, **rule) == max_len
    with pytest.raises(ValueError) as err:
        _rule(total - own - 1, total, own + 1, **rule)
    msg = str(err.value)
    assert "room for 32767 KV tokens, fewer than one 32768-token request" in msg
    for flag in ("--mem_fraction 0.5", "--max_req_total_len", "--max_running_requests"):
        assert flag in msg


def test_memory_rule_refuses_when_already_over_budget():
    with pytest.raises(ValueError, match="room for 0 KV tokens"):
        _rule(
            7 * GIB,
            8 * GIB,
            7 * GIB + GIB // 2,
            mem_fraction=0.9,
            bytes_per_token=256,
            fixed_bytes=0,
            max_req_total_len=1,
        )


class FakeProbe:
    """Device memory as a probe would report it, this process holding `total - free`; counts calls."""

    def __init__(self, free: int, total: int):
        self.free, self.total, self.calls = free, total, 0

    def __call__(self) -> DeviceMemory:
        self.calls += 1
        return DeviceMemory(self.free, self.total, self.total - self.free)


def _auto_config(mtp_step: int = 0, **flags) -> RunnerConfig:
    """Tiny qwen3_next on CPU in fp32, KV size left to the runner (4 requests of up to 512 tokens); the prefix
    cache is off unless `flags` turn it on (its pool has its own tests below)."""
    flags.setdefault("disable_prefix_cache", True)
    return RunnerConfig(
        model_dir=case_dir("qwen3_next-hv2"),
        device="cpu",
        data_type="float32",
        mtp_step=mtp_step,
        max_running_requests=4,
        max_total_token_num=None,
        max_req_total_len=512,
        mem_fraction=0.5,
        **flags,
    )


def _kv_bytes(kv) -> int:
    return sum(b.numel() * b.element_size() for b in kv.buffers) + kv.req_to_slot.numel() * 8


@pytest.mark.parametrize(
    "mtp_step, per_token, fixed, mtp_capacity",
    [
        # 1 full layer of (2 x 16) K + V fp32 = 256 bytes; hold slot 256 + slot table 4 x 512 x 8
        (0, 256, 256 + 4 * 512 * 8, None),
        # plus the MTP layer: 256 per token, hold slot + 4 x 2 extra slots; both slot tables 2 verify windows
        # (2 x 2 columns) longer, room for the steps in flight past a request's limit, the head's 2 more
        (1, 512, 256 + 256 * 9 + 4 * 516 * 8 + 4 * 518 * 8, 1008),
    ],
)
def test_runner_sizes_kv_from_what_is_left_after_weights_and_state(mtp_step, per_token, fixed, mtp_capacity):
    total = 4 * GIB
    # at mem_fraction 0.5 with the 1 GiB reserve, 1 GiB is left for what is in use + fixed + KV: 1000 tokens and
    # 100 bytes to spare
    used = GIB - fixed - 1000 * per_token - 100
    probe = FakeProbe(total - used, total)
    runner = ModelRunner(_auto_config(mtp_step), memory_probe=probe)
    # once to fit the request slots before the state is allocated, once to size the KV cache after it
    assert probe.calls == 2
    assert runner.kv_tokens == runner.kv.capacity == 1000
    assert runner.kv_bytes_per_token() == per_token
    allocated = _kv_bytes(runner.kv)
    if mtp_capacity is not None:
        assert runner.drafter.kv.capacity == mtp_capacity
        allocated += _kv_bytes(runner.drafter.kv)
    # the sizing accounts for every KV byte the runner then allocates
    assert allocated == 1000 * per_token + fixed


@pytest.mark.parametrize("flags", [{"prefix_cache_state_fraction": 0.25}, {"prefix_cache_state_bytes": 70_000}])
def test_checkpoint_pool_comes_out_of_the_same_budget(flags):
    """The checkpoint pool is carved from the mem_fraction budget: a fraction of every KV token's bytes, or a fixed
    number of bytes; KV + pool + fixed bytes then fill exactly what the budget left."""
    per_token, fixed = 256, 256 + 4 * 512 * 8
    pool_budget = 64_000 if "prefix_cache_state_fraction" in flags else 70_000
    # 1000 tokens (+ their share of the pool, or the fixed pool) and 100 bytes to spare
    used = GIB - fixed - 1000 * per_token - pool_budget - 100
    runner = ModelRunner(
        _auto_config(disable_prefix_cache=False, **flags), memory_probe=FakeProbe(4 * GIB - used, 4 * GIB)
    )
    assert runner.kv_tokens == 1000
    pool = runner.prefix_cache.pool
    # 3 linear layers of conv window (128 channels x 3) + SSM (4 heads x 16 x 16), fp32
    assert pool.bytes_per_checkpoint == 3 * (128 * 3 + 4 * 16 * 16) * 4
    assert pool.num_slots == pool_budget // pool.bytes_per_checkpoint
    assert _kv_bytes(runner.kv) + pool.num_bytes <= 1000 * per_token + fixed + pool_budget


def test_runner_refuses_when_one_request_does_not_fit():
    # room for 500 tokens beside the fixed bytes of one request slot (4 do not fit beside one request's KV, so the
    # runner first lowers its slots to one): 1 GiB - fixed - 500 x 256 in use
    probe = FakeProbe(4 * GIB - (GIB - (256 + 1 * 512 * 8) - 500 * 256), 4 * GIB)
    with pytest.raises(ValueError, match=r"room for 500 KV tokens, fewer than one 512-token request: raise --mem"):
        ModelRunner(_auto_config(), memory_probe=probe)


def test_runner_on_cpu_without_probe_keeps_the_cpu_rule():
    runner = make_runner(case_dir("qwen3_next-hv2"), max_total_token_num=None, max_running_requests=4)
    assert runner.kv.capacity == 4 * 512


def test_runner_honours_an_explicit_kv_size_without_probing():
    probe = FakeProbe(0, 0)
    cfg = RunnerConfig(model_dir=case_dir("qwen3_next-hv2"), device="cpu", max_total_token_num=300)
    assert ModelRunner(cfg, memory_probe=probe).kv.capacity == 300
    assert probe.calls == 0


def test_create_runner_leaves_auto_kv_size_to_the_runner():
    args, info = load_server_args(
        [], model_dir=case_dir("qwen3_next-hv2"), device="cpu", max_running_requests=3, max_req_total_len=256
    )
    assert args.max_total_token_num is None
    runner = create_runner(args, info)
    assert runner.kv.capacity == 3 * 256


def _slots(room: int, requested: int, state: int, per_token: int = 100, max_len: int = 10) -> int:
    """`fitted_request_slots` with `room` bytes left beside the reserve and one request's KV."""
    total = 8 * GIB
    own = total // 2 - ACTIVATION_RESERVE_BYTES - per_token * max_len - room
    memory = DeviceMemory(total - own, total, own)
    return fitted_request_slots(
        memory,
        requested=requested,
        mem_fraction=0.5,
        state_bytes_per_request=state,
        kv_bytes_per_token=per_token,
        max_req_total_len=max_len,
    )


def test_request_slots_are_kept_where_their_state_fits_and_lowered_where_not():
    state = 3_000_000
    assert _slots(256 * state, 256, state) == 256
    # one byte short: the state may then take STATE_SHARE of the room, the KV cache the rest
    assert _slots(256 * state - 1, 256, state) == int((256 * state - 1) * STATE_SHARE) // state == 204
    assert _slots(10 * state, 256, state) == 8
    # no room for one request's KV, or for one slot's state beside it: one slot (or what was asked), and the KV
    # sizing after the state refuses the start, naming the flags (test_runner_refuses_when_one_request_does_not_fit)
    assert _slots(-1, 256, state) == 256
    assert _slots(state, 4, state) == 1


def test_runner_lowers_the_slots_its_state_cannot_hold_and_the_engine_follows(caplog):
    """4 requested, room for the state of 3 at STATE_SHARE: the runner holds 3 slots (state allocated for 3), warns
    naming the flag, sizes its KV from what is left, and the engine built on it admits at most 3; the twin with room
    for all 4 keeps 4."""
    from lightllm.server.engine_process import engine_for_runner

    state = ModelRunner(_auto_config(), memory_probe=FakeProbe(4 * GIB - (1 << 20), 4 * GIB)).bytes_per_request()
    total, per_token, max_len = 4 * GIB, 256, 512

    def probe_with_room(room: int) -> FakeProbe:
        own = total // 2 - ACTIVATION_RESERVE_BYTES - per_token * max_len - room
        return FakeProbe(total - own, total)

    room = int(3.9 * state)  # 4 do not fit; STATE_SHARE of it holds 3.12
    with caplog.at_level("WARNING", logger="lightllm.worker.runner"):
        runner = ModelRunner(_auto_config(), memory_probe=probe_with_room(room))
    assert runner.num_free_requests() == runner.config.max_running_requests == 3
    assert runner.state.num_free_slots() == 3 and runner.kv.num_free_rows() == 3
    assert "--max_running_requests 4" in caplog.text and "at most 3 requests" in caplog.text
    assert runner.kv_tokens >= max_len
    flags = dict(model_dir=case_dir("qwen3_next-hv2"), device="cpu", max_running_requests=4, max_req_total_len=512)
    args, _ = load_server_args([], **flags)
    assert engine_for_runner(args, runner).scheduler.max_running_requests == 3
    # the twin: room for all four
    caplog.clear()
    runner = ModelRunner(_auto_config(), memory_probe=probe_with_room(4 * state))
    assert runner.num_free_requests() == 4 and "at most" not in caplog.text
