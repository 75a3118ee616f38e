"""native_verify_triton / compact_verify_triton / compact_commit_triton under the interpreter.

Against the torch twins and the fp32 references (outputs and every written state); native == compact bitwise
under the same backend; padding rows and untouched slots keep their bytes; NaN-poisoned outputs.
"""

from __future__ import annotations

import pytest
import torch

from lightllm.linear_att.bundles import CompactBuffers, NativeBuffers
from lightllm.linear_att.kernels.serial import compact_commit_triton, compact_verify_triton, native_verify_triton
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
    tokens = win.tokens(params, shape.lower_bound)
    ssm_twin, before = ssm.clone(), ssm.clone()

    o = native_verify_triton(tokens, NativeBuffers(ssm, ssm_index), slots, widths, config=TILED)
    o_twin = twin.native_verify(tokens, NativeBuffers(ssm_twin, ssm_index), slots, widths)

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
    """State, two poisoned record buffers per slot (nothing may be read before it is written), random parity."""
    ssm = (torch.randn(num_layers, NUM_SLOTS, shape.HV, shape.K, shape.V, generator=gen) * 0.3).to(state_dtype)
    lead = (num_layers, NUM_SLOTS, 2, max_width)
    win = (
        poison_(torch.empty(*lead, shape.H, shape.K)),
        poison_(torch.empty(*lead, shape.HV, shape.V)),
        poison_(torch.empty(*lead, shape.HV, shape.GK)),
    )
    pending = torch.zeros(NUM_SLOTS, dtype=torch.int32)
    parity = torch.randint(0, 2, (NUM_SLOTS,), generator=gen, dtype=torch.int32)
    return ssm, win, pending, parity


def _accept(pending, parity, slots, widths, accepted):
    """What `CompactState.accept` does to the per-slot scalars (live rows only)."""
    for slot, width, a in zip(slots.tolist(), widths.tolist(), accepted.tolist()):
        if width > 0:
            pending[slot], parity[slot] = a, 1 - parity[slot]


