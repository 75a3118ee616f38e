"""ModelRunner.stats(): the replay fold counter the metrics endpoint exports (absent in other modes)."""

from __future__ import annotations

from unit_tests.models.conftest import case_dir
from unit_tests.models.drive import decode, make_runner, prefill


def test_replay_runner_counts_folds_once_per_step_for_all_layers():
    runner = make_runner(case_dir("qwen3_next-hv2"), mode="replay", replay_capacity=4)
    handle = runner.add_request()
    prefill(runner, handle, [3, 14, 15, 9, 2, 6])
    token = 5
    for _ in range(13):
        token = int(decode(runner, handle, token).argmax())
    # capacity 4, one token per step from an empty history: steps 5, 9 and 13 fold (every layer, counted once)
    assert runner.stats() == {"num_folds": 3}


def test_native_runner_reports_no_fold_counter():
    runner = make_runner(case_dir("qwen3_next-hv2"), mode="native")
    assert runner.stats() == {"num_folds": None}
