"""replay_verify_triton / replay_accept_triton / replay_fold_triton under the interpreter.

Multi-round verify + accept through full fold cycles against the torch twin (outputs, canonical state, every live
history record) and against the fp32 reference on the accepted stream; rejected and stale records are poisoned
with NaN after every round; a perturbed record must be caught (teeth).
"""

from __future__ import annotations

import pytest
import torch

from lightllm.linear_att.autotune import KernelConfig
from lightllm.linear_att.bundles import ReplayBuffers as StateBuffers
from lightllm.linear_att.kernels.cursor import native_accept_triton, replay_accept_triton
from lightllm.linear_att.kernels.replay_fold import replay_fold_triton
from lightllm.linear_att.kernels.replay_verify import replay_verify_triton
from lightllm.linear_att.torch_ops import replay as twin
from unit_tests.helpers.asserts import assert_rel_close, poison_, relative_error
from unit_tests.linear_att.kernels.inputs import SHAPES, TILED, Shape, make_params, make_window, reference_row

NUM_SLOTS = 5
SLOTS = [3, NUM_SLOTS - 1, 0]  # a live row, a padding row on the HOLD slot, a live row


class ReplayBuffers:
    """One layer of replay storage (canonical state + double-buffered fp32 history + per-slot scalars)."""

    def __init__(self, shape: Shape, replay_capacity: int, state_dtype, gen):
        self.ssm = (torch.randn(NUM_SLOTS, shape.HV, shape.K, shape.V, generator=gen) * 0.3).to(state_dtype)
        self.hist_k = poison_(torch.empty(NUM_SLOTS, 2, replay_capacity, shape.H, shape.K))
        self.hist_u = poison_(torch.empty(NUM_SLOTS, 2, replay_capacity, shape.HV, shape.V))
        self.hist_g = poison_(torch.empty(NUM_SLOTS, 2, replay_capacity, shape.HV, shape.GK))
        self.cursor = torch.zeros(NUM_SLOTS, dtype=torch.int32)
        self.parity = torch.zeros(NUM_SLOTS, dtype=torch.int32)
        self.conv_offset = torch.zeros(NUM_SLOTS, dtype=torch.int32)
        self.replay_capacity = replay_capacity

    def clone(self) -> ReplayBuffers:
        other = object.__new__(ReplayBuffers)
        other.__dict__ = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in self.__dict__.items()}
        return other

    def history(self):
        return self.hist_k, self.hist_u, self.hist_g

    def bundle(self, layers=None) -> StateBuffers:
        """The operators' view; `layers`: one leading layer dim (the all-layer fold)."""
        lead = (lambda t: t) if layers is None else (lambda t: t[None])
        return StateBuffers(lead(self.ssm), *map(lead, self.history()), self.cursor, self.parity)

    def poison_dead(self) -> None:
        """NaN every record no later step may read: the other buffer and the live buffer past the cursor."""
        for slot in range(NUM_SLOTS):
            h, p = int(self.cursor[slot]), int(self.parity[slot])
            for t in self.history():
                poison_(t[slot, 1 - p])
                poison_(t[slot, p, h:])

    def live_records(self, slot):
        h, p = int(self.cursor[slot]), int(self.parity[slot])
        return [t[slot, p, :h] for t in self.history()]


def _verify(buf: ReplayBuffers, shape, params, win, widths, projection, config=TILED):
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    return replay_verify_triton(
        win.tokens(params, shape.lower_bound), buf.bundle(), slots, widths, projection=projection, config=config
    )


def _twin_verify(buf: ReplayBuffers, shape, params, win, widths):
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    return twin.replay_verify(win.tokens(params, shape.lower_bound), buf.bundle(), slots, widths)


def _round_plan(r: int, max_width: int, gen) -> tuple[list[int], list[int]]:
    """Widths and accepted counts of round r: full windows, a padding row, all-accept / all-reject rounds."""
    w2 = int(torch.randint(1, max_width + 1, (1,), generator=gen))
    widths = [max_width, 0, w2]
    if r % 3 == 0:
        accepted = [max_width, 1, w2]
    elif r % 3 == 1:
        accepted = [1, 1, 1]
    else:
        accepted = [int(torch.randint(1, w + 1, (1,), generator=gen)) if w else 1 for w in widths]
    return widths, accepted


