"""Compact mode (`CompactState`, `ops.compact_verify` / `ops.compact_commit`) equals native mode bitwise."""

from __future__ import annotations

import pytest
import torch

from unit_tests.linear_att import scenarios as sc


@pytest.mark.parametrize("backend", sc.BACKENDS)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32_state", "bf16_state"])
@pytest.mark.parametrize("act_dtype", [torch.float32, torch.float16], ids=["fp32_act", "fp16_act"])
@pytest.mark.parametrize("algo", ["gdn", "kda"])
def test_compact_equals_native_bitwise(algo, act_dtype, state_dtype, backend):
    spec = sc.make_spec(algo, ratio=2, num_layers=2)
    params = sc.make_params(spec, seed=4)
    streams = sc.make_streams(spec, 3, 200, seed=5)
    runs, states = {}, {}
    for mode in ("native", "compact"):
        st = sc.make_state(spec, mode, max_width=4, state_dtype=state_dtype, act_dtype=act_dtype, backend=backend)
        runs[mode], slots = sc.run_mtp(
            st, spec, params, streams, prompt_lens=[7, 1, 12], num_rounds=20, max_width=4, act_dtype=act_dtype
        )
        states[mode] = st.export_checkpoint(torch.tensor(slots, dtype=torch.int32))
    for layer in range(spec.num_layers):
        for req in range(3):
            assert torch.equal(runs["native"].stacked(layer, req), runs["compact"].stacked(layer, req)), (
                f"outputs differ: layer {layer} request {req}"
            )
    assert torch.equal(states["native"].ssm, states["compact"].ssm), "canonical states differ"
    assert torch.equal(states["native"].conv, states["compact"].conv), "conv windows differ"
