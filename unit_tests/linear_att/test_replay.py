"""Replay mode (`ReplayState`, `ops.replay_verify` / `replay_accept` / `replay_fold`) against the fp32 oracle:
fold cycles for every replay_capacity, fold boundaries in a mixed batch, a teeth test and a long horizon."""

from __future__ import annotations

import pytest
import torch

from lightllm.linear_att import REPLAY_CAPACITIES
from unit_tests.helpers.asserts import relative_error
from unit_tests.linear_att import scenarios as sc


@pytest.mark.parametrize("replay_capacity", REPLAY_CAPACITIES, ids=lambda c: f"L{c}")
@pytest.mark.parametrize("algo", ["gdn", "kda"])
def test_replay_matches_reference_over_three_fold_cycles(algo, replay_capacity):
    spec = sc.make_spec(algo, num_layers=1)
    params = sc.make_params(spec, seed=replay_capacity)
    max_width = 4
    num_rounds = 2 * replay_capacity + 16
    streams = sc.make_streams(spec, 2, 6 + max_width * num_rounds, seed=1)
    st = sc.make_state(spec, "replay", max_width=max_width, replay_capacity=replay_capacity)
    slots = [st.alloc(), st.alloc()]
    run = sc.new_run(spec, 2)
    sc.prefill(st, spec, params, streams, slots, [3, 6], run)
    flips = [0, 0]
    last = [int(st.parity[s]) for s in slots]

    def count_folds(_):
        for i, s in enumerate(slots):
            flips[i] += int(st.parity[s]) != last[i]
            last[i] = int(st.parity[s])

    sc.rounds(
        st,
        spec,
        params,
        streams,
        slots,
        run,
        num_rounds=num_rounds,
        max_width=max_width,
        seed=replay_capacity,
        on_round=count_folds,
    )
    assert min(flips) >= 3, f"only {flips} folds happened"
    assert sc.max_output_error(spec, params, streams, run) < 1e-5


@pytest.mark.parametrize("algo", ["gdn", "kda"])
def test_fold_boundaries_in_a_mixed_batch(algo):
    """L = 8, W = 3: rows with h = 5 (h + W == L, no fold), 6 and 7 (fold) and 8 (full) share one launch."""
    spec = sc.make_spec(algo, num_layers=1)
    params = sc.make_params(spec, seed=3)
    streams = sc.make_streams(spec, 4, 40, seed=4)
    st = sc.make_state(spec, "replay", max_width=3, replay_capacity=8)
    gen = torch.Generator().manual_seed(0)
    slots = [st.alloc() for _ in range(4)]
    run = sc.new_run(spec, 4)
    sc.prefill(st, spec, params, streams, slots, [2, 2, 2, 2], run)
    target = [5, 6, 7, 8]
    for step in range(8):
        widths = [1 if step < t else 0 for t in target]
        sc.verify_round(st, spec, params, streams, slots, widths, widths, run, gen)
        sc.poison_dead(st)
    assert st.cursor[slots].tolist() == target and st.parity[slots].tolist() == [0, 0, 0, 0]
    ssm_before = st.ssm.clone()
    sc.verify_round(st, spec, params, streams, slots, [3, 3, 3, 3], [2, 3, 1, 2], run, gen)
    assert torch.equal(st.ssm[:, slots[0]], ssm_before[:, slots[0]]), "a row below the threshold folded"
    for s in slots[1:]:
        assert not torch.equal(st.ssm[:, s], ssm_before[:, s]), "a row above the threshold did not fold"
    assert st.cursor[slots].tolist() == [7, 3, 1, 2]
    assert st.parity[slots].tolist() == [0, 1, 1, 1]
    sc.poison_dead(st)
    sc.verify_round(st, spec, params, streams, slots, [3, 3, 3, 3], [3, 3, 3, 3], run, gen)
    assert sc.max_output_error(spec, params, streams, run) < 1e-5


def test_teeth_perturbed_history_record_fails_the_comparison():
    spec = sc.make_spec("gdn", num_layers=1)
    params = sc.make_params(spec, seed=5)
    streams = sc.make_streams(spec, 1, 60, seed=6)
    st = sc.make_state(spec, "replay", max_width=2, replay_capacity=16)
    run, slots = sc.run_mtp(st, spec, params, streams, prompt_lens=[4], num_rounds=5, max_width=2, policy="all_accept")
    assert int(st.cursor[slots[0]]) > 2
    assert sc.max_output_error(spec, params, streams, run) < 1e-5
    p = int(st.parity[slots[0]])
    st.hist_u[0, slots[0], p, 1] += 1e-2
    done = run.positions[0]
    sc.rounds(st, spec, params, streams, slots, run, num_rounds=3, max_width=2, policy="all_accept")
    ref = sc.reference_outputs(spec, params, streams, 0, 0, run.positions[0])
    err = relative_error(run.stacked(0, 0)[done:], ref[done:])
    assert err > 1e-4, f"the comparison cannot see a corrupted record (error {err:.1e})"


@pytest.mark.parametrize("algo", ["gdn", "kda"])
def test_long_horizon_error_stays_flat(algo):
    """1000+ decode steps (W = 1, L = 16, a fold every 16 tokens): error vs the fp32 oracle does not grow."""
    spec = sc.make_spec(algo, num_layers=1)
    params = sc.make_params(spec, seed=7)
    num_steps = 1040
    streams = sc.make_streams(spec, 1, num_steps + 2, seed=8)
    st = sc.make_state(spec, "replay", max_width=1, replay_capacity=16)
    run, _ = sc.run_mtp(
        st,
        spec,
        params,
        streams,
        prompt_lens=[1],
        num_rounds=num_steps,
        max_width=1,
        policy="decode",
        poison=False,
        hold_rows=0,
    )
    ref = sc.reference_outputs(spec, params, streams, 0, 0, run.positions[0])
    got = run.stacked(0, 0)
    early = relative_error(got[:200], ref[:200])
    late = relative_error(got[-200:], ref[-200:])
    assert late < 1e-5
    assert late < 20 * max(early, 1e-7), f"error grows: {early:.2e} -> {late:.2e}"


@pytest.mark.parametrize("projection", ["inline", "precompute"])
def test_projection_modes_agree(projection):
    """Both projections of the replay window kernel (the torch twin has one form; the Triton kernels, run by the
    interpreter here, have one per projection) match the fp32 reference over several fold cycles."""
    spec = sc.make_spec("kda", num_layers=1)
    params = sc.make_params(spec, seed=9)
    streams = sc.make_streams(spec, 2, 60, seed=10)
    st = sc.make_state(spec, "replay", max_width=4, replay_capacity=8, projection=projection, backend="triton")
    run, _ = sc.run_mtp(st, spec, params, streams, prompt_lens=[5, 3], num_rounds=10, max_width=4)
    assert sc.max_output_error(spec, params, streams, run) < 1e-5
