"""The state-mode scenario drivers (`unit_tests/linear_att/scenarios.py`) with every operator on the Triton
kernels (interpreter): multi-round verify/accept with padding rows, poisoned dead bytes and replay fold cycles,
against the fp32 oracle; native and compact give bitwise identical outputs through the state classes."""

from __future__ import annotations

import pytest

from unit_tests.linear_att import scenarios as sc


def _run(algo, mode, *, ratio=2, lower_bound=None, replay_capacity=4, num_rounds=10, seed=0):
    spec = sc.make_spec(
        algo, num_k_heads=1, ratio=ratio, head_k_dim=16, head_v_dim=16, num_layers=1, lower_bound=lower_bound
    )
    params = sc.make_params(spec, seed=seed)
    streams = sc.make_streams(spec, 2, 80, seed=seed + 1)
    st = sc.make_state(spec, mode, max_requests=2, max_width=2, replay_capacity=replay_capacity, backend="triton")
    run, _ = sc.run_mtp(st, spec, params, streams, prompt_lens=[3, 5], num_rounds=num_rounds, max_width=2, seed=seed)
    return spec, params, streams, run


@pytest.mark.parametrize(
    ("algo", "mode", "lower_bound"),
    [("gdn", "native", None), ("gdn", "replay", None), ("kda", "replay", -5.0)],
    ids=["gdn-native", "gdn-replay", "kda-safe-replay"],
)
def test_scenario_on_triton_matches_reference(algo, mode, lower_bound):
    spec, params, streams, run = _run(algo, mode, lower_bound=lower_bound, num_rounds=8)
    assert sc.max_output_error(spec, params, streams, run) < 1e-5


def test_compact_equals_native_through_the_state_classes():
    _, _, _, native = _run("gdn", "native", num_rounds=6, seed=3)
    _, _, _, compact = _run("gdn", "compact", num_rounds=6, seed=3)
    for req in range(2):
        assert native.positions[req] == compact.positions[req]
        assert (native.stacked(0, req) == compact.stacked(0, req)).all(), "compact != native (bitwise)"
