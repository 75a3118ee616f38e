"""Lifecycle of every state class: slot ids, validation in `create_state`, exact `bytes_per_request`,
export -> import -> continue, slot reuse with poisoned leftovers, HOLD / zero-width rows untouched."""

from __future__ import annotations

import pytest
import torch

from lightllm.linear_att import StateConfig, StateMode, create_state
from unit_tests.helpers.asserts import poison_
from unit_tests.linear_att import scenarios as sc

MODES = ["native", "compact", "replay"]


def test_alloc_hands_out_lowest_free_slot_and_keeps_hold():
    st = sc.make_state(sc.make_spec(), "native", max_requests=3)
    assert (st.num_slots, st.hold_slot) == (4, 3)
    assert [st.alloc(), st.alloc(), st.alloc()] == [0, 1, 2]
    with pytest.raises(RuntimeError):
        st.alloc()
    st.free(1)
    assert st.num_free_slots() == 1 and st.alloc() == 1


BAD = {
    "capacity_not_allowed": dict(mode="replay", replay_capacity=12),
    "capacity_below_width": dict(mode="replay", replay_capacity=4, max_width=5),
    "bad_projection": dict(mode="replay", projection="eager"),
    "projection_without_replay": dict(mode="native", projection="precompute"),
    "compact_without_speculation": dict(mode="compact", max_width=1),
    "int_state_dtype": dict(mode="native", state_dtype=torch.int32),
}


@pytest.mark.parametrize("case", list(BAD))
def test_create_state_rejects(case):
    kwargs = dict(max_requests=2, max_width=2) | BAD[case]
    kwargs["mode"] = StateMode(kwargs["mode"])
    with pytest.raises(ValueError):
        create_state(sc.make_spec(), StateConfig(**kwargs))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("algo", ["gdn", "kda"])
def test_bytes_per_request_is_exact(algo, mode):
    spec = sc.make_spec(algo, num_k_heads=3, ratio=2, head_k_dim=8, head_v_dim=5, num_layers=3)
    st = sc.make_state(spec, mode, max_width=3, replay_capacity=4, state_dtype=torch.bfloat16, act_dtype=torch.float16)
    NL, H, HV, K, V, GK, W, L = 3, 3, 6, 8, 5, spec.gate_dim, 3, 4
    C = 2 * H * K + HV * V
    expected = NL * C * (3 + W - 1) * 2 + 4
    if mode == "native":
        expected += NL * W * HV * K * V * 2 + 4
    elif mode == "compact":
        expected += NL * HV * K * V * 2 + NL * 2 * W * (H * K + HV * V + HV * GK) * 4 + 4 + 4
    else:
        expected += NL * HV * K * V * 2 + NL * 2 * L * (H * K + HV * V + HV * GK) * 4 + 4 + 4
    assert st.bytes_per_request() == expected


