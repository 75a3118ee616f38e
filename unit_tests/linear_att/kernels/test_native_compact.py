"""native_verify_triton / compact_verify_triton / compact_commit_triton under the interpreter.

Against the torch twins and the fp32 references (outputs and every written state); native == compact bitwise
under the same backend; padding rows and untouched slots keep their bytes; NaN-poisoned outputs.
"""

from __future__ import annotations

import pytest
import torch

from lightllm.linear_att.kernels.compact import compact_commit_triton, compact_verify_triton
from lightllm.linear_att.kernels.native_verify import native_verify_triton
from lightllm.linear_att.torch_ops import verify as twin
from unit_tests.helpers.asserts import assert_rel_close, poison_
from unit_tests.linear_att.kernels.inputs import SHAPES, TILED, make_params, make_window, reference_row

NUM_SLOTS = 6
# rows: a full window, a padding row on the HOLD slot, a partial window
SLOTS = [3, NUM_SLOTS - 1, 1]

DTYPES = [
    pytest.param(torch.float32, torch.float32, 2e-6, id="fp32"),
    pytest.param(torch.float16, torch.float16, 2e-3, id="fp16"),
]


def _widths(max_width: int) -> list[int]:
    return [max_width, 0, max(1, max_width - 1)]


def _native_state(shape, max_width, state_dtype, gen):
    ssm = poison_(torch.empty(NUM_SLOTS, max_width, shape.HV, shape.K, shape.V, dtype=state_dtype))
    ssm_index = torch.randint(0, max_width, (NUM_SLOTS,), generator=gen, dtype=torch.int32)
    for slot in range(NUM_SLOTS):
        ssm[slot, int(ssm_index[slot])] = (torch.randn(shape.HV, shape.K, shape.V, generator=gen) * 0.3).to(state_dtype)
    return ssm, ssm_index


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("max_width", [1, 2, 4])
@pytest.mark.parametrize(("state_dtype", "act_dtype", "tol"), DTYPES)
def test_native_verify_matches_twin_and_reference(shape, max_width, state_dtype, act_dtype, tol, nan_outputs):
    gen = torch.Generator().manual_seed(7 + max_width)
    params = make_params(shape, gen)
    win = make_window(shape, len(SLOTS), max_width, act_dtype, gen)
    ssm, ssm_index = _native_state(shape, max_width, state_dtype, gen)
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    widths = torch.tensor(_widths(max_width), dtype=torch.int32)
    args = (win.q, win.k, win.v, win.graw, win.braw, params.A_log, params.dt_bias)
    ssm_twin, before = ssm.clone(), ssm.clone()

    o = native_verify_triton(*args, ssm, ssm_index, slots, widths, lower_bound=shape.lower_bound, config=TILED)
    o_twin = twin.native_verify(*args, ssm_twin, ssm_index, slots, widths, lower_bound=shape.lower_bound)

    assert not o.isnan().any(), "an output element was never written"
    assert_rel_close("o vs twin", o, o_twin, tol)
    for row, (slot, width) in enumerate(zip(SLOTS, widths.tolist())):
        assert (o[row, width:] == 0).all(), "tokens past the width must be zero"
        if width == 0:
            continue
        ref_o, ref_s = reference_row(shape, params, win, row, width, before[slot, int(ssm_index[slot])], state_dtype)
        assert_rel_close(f"o row {row}", o[row, :width], ref_o, tol)
        assert_rel_close(f"states row {row}", ssm[slot, :width], ref_s, tol)
        assert_rel_close(f"states row {row} vs twin", ssm[slot, :width], ssm_twin[slot, :width], tol)
        # slots past the width keep their bytes
        assert torch.equal(ssm[slot, width:].view(torch.uint8), before[slot, width:].view(torch.uint8))
    touched = set(s for s, w in zip(SLOTS, widths.tolist()) if w > 0)
    for slot in set(range(NUM_SLOTS)) - touched:
        assert torch.equal(ssm[slot].view(torch.uint8), before[slot].view(torch.uint8)), f"slot {slot} was written"


