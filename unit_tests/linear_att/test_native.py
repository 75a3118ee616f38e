"""Native mode (`NativeState`, `ops.native_verify`) against the fp32 oracle, incl. per-token state rounding."""

from __future__ import annotations

import pytest
import torch

from lightllm.linear_att import ops
from lightllm.linear_att.bundles import NativeBuffers, TokenInputs
from unit_tests.helpers.asserts import assert_rel_close, poison_
from unit_tests.linear_att import scenarios as sc


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32_state", "bf16_state"])
@pytest.mark.parametrize("algo", ["gdn", "kda"])
def test_native_decode_matches_reference_with_storage_rounding(algo, state_dtype):
    spec = sc.make_spec(algo, num_layers=1)
    params = sc.make_params(spec, seed=6)
    streams = sc.make_streams(spec, 2, 100, seed=7)
    st = sc.make_state(spec, "native", max_width=1, state_dtype=state_dtype)
    run, _ = sc.run_mtp(st, spec, params, streams, prompt_lens=[1, 1], num_rounds=40, max_width=1, policy="decode")
    if state_dtype == torch.float32:
        assert sc.max_output_error(spec, params, streams, run) < 1e-5
        return
    # a one-token prefill rounds like a decode step, so the oracle with per-token rounding applies; an fp32 ulp can
    # still flip a bf16 rounding, hence a tolerance far below bf16 precision but above fp32's
    err_rounded = sc.max_output_error(spec, params, streams, run, round_state_to=state_dtype)
    err_unrounded = sc.max_output_error(spec, params, streams, run)
    assert err_rounded < 2e-4
    assert err_rounded < err_unrounded / 5, "the per-token state rounding is not what native does"


@pytest.mark.parametrize("algo", ["gdn", "kda"])
def test_native_verify_writes_every_window_state(algo):
    """Slot s after a width-W verify holds the state after token s: verifying again from slot s-1 reproduces it."""
    gen = torch.Generator().manual_seed(8)
    N, W, H, HV, K, V = 2, 3, 1, 2, 8, 8
    gk = 1 if algo == "gdn" else K
    q, k = torch.randn(N, W, H, K, generator=gen), torch.randn(N, W, H, K, generator=gen)
    v, graw, braw = (
        torch.randn(N, W, HV, V, generator=gen),
        torch.randn(N, W, HV, gk, generator=gen),
        torch.randn(N, W, HV, generator=gen),
    )
    A_log, dt_bias = torch.zeros(HV), torch.zeros(HV, gk)
    ssm = torch.randn(3, W, HV, K, V, generator=gen)
    index = torch.zeros(3, dtype=torch.int32)
    slots, widths = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([3, 3], dtype=torch.int32)
    before = ssm.clone()
    tokens = TokenInputs(q, k, v, graw, braw, A_log, dt_bias)
    o = ops.native_verify(tokens, NativeBuffers(ssm, index), slots, widths, backend="torch")
    assert torch.equal(ssm[1], before[1])
    for s in range(1, W):
        again = before.clone()
        again[:, 0] = ssm[:, s - 1]
        later = TokenInputs(q[:, s:], k[:, s:], v[:, s:], graw[:, s:], braw[:, s:], A_log, dt_bias)
        o_s = ops.native_verify(later, NativeBuffers(again, index), slots, widths - s, backend="torch")
        assert_rel_close(f"state after token {s}", again[slots.long(), 0], ssm[slots.long(), s], 1e-6)
        assert_rel_close(f"output of token {s}", o_s[:, 0], o[:, s], 1e-6)
    poison_(o)