FP32 = (torch.float32, torch.float32, 2e-6)
FP16 = (torch.float16, torch.float16, 2e-3)
CASES = [
    # (shape, max_width, replay_capacity, projection, num_rounds, dtypes): every live row folds at least once
    pytest.param(SHAPES[1], 1, 4, "inline", 6, FP32, id="fp32-gdn-G2-W1-L4-inline"),
    pytest.param(SHAPES[2], 1, 8, "inline", 10, FP32, id="fp32-gdn-G4-W1-L8"),
    pytest.param(SHAPES[3], 1, 4, "inline", 6, FP32, id="fp32-kda-G1-W1-L4"),
    pytest.param(SHAPES[4], 1, 4, "inline", 6, FP16, id="fp16-kdasafe-G2-W1-L4"),
    pytest.param(SHAPES[2], 2, 4, "precompute", 5, FP32, id="fp32-gdn-G4-W2-L4-precompute"),
    pytest.param(SHAPES[0], 4, 4, "inline", 3, FP32, id="fp32-gdn-G1-W4-L4-inline"),
    pytest.param(SHAPES[1], 4, 8, "precompute", 5, FP32, id="fp32-gdn-G2-W4-L8-precompute"),
    pytest.param(SHAPES[3], 2, 4, "inline", 5, FP32, id="fp32-kda-G1-W2-L4-inline"),
    pytest.param(SHAPES[4], 4, 8, "precompute", 5, FP32, id="fp32-kdasafe-G2-W4-L8-precompute"),
    pytest.param(SHAPES[0], 2, 4, "precompute", 5, FP16, id="fp16-gdn-G1-W2-L4-precompute"),
    pytest.param(SHAPES[4], 4, 4, "inline", 3, FP16, id="fp16-kdasafe-G2-W4-L4-inline"),
    # W = 8: precompute's block inverse takes two squarings; both schedules at the widest window blocks
    pytest.param(SHAPES[1], 8, 8, "precompute", 3, FP32, id="fp32-gdn-G2-W8-L8-precompute"),
    pytest.param(SHAPES[3], 8, 8, "inline", 4, FP32, id="fp32-kda-G1-W8-L8-inline"),
]


@pytest.mark.parametrize(("shape", "max_width", "replay_capacity", "projection", "num_rounds", "dtypes"), CASES)
def test_replay_rounds_match_twin_and_reference(
    shape, max_width, replay_capacity, projection, num_rounds, dtypes, nan_outputs
):
    state_dtype, act_dtype, tol = dtypes
    gen = torch.Generator().manual_seed(100 + replay_capacity + max_width)
    params = make_params(shape, gen)
    buf = ReplayBuffers(shape, replay_capacity, state_dtype, gen)
    ref = buf.clone()
    # the fp32 logical state of each live slot (the oracle's state, rounded where replay rounds: at folds)
    logical = {slot: buf.ssm[slot].float().clone() for slot in SLOTS}
    num_folds = {slot: 0 for slot in SLOTS}
    for r in range(num_rounds):
        widths, accepted = _round_plan(r, max_width, gen)
        win = make_window(shape, len(SLOTS), max_width, act_dtype, gen)
        w_t = torch.tensor(widths, dtype=torch.int32)
        fold_rows = [(int(buf.cursor[s]) + w > replay_capacity) and w > 0 for s, w in zip(SLOTS, widths)]
        ssm_before = buf.ssm.clone()

        o = _verify(buf, shape, params, win, w_t, projection)
        o_twin = _twin_verify(ref, shape, params, win, w_t)

        assert not o.isnan().any(), f"round {r}: NaN output (unwritten element or a leaked poisoned record)"
        assert_rel_close(f"round {r} o vs twin", o, o_twin, tol)
        assert_rel_close(f"round {r} ssm vs twin", buf.ssm, ref.ssm, tol)
        for row, (slot, width) in enumerate(zip(SLOTS, widths)):
            assert (o[row, width:] == 0).all()
            if width == 0:
                continue
            if fold_rows[row]:
                num_folds[slot] += 1
                # the fold rounds the state once to the storage dtype: the oracle continues from that
                logical[slot] = logical[slot].to(state_dtype).float()
                assert_rel_close(f"round {r} folded state", buf.ssm[slot], logical[slot], tol)
            else:
                assert torch.equal(buf.ssm[slot], ssm_before[slot]), "a non-folding row wrote the state"
            ref_o, ref_s = reference_row(shape, params, win, row, width, logical[slot])
            assert_rel_close(f"round {r} o row {row} vs reference", o[row, :width], ref_o, tol)
            logical[slot] = ref_s[accepted[row] - 1]
        assert torch.equal(buf.ssm[SLOTS[1]], ssm_before[SLOTS[1]]), "the padding row wrote its state"

        a_t = torch.tensor(accepted, dtype=torch.int32)
        replay_accept_triton(
            buf.cursor, buf.parity, buf.conv_offset, torch.tensor(SLOTS, dtype=torch.int32), w_t, a_t, replay_capacity
        )
        twin.replay_accept(
            ref.cursor, ref.parity, ref.conv_offset, torch.tensor(SLOTS, dtype=torch.int32), w_t, a_t, replay_capacity
        )
        assert torch.equal(buf.cursor, ref.cursor) and torch.equal(buf.parity, ref.parity)
        assert torch.equal(buf.conv_offset, ref.conv_offset)
        for slot in SLOTS:
            for name, a, b in zip("kug", buf.live_records(slot), ref.live_records(slot)):
                assert_rel_close(f"round {r} record {name} slot {slot}", a, b, tol if name == "u" else 1e-6)
        buf.poison_dead()
        ref.poison_dead()
    for slot in (SLOTS[0], SLOTS[2]):
        assert num_folds[slot] >= 1, f"slot {slot} never folded: the case does not cover a fold cycle"