def _run_pair(spec, mode, params, streams, split_rounds, total_rounds):
    """Uninterrupted run vs export at `split_rounds` -> import into another slot of a fresh state -> continue."""
    st = sc.make_state(spec, mode, max_width=4, replay_capacity=8, max_requests=3)
    run_a, slots = sc.run_mtp(st, spec, params, streams, prompt_lens=[6, 3], num_rounds=split_rounds, max_width=4)
    before = {k: t.clone() for k, t in sc.state_tensors(st).items()}
    ckpt = st.export_checkpoint(torch.tensor(slots, dtype=torch.int32))
    for name, t in sc.state_tensors(st).items():
        assert torch.equal(t.nan_to_num(7.0), before[name].nan_to_num(7.0)), f"export changed {name}"
    fresh = sc.make_state(spec, mode, max_width=4, replay_capacity=8, max_requests=3)
    fresh.alloc()  # occupy slot 0 so the request lands elsewhere
    new_slots = [fresh.alloc(), fresh.alloc()]
    for t in sc.state_tensors(fresh).values():
        if t.is_floating_point():
            poison_(t[:, new_slots[0]] if t.dim() > 2 else t)
    fresh.reset(torch.tensor(new_slots, dtype=torch.int32))
    fresh.import_checkpoint(torch.tensor(new_slots, dtype=torch.int32), ckpt)
    run_b = sc.Run(outputs=[[[] for _ in slots] for _ in range(spec.num_layers)], positions=list(run_a.positions))
    rest = total_rounds - split_rounds
    sc.rounds(st, spec, params, streams, slots, run_a, num_rounds=rest, max_width=4, seed=99)
    sc.rounds(fresh, spec, params, streams, new_slots, run_b, num_rounds=rest, max_width=4, seed=99)
    return run_a, run_b


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("algo", ["gdn", "kda"])
def test_export_import_continue_equals_uninterrupted(algo, mode):
    spec = sc.make_spec(algo, num_layers=2)
    params = sc.make_params(spec, seed=1)
    streams = sc.make_streams(spec, 2, 200, seed=2)
    run_a, run_b = _run_pair(spec, mode, params, streams, split_rounds=11, total_rounds=25)
    for layer in range(spec.num_layers):
        for req in range(2):
            tail_a = run_a.stacked(layer, req)[-len(run_b.outputs[layer][req]) :]
            got = run_b.stacked(layer, req)
            if mode == "replay":
                # the export folds pending history: same math, another operation order
                torch.testing.assert_close(got, tail_a, rtol=1e-5, atol=1e-6)
            else:
                assert torch.equal(got, tail_a), f"layer {layer} request {req} diverged after import"
    assert sc.max_output_error(spec, params, streams, run_a) < 1e-5


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("algo", ["gdn", "kda"])
def test_slot_reuse_reads_nothing_from_the_previous_tenant(algo, mode):
    spec = sc.make_spec(algo, num_layers=1)
    params = sc.make_params(spec, seed=3)
    streams = sc.make_streams(spec, 2, 200, seed=4)
    st = sc.make_state(spec, mode, max_width=4, replay_capacity=8, max_requests=2)
    _, slots = sc.run_mtp(st, spec, params, streams, prompt_lens=[5], num_rounds=7, max_width=4, policy="all_accept")
    if mode == "replay":
        assert int(st.cursor[slots[0]]) > 0, "the first tenant should leave history behind"
    st.free(slots[0])
    for t in sc.state_tensors(st).values():
        if t.is_floating_point() and t.dim() > 2:
            poison_(t[:, slots[0]])
    # the second tenant gets the same slot and a different stream
    run, new_slots = sc.run_mtp(
        st, spec, params, sc.make_streams(spec, 1, 200, seed=5), prompt_lens=[3], num_rounds=12, max_width=4
    )
    assert new_slots == slots
    assert sc.max_output_error(spec, params, sc.make_streams(spec, 1, 200, seed=5), run) < 1e-5


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("algo", ["gdn", "kda"])
def test_hold_and_zero_width_rows_write_nothing(algo, mode):
    spec = sc.make_spec(algo, num_layers=2)
    params = sc.make_params(spec, seed=6)
    streams = sc.make_streams(spec, 2, 60, seed=7)
    st = sc.make_state(spec, mode, max_width=3, replay_capacity=4, max_requests=3)
    run, slots = sc.run_mtp(st, spec, params, streams, prompt_lens=[4, 2], num_rounds=3, max_width=3)
    watched = [slots[1], st.hold_slot]
    before = {k: t.clone() for k, t in sc.state_tensors(st).items()}
    gen = torch.Generator().manual_seed(0)
    out = sc.verify_round(st, spec, params, streams, slots, [3, 0], [2, 0], run, gen, hold_rows=2)
    assert torch.all(out[1:] == 0), "padding rows must output zeros"
    for name, t in sc.state_tensors(st).items():
        slot_dim = 0 if t.dim() == 1 else 1
        for s in watched:
            a, b = t.select(slot_dim, s), before[name].select(slot_dim, s)
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), f"{name} of slot {s} was written"