def _compact_buffers(shape, max_width, state_dtype, act_dtype, num_layers, gen):
    ssm = (torch.randn(num_layers, NUM_SLOTS, shape.HV, shape.K, shape.V, generator=gen) * 0.3).to(state_dtype)
    win = (
        poison_(torch.empty(num_layers, NUM_SLOTS, max_width, shape.H, shape.K, dtype=act_dtype)),
        poison_(torch.empty(num_layers, NUM_SLOTS, max_width, shape.HV, shape.V, dtype=act_dtype)),
        poison_(torch.empty(num_layers, NUM_SLOTS, max_width, shape.HV, shape.GK)),
        poison_(torch.empty(num_layers, NUM_SLOTS, max_width, shape.HV)),
    )
    return ssm, win


@pytest.mark.parametrize("shape", SHAPES[1:4], ids=str)
@pytest.mark.parametrize("max_width", [2, 4])
@pytest.mark.parametrize(("state_dtype", "act_dtype", "tol"), DTYPES)
def test_compact_equals_native_bitwise(shape, max_width, state_dtype, act_dtype, tol, nan_outputs):
    """Two layers: verify each with compact and native, commit both layers in one launch, compare bytes."""
    gen = torch.Generator().manual_seed(11 + max_width)
    num_layers = 2
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    widths = torch.tensor(_widths(max_width), dtype=torch.int32)
    accepted = torch.tensor([max(1, max_width // 2), 1, max(1, max_width - 1)], dtype=torch.int32)
    ssm, win = _compact_buffers(shape, max_width, state_dtype, act_dtype, num_layers, gen)
    ssm_before = ssm.clone()
    ssm_twin, win_twin = ssm.clone(), tuple(t.clone() for t in win)
    expect = []
    for layer in range(num_layers):
        params = make_params(shape, gen)
        w = make_window(shape, len(SLOTS), max_width, act_dtype, gen)
        args = (w.q, w.k, w.v, w.graw, w.braw, params.A_log, params.dt_bias)
        native = torch.zeros(NUM_SLOTS, max_width, shape.HV, shape.K, shape.V, dtype=state_dtype)
        native[:, 0] = ssm[layer]
        ssm_index = torch.zeros(NUM_SLOTS, dtype=torch.int32)
        o_native = native_verify_triton(
            *args, native, ssm_index, slots, widths, lower_bound=shape.lower_bound, config=TILED
        )
        layer_win = tuple(t[layer] for t in win)
        o = compact_verify_triton(
            *args, ssm[layer], *layer_win, slots, widths, lower_bound=shape.lower_bound, config=TILED
        )
        o_twin = twin.compact_verify(
            *args, ssm_twin[layer], *(t[layer] for t in win_twin), slots, widths, lower_bound=shape.lower_bound
        )
        assert torch.equal(o, o_native), "compact verify outputs differ from native"
        assert torch.equal(ssm, ssm_before), "compact verify wrote the state"
        assert_rel_close("o vs twin", o, o_twin, tol)
        for slot, width in zip(SLOTS, widths.tolist()):
            if width == 0:
                assert layer_win[0][slot].isnan().all(), "a padding row wrote its window"
                continue
            # raw k / v are copied bit for bit; the activated gates come from two implementations of one formula
            twin_win = [t[layer][slot, :width] for t in win_twin]
            assert torch.equal(layer_win[0][slot, :width], twin_win[0]), "window k differs from the twin"
            assert torch.equal(layer_win[1][slot, :width], twin_win[1]), "window v differs from the twin"
            assert_rel_close("window g", layer_win[2][slot, :width], twin_win[2], 1e-6)
            assert_rel_close("window beta", layer_win[3][slot, :width], twin_win[3], 1e-6)
        # what native holds after the accepted prefix (slot a-1); rows that did not run keep their state
        committed = ssm[layer].clone()
        for slot, width, a in zip(SLOTS, widths.tolist(), accepted.tolist()):
            if width > 0:
                committed[slot] = native[slot, a - 1]
        expect.append(committed)

    compact_commit_triton(ssm, *win, slots, widths, accepted, config=TILED)
    twin.compact_commit(ssm_twin, *win_twin, slots, widths, accepted)
    for layer in range(num_layers):
        assert torch.equal(ssm[layer].view(torch.uint8), expect[layer].view(torch.uint8)), "compact != native"
    assert_rel_close("committed state vs twin", ssm, ssm_twin, tol)
