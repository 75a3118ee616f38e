"""The prepare -> forward contract of the replay kernels under the interpreter.

The prepare kernel's coefficient rows, applied in torch to [S0 (or the folded S_h) ; committed u records ; window
v], reproduce the outputs and u records the forward wrote; the coefficient scratch is reused across calls (CUDA
graphs capture its address).
"""

from __future__ import annotations

import pytest
import torch

from lightllm.linear_att.kernels import replay_verify as rv
from lightllm.linear_att.kernels.cursor import replay_accept_triton
from unit_tests.linear_att.kernels.inputs import SHAPES, make_params, make_window
from unit_tests.linear_att.kernels.test_replay import SLOTS, ReplayBuffers, _verify


@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[3]], ids=str)
def test_prepare_coefficients_reproduce_forward(shape):
    gen = torch.Generator().manual_seed(17)
    capacity, wmax = 4, 3
    params = make_params(shape, gen)
    buf = ReplayBuffers(shape, capacity, torch.float32, gen)
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    # round 1 leaves slot 3 with 3 records (next window of 2 folds) and slot 0 with 1 (next window fits)
    w_t = torch.tensor([3, 0, 1], dtype=torch.int32)
    _verify(buf, shape, params, make_window(shape, len(SLOTS), wmax, torch.float32, gen), w_t, "inline")
    replay_accept_triton(buf.cursor, buf.parity, buf.conv_offset, slots, w_t, w_t, capacity)
    before = buf.clone()
    w_t = torch.tensor([2, 0, 3], dtype=torch.int32)
    win = make_window(shape, len(SLOTS), wmax, torch.float32, gen)
    o = _verify(buf, shape, params, win, w_t, "inline")
    coef = rv._coef_scratch(len(SLOTS), shape.HV, wmax, shape.K, capacity, torch.device("cpu"))
    K = shape.K
    for i, slot in enumerate(SLOTS):
        W = int(w_t[i])
        if W == 0:
            assert torch.all(o[i] == 0), "a padding row produced outputs"
            continue
        h, p = int(before.cursor[slot]), int(before.parity[slot])
        fold = h + W > capacity
        assert fold == (slot == 3)
        base = buf.ssm[slot] if fold else before.ssm[slot]  # [HV, K, V]
        hr = 0 if fold else h
        recs = before.hist_u[slot, p, :hr]  # [hr, HV, V]
        pos = 0 if fold else h
        out_buf = 1 - p if fold else p
        for hv in range(shape.HV):
            for s in range(W):
                for row, want in ((s, buf.hist_u[slot, out_buf, pos + s, hv]), (wmax + s, o[i, s, hv])):
                    c = coef[i, hv, row]
                    got = (
                        c[:K] @ base[hv].float()
                        + c[K : K + hr] @ recs[:, hv]
                        + c[K + capacity :][:W] @ win.v[i, :W, hv]
                    )
                    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-6)


def test_coefficient_scratch_is_reused():
    dev = torch.device("cpu")
    a = rv._coef_scratch(6, 2, 2, 16, 4, dev)
    b = rv._coef_scratch(3, 2, 2, 16, 4, dev)
    assert a.data_ptr() == b.data_ptr(), "a smaller batch must reuse the buffer"
    c = rv._coef_scratch(9, 2, 2, 16, 4, dev)
    assert c.shape == (9, 2, 4, 16 + 4 + 2)
    assert any(t.data_ptr() == a.data_ptr() for t in rv._RETIRED), "a grown-out buffer must stay alive"
