"""Multi-round MTP verify/accept through `create_state` for every mode: random per-row widths (incl. zero-width
rows and a HOLD padding row), random accepted counts with all-accept and all-reject rounds, rejected / stale
bytes poisoned with NaN after every round; accepted outputs equal the fp32 oracle over the accepted stream."""

from __future__ import annotations

import pytest
import torch

from unit_tests.linear_att import scenarios as sc

MODES = ["native", "compact", "replay"]


@pytest.mark.parametrize("ratio", [1, 2, 4], ids=lambda r: f"hv_per_h{r}")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("algo", ["gdn", "kda"])
def test_mtp_rounds_match_reference(algo, mode, ratio):
    spec = sc.make_spec(algo, num_k_heads=2 if ratio < 4 else 1, ratio=ratio, head_k_dim=16, head_v_dim=8, num_layers=1)
    params = sc.make_params(spec, seed=ratio)
    streams = sc.make_streams(spec, 3, 200, seed=ratio + 10)
    st = sc.make_state(spec, mode, max_width=4, replay_capacity=8)
    run, _ = sc.run_mtp(st, spec, params, streams, prompt_lens=[9, 1, 4], num_rounds=42, max_width=4, seed=ratio)
    assert sc.max_output_error(spec, params, streams, run) < 1e-5


@pytest.mark.parametrize("max_width", [1, 2], ids=lambda w: f"wmax{w}")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("algo", ["gdn", "kda"])
def test_small_widths(algo, mode, max_width):
    if mode == "compact" and max_width == 1:
        pytest.skip("compact needs speculation (max_width >= 2)")
    spec = sc.make_spec(algo, num_layers=1)
    params = sc.make_params(spec, seed=1)
    streams = sc.make_streams(spec, 2, 100, seed=2)
    st = sc.make_state(spec, mode, max_width=max_width, replay_capacity=4)
    run, _ = sc.run_mtp(st, spec, params, streams, prompt_lens=[3, 6], num_rounds=40, max_width=max_width)
    assert sc.max_output_error(spec, params, streams, run) < 1e-5


@pytest.mark.parametrize("policy", ["all_accept", "all_reject"])
@pytest.mark.parametrize("mode", MODES)
def test_all_accept_and_all_reject_streaks(mode, policy):
    spec = sc.make_spec("kda", num_layers=1, lower_bound=-5.0)
    params = sc.make_params(spec, seed=3)
    streams = sc.make_streams(spec, 2, 200, seed=4)
    st = sc.make_state(spec, mode, max_width=4, replay_capacity=4)
    run, _ = sc.run_mtp(st, spec, params, streams, prompt_lens=[2, 5], num_rounds=40, max_width=4, policy=policy)
    assert sc.max_output_error(spec, params, streams, run) < 1e-5


@pytest.mark.parametrize("state_dtype", [torch.bfloat16], ids=["bf16_state"])
@pytest.mark.parametrize("act_dtype", [torch.float32, torch.float16], ids=["fp32_act", "fp16_act"])
@pytest.mark.parametrize("mode", MODES)
def test_low_precision_stays_close_to_fp32_oracle(mode, act_dtype, state_dtype):
    spec = sc.make_spec("gdn", num_layers=1)
    params = sc.make_params(spec, seed=5)
    streams = sc.make_streams(spec, 2, 200, seed=6)
    st = sc.make_state(spec, mode, max_width=4, replay_capacity=8, state_dtype=state_dtype, act_dtype=act_dtype)
    run, _ = sc.run_mtp(st, spec, params, streams, prompt_lens=[7, 2], num_rounds=40, max_width=4, act_dtype=act_dtype)
    assert sc.max_output_error(spec, params, streams, run) < 2e-2


STRESS = {
    # gates pinned at the lower bound of the safe gate (sigmoid saturates)
    "safe_gate_at_lower_bound": dict(lower_bound=-5.0, gate_shift=40.0),
    # softplus beyond its threshold of 20: very negative log decays
    "very_negative_gates": dict(lower_bound=None, gate_shift=30.0),
    # gates near zero (decay ~ 1)
    "gates_near_zero": dict(lower_bound=None, gate_shift=-30.0),
    # near-zero keys: the l2norm eps dominates
    "near_zero_keys": dict(lower_bound=None, gate_shift=0.0, key_scale=1e-5),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(STRESS))
def test_kda_numerical_stress(case, mode):
    cfg = STRESS[case]
    spec = sc.make_spec("kda", num_layers=1, lower_bound=cfg["lower_bound"])
    params = sc.make_params(spec, seed=7)
    if "key_scale" in cfg:
        key_cols = slice(spec.num_k_heads * spec.head_k_dim, 2 * spec.num_k_heads * spec.head_k_dim)
        params[0].conv_bias[key_cols] = 0.0
    streams = sc.make_streams(spec, 2, 120, seed=8, gate_shift=cfg["gate_shift"], key_scale=cfg.get("key_scale", 1.0))
    st = sc.make_state(spec, mode, max_width=3, replay_capacity=4)
    run, _ = sc.run_mtp(st, spec, params, streams, prompt_lens=[4, 1], num_rounds=30, max_width=3)
    for layer in run.outputs:
        for req in layer:
            assert torch.isfinite(torch.stack(req)).all()
    assert sc.max_output_error(spec, params, streams, run) < 1e-5