def test_teeth_a_perturbed_record_is_caught():
    """The comparison above has teeth: nudging one committed u record changes the next outputs beyond tolerance."""
    shape = SHAPES[1]
    gen = torch.Generator().manual_seed(5)
    params = make_params(shape, gen)
    buf = ReplayBuffers(shape, 8, torch.float32, gen)
    slots, w_t = torch.tensor(SLOTS, dtype=torch.int32), torch.tensor([2, 0, 2], dtype=torch.int32)
    win = make_window(shape, len(SLOTS), 2, torch.float32, gen)
    _verify(buf, shape, params, win, w_t, "inline")
    replay_accept_triton(buf.cursor, buf.parity, buf.conv_offset, slots, w_t, w_t, 8)
    ref = buf.clone()
    buf.hist_u[SLOTS[0], int(buf.parity[SLOTS[0]]), 1, 0, 0] += 1e-3
    win = make_window(shape, len(SLOTS), 2, torch.float32, gen)
    o = _verify(buf, shape, params, win, w_t, "inline")
    o_ref = _verify(ref, shape, params, win, w_t, "inline")
    assert relative_error(o, o_ref) > 2e-6, "perturbing a committed record went unnoticed"


@pytest.mark.parametrize(
    ("shape", "state_dtype"),
    [(Shape("gdn", 1, 2), torch.float32), (SHAPES[3], torch.float16)],
    ids=["gdn-G2-fp32", "kda-G1-fp16"],
)
def test_replay_fold_matches_twin_and_in_kernel_fold(shape, state_dtype):
    """Two layers of history at distinct cursors: standalone fold (in place and `out=`) vs the twin, and vs
    the fold the verify kernel does when the next window does not fit."""
    gen = torch.Generator().manual_seed(21)
    replay_capacity, num_layers = 4, 2
    params = make_params(shape, gen)
    layers = [ReplayBuffers(shape, replay_capacity, state_dtype, gen) for _ in range(num_layers)]
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    # build history: slot 3 gets 3 records, slot 0 gets 1, the HOLD slot none
    w_t = torch.tensor([3, 0, 1], dtype=torch.int32)
    for buf in layers:
        buf.cursor, buf.parity = layers[0].cursor, layers[0].parity
        _verify(buf, shape, params, make_window(shape, len(SLOTS), 3, torch.float32, gen), w_t, "inline")
    replay_accept_triton(layers[0].cursor, layers[0].parity, layers[0].conv_offset, slots, w_t, w_t, replay_capacity)
    cursor, parity = layers[0].cursor, layers[0].parity
    stacked = [torch.stack([getattr(b, n) for b in layers]) for n in ("ssm", "hist_k", "hist_u", "hist_g")]
    fold_slots = torch.tensor([3, 0, NUM_SLOTS - 1], dtype=torch.int32)

    out = poison_(torch.empty(num_layers, 3, shape.HV, shape.K, shape.V, dtype=state_dtype))
    before = stacked[0].clone()
    replay_fold_triton(StateBuffers(*stacked, cursor, parity), fold_slots, out=out, config=TILED)
    assert torch.equal(stacked[0], before), "export fold mutated the live state"
    out_twin = torch.empty_like(out)
    twin.replay_fold(StateBuffers(before.clone(), *stacked[1:], cursor, parity), fold_slots, out=out_twin)
    assert_rel_close("fold out vs twin", out, out_twin, 2e-6 if state_dtype == torch.float32 else 2e-3)
    assert torch.equal(out[:, 2], before[:, NUM_SLOTS - 1]), "an empty history must export the state as is"

    inplace = stacked[0].clone()
    replay_fold_triton(StateBuffers(inplace, *stacked[1:], cursor, parity), fold_slots, config=TILED)
    assert torch.equal(inplace[:, fold_slots.long()], out), "in-place fold != exported fold"

    # every verify kernel folds slot 3 (h = 3, W = 2 > L - h) with the same helper: the same bytes as the standalone
    # fold, whatever the kernel's tiling ("inline": the prepare kernel, "precompute": the one-launch window kernel)
    window = make_window(shape, len(SLOTS), 2, torch.float32, gen)
    for projection in ("inline", "precompute"):
        buf = layers[0].clone()
        _verify(buf, shape, params, window, torch.tensor([2, 0, 0], dtype=torch.int32), projection)
        assert torch.equal(buf.ssm[3], out[0, 0]), f"in-kernel fold ({projection}) != standalone fold"

    # plain decode (the one-launch W = 1 kernel) folds once the history is full: fill slot 0 to replay_capacity first
    buf = layers[0].clone()
    one = torch.tensor([0, 0, 1], dtype=torch.int32)
    while int(buf.cursor[0]) < replay_capacity:
        _verify(buf, shape, params, make_window(shape, len(SLOTS), 1, torch.float32, gen), one, "inline")
        replay_accept_triton(buf.cursor, buf.parity, buf.conv_offset, slots, one, one, replay_capacity)
    full = poison_(torch.empty(1, 1, shape.HV, shape.K, shape.V, dtype=state_dtype))
    replay_fold_triton(buf.bundle(layers=1), torch.tensor([0], dtype=torch.int32), out=full, config=TILED)
    _verify(buf, shape, params, make_window(shape, len(SLOTS), 1, torch.float32, gen), one, "inline")
    assert torch.equal(buf.ssm[0], full[0, 0]), "decode kernel fold != standalone fold"


