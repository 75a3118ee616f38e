"""ReplayState.num_folds: one count per row whose verify folded (the metrics endpoint reports it)."""

from __future__ import annotations

import torch

from unit_tests.linear_att.scenarios import make_params, make_spec, make_state, make_streams, new_run, verify_round


def test_replay_counts_one_fold_per_folding_row_and_step():
    spec = make_spec(num_layers=2)
    state = make_state(spec, "replay", max_requests=3, max_width=2, replay_capacity=4)
    params, streams = make_params(spec), make_streams(spec, num_requests=2, length=64)
    slots = [state.alloc(), state.alloc()]
    run, gen = new_run(spec, 2), torch.Generator().manual_seed(3)
    expected, cursors = 0, [0, 0]
    # row 0 decodes one token a step, row 1 verifies two and accepts one or two; a HOLD row pads every step
    for step in range(14):
        widths, accepted = [1, 2], [1, 1 + step % 2]
        for i in range(2):
            folds = cursors[i] + widths[i] > 4
            expected += folds
            cursors[i] = (0 if folds else cursors[i]) + accepted[i]
        verify_round(state, spec, params, streams, slots, widths, accepted, run, gen, hold_rows=1)
        assert int(state.num_folds) == expected, f"step {step}"
    assert state.cursor[slots].tolist() == cursors
    assert expected >= 8


def test_native_and_compact_have_no_fold_counter():
    spec = make_spec(num_layers=1)
    for mode in ("native", "compact"):
        assert not hasattr(make_state(spec, mode, max_width=2), "num_folds")
