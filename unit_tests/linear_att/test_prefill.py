"""`ops.chunk_delta_rule` (torch chunked form) and `LinearAttState.prefill`: chunked == recurrent == decode."""

from __future__ import annotations

import pytest
import torch

from lightllm.linear_att import ops
from lightllm.linear_att.gdn import reference as gdn_ref
from lightllm.linear_att.kda import reference as kda_ref
from lightllm.linear_att.torch_ops.prefill import CHUNK_SIZE
from unit_tests.helpers.asserts import assert_rel_close
from unit_tests.linear_att import scenarios as sc

LENGTHS = {
    "boundary_inside": [CHUNK_SIZE + 5],
    "exact_chunk": [CHUNK_SIZE],
    "varlen_empty_row": [3, 0, 2 * CHUNK_SIZE + 1, 1],
}


@pytest.mark.parametrize("algo", ["gdn", "kda"])
@pytest.mark.parametrize("ratio", [1, 2, 4], ids=lambda r: f"hv_per_h{r}")
@pytest.mark.parametrize("case", list(LENGTHS))
def test_chunk_delta_rule_equals_recurrent_reference(algo, ratio, case):
    lengths = LENGTHS[case]
    H, K, V = 2, 16, 8
    HV = H * ratio
    gk = 1 if algo == "gdn" else K
    gen = torch.Generator().manual_seed(ratio)
    T = sum(lengths)
    q, k = torch.randn(T, H, K, generator=gen), torch.randn(T, H, K, generator=gen)
    v = torch.randn(T, HV, V, generator=gen)
    g, beta = ops.activate_gates(
        torch.randn(T, HV, gk, generator=gen),
        torch.randn(T, HV, generator=gen),
        torch.rand(HV, generator=gen) - 0.5,
        torch.randn(HV, gk, generator=gen),
    )
    h0 = torch.randn(len(lengths), HV, K, V, generator=gen)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    o, s = ops.chunk_delta_rule(q, k, v, g, beta, h0, cu, backend="torch")
    if algo == "gdn":
        o_r, s_r = gdn_ref.recurrent_gated_delta_rule(q, k, v, g[..., 0], beta, initial_state=h0, cu_seqlens=cu)
    else:
        o_r, s_r = kda_ref.recurrent_kda(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu)
    assert_rel_close("o", o, o_r, 2e-6)
    assert_rel_close("final state", s, s_r, 2e-6)


@pytest.mark.parametrize("mode", ["native", "compact", "replay"])
@pytest.mark.parametrize("algo", ["gdn", "kda"])
def test_prefill_chunks_and_decode_equal_reference(algo, mode):
    """Prefill in two chunks (second has initial state), MTP decode, another prefill chunk (replay folds its
    history first), more decode: every output equals the fp32 oracle over the stream."""
    spec = sc.make_spec(algo, num_layers=1)
    params = sc.make_params(spec, seed=2)
    streams = sc.make_streams(spec, 2, 200, seed=3)
    state = sc.make_state(spec, mode, max_width=3, replay_capacity=4)
    gen = torch.Generator().manual_seed(0)
    slots = [state.alloc(), state.alloc()]
    run = sc.new_run(spec, 2)
    sc.prefill(state, spec, params, streams, slots, [CHUNK_SIZE + 3, 1], run)
    sc.prefill(state, spec, params, streams, slots, [9, CHUNK_SIZE], run)
    for r in range(6):
        sc.verify_round(state, spec, params, streams, slots, [3, 2], [1 + r % 3, 2], run, gen)
        sc.poison_dead(state)
    sc.prefill(state, spec, params, streams, slots, [5, 17], run)
    for _ in range(4):
        sc.verify_round(state, spec, params, streams, slots, [3, 1], [2, 1], run, gen)
    assert sc.max_output_error(spec, params, streams, run) < 1e-5