def test_accept_kernels_match_twin():
    gen = torch.Generator().manual_seed(3)
    num_slots, replay_capacity = 40, 8
    cursor = torch.randint(0, replay_capacity + 1, (num_slots,), generator=gen, dtype=torch.int32)
    parity = torch.randint(0, 2, (num_slots,), generator=gen, dtype=torch.int32)
    conv_offset = torch.randint(0, 4, (num_slots,), generator=gen, dtype=torch.int32)
    slots = torch.randperm(num_slots - 1, generator=gen)[:33].to(torch.int32)
    slots[-3:] = num_slots - 1  # padding rows on the HOLD slot
    widths = torch.randint(1, 5, (33,), generator=gen, dtype=torch.int32)
    widths[-3:] = 0
    accepted = torch.minimum(torch.randint(1, 5, (33,), generator=gen, dtype=torch.int32), widths.clamp(min=1))
    mine = [t.clone() for t in (cursor, parity, conv_offset)]
    theirs = [t.clone() for t in (cursor, parity, conv_offset)]
    replay_accept_triton(*mine, slots, widths, accepted, replay_capacity)
    twin.replay_accept(*theirs, slots, widths, accepted, replay_capacity)
    for a, b in zip(mine, theirs):
        assert torch.equal(a, b)
    assert mine[0][num_slots - 1] == cursor[num_slots - 1] and mine[1][num_slots - 1] == parity[num_slots - 1]

    ssm_index, offsets = torch.full((num_slots,), 7, dtype=torch.int32), conv_offset.clone()
    native_accept_triton(ssm_index, offsets, slots, widths, accepted)
    live = widths > 0
    expect = torch.full((num_slots,), 7, dtype=torch.int32)
    expect[slots[live].long()] = accepted[live] - 1
    assert torch.equal(ssm_index, expect)
    assert offsets[num_slots - 1] == conv_offset[num_slots - 1]


def test_replay_config_of_one_tile_matches_tiled():
    """BV = V (one tile) and BV = V/2 (two tiles) give the same outputs and records (tiling is exact per column)."""
    shape = SHAPES[2]
    gen = torch.Generator().manual_seed(8)
    params = make_params(shape, gen)
    buf = ReplayBuffers(shape, 4, torch.float32, gen)
    other = buf.clone()
    w_t = torch.tensor([3, 0, 2], dtype=torch.int32)
    win = make_window(shape, len(SLOTS), 3, torch.float32, gen)
    o = _verify(buf, shape, params, win, w_t, "inline")
    o1 = _verify(other, shape, params, win, w_t, "inline", config=KernelConfig(16, 1, 1))
    assert_rel_close("o", o, o1, 1e-6)
    assert_rel_close("hist_u", torch.nan_to_num(buf.hist_u), torch.nan_to_num(other.hist_u), 1e-6)
