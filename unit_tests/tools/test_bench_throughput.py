"""`python -m lightllm.tools.bench_throughput` on the CPU with the demo model: every request runs to its length,
each mode gets its rows, the JSON result holds what the table prints."""

from __future__ import annotations

import json

from lightllm.tools import bench_throughput


def test_bench_throughput_runs_every_mode_and_batch(tmp_path, capsys):
    out = tmp_path / "result.json"
    rows = bench_throughput.main(
        ["--modes", "native,replay", "--batch_sizes", "1,3", "--input_len", "9", "--output_len", "5",
         "--device", "cpu", "--result_file", str(out)]
    )  # fmt: skip
    assert [(r["mode"], r["batch"]) for r in rows] == [("native", 1), ("native", 3), ("replay", 1), ("replay", 3)]
    for r in rows:
        assert r["output_tokens"] == 5 * r["batch"]
        assert r["output_tok_per_s"] > 0 and r["decode_step_ms"] > 0
        # no GPU: no kernel time, so no split
        assert r["gpu_ms_per_step"] is None and r["host_ms_per_step"] is None
    assert json.loads(out.read_text()) == rows
    table = capsys.readouterr().out
    assert table.count("| replay | 0 | 0 |") == 2
    assert all(r["decode_tok_per_s"] > 0 for r in rows)


def test_bench_throughput_with_drafts_reports_acceptance(capsys):
    rows = bench_throughput.main(
        ["--modes", "compact", "--batch_sizes", "2", "--input_len", "12", "--output_len", "6", "--device", "cpu",
         "--mtp_step", "2"]
    )  # fmt: skip
    assert rows[0]["output_tokens"] == 12
    assert rows[0]["mean_accepted_len"] is not None and 1.0 <= rows[0]["mean_accepted_len"] <= 3.0
