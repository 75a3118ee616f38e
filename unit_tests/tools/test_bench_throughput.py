"""`python -m lightllm.tools.bench_throughput` on the CPU with the demo model: every request runs to its length,
each mode gets its rows, the JSON result holds what the table prints."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lightllm.server.args import ServerArgs, build_parser, load_server_args
from lightllm.server.engine_process import build_engine
from lightllm.server.runner_factory import DEFAULT_RUNNER_FACTORY
from lightllm.tools import bench_throughput


def test_bench_throughput_runs_every_mode_and_batch(tmp_path, capsys):
    out = tmp_path / "result.json"
    rows = bench_throughput.main(
        [
            "--modes",
            "native,replay",
            "--batch_sizes",
            "1,3",
            "--input_len",
            "9",
            "--output_len",
            "5",
            "--device",
            "cpu",
            "--result_file",
            str(out),
        ]
    )
    assert [(r["mode"], r["batch"]) for r in rows] == [("native", 1), ("native", 3), ("replay", 1), ("replay", 3)]
    for r in rows:
        assert r["output_tokens"] == 5 * r["batch"]
        assert r["output_tok_per_s"] > 0 and r["decode_step_ms"] > 0
        # no GPU: no kernel time, so no split
        assert r["gpu_ms_per_step"] is None and r["host_ms_per_step"] is None
        # plain decode steps stay in flight while the host reads the one before
        assert r["overlapped_share"] > 0
        # the run's wall time split: a decode-only step per token after the prefill's; the others are the prefill
        # and the steps that read back the last tokens once no request is left running
        assert r["decode_steps"] >= 4 and r["other_steps"] >= 1, r
        assert 0 < r["decode_s"] + r["other_s"] <= r["seconds"]
    assert json.loads(out.read_text()) == rows
    table = capsys.readouterr().out
    assert table.count("| replay | 0 | 0 |") == 2
    assert table.count(" decode-only steps of ") == 4
    # every request prefills in the first step here, so every decode-only step runs the whole batch
    assert all(r["decode_rows"] == r["batch"] for r in rows) and "fewer than the batch" not in table
    assert all(r["decode_tok_per_s"] == pytest.approx(r["batch"] * 1000 / r["decode_step_ms"]) for r in rows)


def test_bench_throughput_with_drafts_reports_acceptance(capsys):
    rows = bench_throughput.main(
        [
            "--modes",
            "compact",
            "--batch_sizes",
            "2",
            "--input_len",
            "12",
            "--output_len",
            "6",
            "--device",
            "cpu",
            "--mtp_step",
            "2",
        ]
    )
    assert rows[0]["output_tokens"] == 12
    assert rows[0]["mean_accepted_len"] is not None and 1.0 <= rows[0]["mean_accepted_len"] <= 3.0
    # an eager runner (the CPU without decode and draft buffers) verifies synchronously
    assert rows[0]["overlapped_share"] == 0.0


def test_bench_throughput_simulated_acceptance_sets_the_accepted_length(capsys):
    """MTP 2 on the demo model, whatever its drafts: at P = 1 every draft stays (accepted length 3), at P = 0 none
    (1); every request still runs to its length through the real runner's accept path, and a decode step's tokens
    are the batch times the accepted length."""
    full, none = (
        bench_throughput.main(
            [
                "--modes",
                "replay",
                "--batch_sizes",
                "2",
                "--input_len",
                "10",
                "--output_len",
                "10",
                "--device",
                "cpu",
                "--mtp_step",
                "2",
                "--simulate_acceptance",
                p,
            ]
        )[0]
        for p in ("1", "0")
    )
    assert full["output_tokens"] == none["output_tokens"] == 20
    # ten tokens: the prefill's, then three windows of three
    assert full["mean_accepted_len"] == 3.0 and none["mean_accepted_len"] == 1.0
    assert full["decode_tok_per_s"] == pytest.approx(2 * 3.0 * 1000 / full["decode_step_ms"])
    assert none["decode_tok_per_s"] == pytest.approx(2 * 1000 / none["decode_step_ms"])
    assert full["simulate_acceptance"] == 1.0
    assert "| replay | 2 | 0 | 1 | 2 |" in capsys.readouterr().out


def test_simulate_acceptance_is_a_benchmark_option_only():
    """The server's flags do not know the option (neither the parser nor ServerArgs); the benchmark's parser does
    (the twin: the same check finds it where it exists)."""

    def options(parser):
        return {s for action in parser._actions for s in action.option_strings}

    server = options(build_parser())
    assert not any("accept" in s or "simulat" in s for s in server)
    assert not any("accept" in f.name or "simulat" in f.name for f in dataclasses.fields(ServerArgs))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--simulate_acceptance", "0.7"])
    bench = bench_throughput._parse(["--simulate_acceptance", "0.7"])
    assert bench.simulate_acceptance == 0.7
    with pytest.raises(SystemExit, match="needs drafts"):
        bench_throughput.main(["--simulate_acceptance", "0.5", "--device", "cpu"])


def test_decode_rows_count_the_requests_left_when_prompts_prefill_in_turn():
    """Twin of the whole-batch case: with a 16-token step budget the three 40-token prompts prefill one after
    another, the first request's three tokens come out meanwhile, and the decode-only steps run fewer rows than the
    batch; decode tok/s counts those rows, not the batch."""
    flags = dict(device="cpu", ssm_state_mode="replay", max_running_requests=3, max_req_total_len=48)
    args, info = load_server_args([], max_num_batched_tokens=16, **flags)
    engine = build_engine(args, info, DEFAULT_RUNNER_FACTORY)
    row = bench_throughput.run_batch(engine, 3, 40, 3, info.vocab_size, seed=0)
    assert row["output_tokens"] == 9
    assert 1 <= row["decode_rows"] < 3
    assert row["decode_tok_per_s"] == pytest.approx(row["decode_rows"] * 1000 / row["decode_step_ms"])
