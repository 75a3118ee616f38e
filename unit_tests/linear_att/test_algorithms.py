"""The algorithm packages: each (algorithm, mode) pair has its own state class bound to its descriptor and to its
operator entry points, and the entry points refuse the other algorithm's gates."""

from __future__ import annotations

import pytest
import torch

from lightllm.linear_att import states
from lightllm.linear_att.bundles import NativeBuffers, TokenInputs
from lightllm.linear_att.gdn.algorithm import GDN
from lightllm.linear_att.kda.algorithm import KDA
from unit_tests.linear_att import scenarios as sc


@pytest.mark.parametrize("mode", ["native", "compact", "replay"])
@pytest.mark.parametrize(("algo", "descriptor"), [("gdn", GDN), ("kda", KDA)])
def test_each_pair_binds_its_descriptor_and_kernels(algo, descriptor, mode):
    spec = sc.make_spec(algo, head_k_dim=8)
    state = sc.make_state(spec, mode, max_width=2, replay_capacity=4)
    assert type(state) is states.state_class(algo, mode)
    assert state.algorithm is descriptor and state.kernels is descriptor.kernels
    assert spec.gate_dim == (8 if algo == "kda" else 1)


def test_a_state_class_refuses_the_other_algorithm():
    with pytest.raises(ValueError, match="gdn state"):
        states.state_class("gdn", "native")(sc.make_spec("kda"), sc.make_state(sc.make_spec("kda"), "native").config)


def _tokens(gate_width, K=8):
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 1, K, generator=gen), torch.randn(2, 1, 1, K, generator=gen)
    v, braw = torch.randn(2, 1, 2, K, generator=gen), torch.randn(2, 1, 2, generator=gen)
    graw, dt_bias = torch.randn(2, 1, 2, gate_width, generator=gen), torch.zeros(2, gate_width)
    return TokenInputs(q, k, v, graw, braw, torch.zeros(2), dt_bias)


def test_entry_points_check_the_gate_width():
    state = NativeBuffers(torch.zeros(3, 1, 2, 8, 8), torch.zeros(3, dtype=torch.int32))
    rows = (torch.tensor([0, 1], dtype=torch.int32), torch.ones(2, dtype=torch.int32))
    o = GDN.kernels.native_verify(_tokens(1), state, *rows, backend="torch")
    assert o.shape == (2, 1, 2, 8) and o.abs().sum() > 0
    assert KDA.kernels.native_verify(_tokens(8), state, *rows, backend="torch").shape == o.shape
    with pytest.raises(ValueError, match="gdn native_verify: gate width 8"):
        GDN.kernels.native_verify(_tokens(8), state, *rows, backend="torch")
    with pytest.raises(ValueError, match="kda native_verify: gate width 1"):
        KDA.kernels.native_verify(_tokens(1), state, *rows, backend="torch")


def test_only_the_bounded_gate_algorithm_takes_a_lower_bound():
    from lightllm.linear_att import validate_state_config

    config = sc.make_state(sc.make_spec("kda"), "native").config
    validate_state_config(sc.make_spec("kda", lower_bound=-5.0), config)
    with pytest.raises(ValueError, match="gate_lower_bound"):
        validate_state_config(sc.make_spec("gdn", lower_bound=-5.0), config)
    with pytest.raises(ValueError, match="unknown linear-attention algorithm"):
        validate_state_config(sc.make_spec("mamba"), config)