@pytest.mark.parametrize("shape", SHAPES[1:4], ids=str)
@pytest.mark.parametrize("max_width", [2, 4])
@pytest.mark.parametrize(("state_dtype", "act_dtype", "tol"), DTYPES)
def test_compact_equals_native_bitwise(shape, max_width, state_dtype, act_dtype, tol, nan_outputs):
    """Two layers, two rounds: the second verify merges the first round's accepted tokens inside the kernel; then
    the all-layer commit merges the second round's. Every output and state equals native's, byte for byte."""
    gen = torch.Generator().manual_seed(11 + max_width)
    num_layers = 2
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    widths = torch.tensor(_widths(max_width), dtype=torch.int32)
    accepted = [
        torch.tensor([max(1, max_width // 2), 1, max(1, max_width - 1)], dtype=torch.int32),
        torch.tensor([max_width, 1, 1], dtype=torch.int32),
    ]
    ssm, win, pending, parity = _compact_buffers(shape, max_width, state_dtype, act_dtype, num_layers, gen)
    ssm_twin, win_twin = ssm.clone(), tuple(t.clone() for t in win)
    pending_twin, parity_twin = pending.clone(), parity.clone()
    native = torch.zeros(num_layers, NUM_SLOTS, max_width, shape.HV, shape.K, shape.V, dtype=state_dtype)
    native[:, :, 0] = ssm
    ssm_index = torch.zeros(NUM_SLOTS, dtype=torch.int32)
    params = [make_params(shape, gen) for _ in range(num_layers)]
    for rnd in range(2):
        for layer in range(num_layers):
            w = make_window(shape, len(SLOTS), max_width, act_dtype, gen)
            tokens = w.tokens(params[layer], shape.lower_bound)
            start = native[layer, torch.arange(NUM_SLOTS), ssm_index.long()].clone()
            o_native = native_verify_triton(
                tokens, NativeBuffers(native[layer], ssm_index), slots, widths, config=TILED
            )
            layer_win = tuple(t[layer] for t in win)
            read_before = [t[layer][torch.arange(NUM_SLOTS), parity.long()].clone() for t in win]
            o = compact_verify_triton(
                tokens, CompactBuffers(ssm[layer], *layer_win, pending, parity), slots, widths, config=TILED
            )
            twin_state = CompactBuffers(ssm_twin[layer], *(t[layer] for t in win_twin), pending_twin, parity_twin)
            o_twin = twin.compact_verify(tokens, twin_state, slots, widths)
            assert torch.equal(o, o_native), f"round {rnd}: compact verify outputs differ from native"
            assert_rel_close("o vs twin", o, o_twin, tol)
            for slot, width in zip(SLOTS, widths.tolist()):
                if width > 0:
                    # the merged state the window started from (round 0: nothing pending, the state as it was)
                    want = start[slot].view(torch.uint8)
                    assert torch.equal(ssm[layer, slot].view(torch.uint8), want), f"round {rnd}: merge != native"
                    assert_rel_close("merged state vs twin", ssm[layer, slot], ssm_twin[layer, slot], tol)
                _check_window_written(layer_win, win_twin, layer, slot, width, int(parity[slot]), read_before, tol)
        _accept(pending, parity, slots, widths, accepted[rnd])
        _accept(pending_twin, parity_twin, slots, widths, accepted[rnd])
        ssm_index = _native_index_after(ssm_index, slots, widths, accepted[rnd])

    compact_commit_triton(CompactBuffers(ssm, *win, pending, parity), slots, config=TILED)
    twin.compact_commit(CompactBuffers(ssm_twin, *win_twin, pending_twin, parity_twin), slots)
    for layer in range(num_layers):
        for slot in range(NUM_SLOTS):
            want = native[layer, slot, int(ssm_index[slot])]
            assert torch.equal(ssm[layer, slot].view(torch.uint8), want.view(torch.uint8)), f"slot {slot}: != native"
    assert_rel_close("committed state vs twin", ssm, ssm_twin, tol)


def _native_index_after(index_before, slots, widths, accepted):
    index = index_before.clone()
    for slot, width, a in zip(slots.tolist(), widths.tolist(), accepted.tolist()):
        if width > 0:
            index[slot] = a - 1
    return index


def _check_window_written(layer_win, win_twin, layer, slot, width, parity, read_before, tol):
    """A verify writes the records of tokens s < W of its row into buffer 1 - parity and leaves the buffer it read
    alone."""
    for t, before in zip(layer_win, read_before):
        assert torch.equal(t[slot, parity].nan_to_num(7.0), before[slot].nan_to_num(7.0)), "the read buffer changed"
    written = [t[slot, 1 - parity] for t in layer_win]
    if width == 0:
        assert written[0].isnan().all(), "a padding row wrote its window"
        return
    # k̂, u and g come from two implementations of one formula; u also carries the state's rounding
    twin_win = [t[layer][slot, 1 - parity, :width] for t in win_twin]
    assert_rel_close("window k", written[0][:width], twin_win[0], 1e-6)
    assert_rel_close("window u", written[1][:width], twin_win[1], tol)
    assert_rel_close("window g", written[2][:width], twin_win[2], 1e-6)
    assert written[0][width:].isnan().all(), "a record past the width was written"


def test_each_mode_launches_with_its_own_tuned_family(monkeypatch):
    """Native verify looks its tile up as "serial", compact verify and commit as "compact" (the lookups a compact
    entry in the table answers)."""
    import inspect

    from lightllm.linear_att.kernels import launch, serial

    families = []
    signature = inspect.signature(launch.serial_config)

    def spy(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        families.append("compact" if bound.arguments["compact"] else "serial")
        return launch.serial_config(*args, **kwargs)

    monkeypatch.setattr(serial, "serial_config", spy)
    shape, max_width = SHAPES[1], 2
    gen = torch.Generator().manual_seed(3)
    tokens = make_window(shape, len(SLOTS), max_width, torch.float32, gen).tokens(
        make_params(shape, gen), shape.lower_bound
    )
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    widths = torch.tensor(_widths(max_width), dtype=torch.int32)
    ssm, ssm_index = _native_state(shape, max_width, torch.float32, gen)
    native_verify_triton(tokens, NativeBuffers(ssm, ssm_index), slots, widths)
    ssm, win, pending, parity = _compact_buffers(shape, max_width, torch.float32, torch.float32, 1, gen)
    compact_verify_triton(tokens, CompactBuffers(ssm[0], *(t[0] for t in win), pending, parity), slots, widths)
    compact_commit_triton(CompactBuffers(ssm, *win, pending, parity), slots)
    assert families == ["serial", "compact", "compact"]
