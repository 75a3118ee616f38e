"""`lightllm.tools.tune_fp8_gemm` on the CPU (Triton's interpreter, tiny shapes): every candidate is checked against
the reference, the chosen ones land in the table file under their M buckets and the kernel's lookup reads them."""

from __future__ import annotations

import json

import pytest
import torch
import triton

from lightllm.kernels.fp8 import configs
from lightllm.kernels.fp8.configs import shape_key
from lightllm.tools import tune_fp8_gemm


def test_tune_table_writes_checked_entries(tmp_path, monkeypatch):
    path = tmp_path / "cpu.json"
    lines = []
    results = tune_fp8_gemm.tune_table(
        {(45, 64): "tiny"}, [5, 40], path, torch.device("cpu"), (32, 32), quick=True, echo=lines.append
    )
    assert [r.m for r in results] == [5, 40] and all(r.err < tune_fp8_gemm.MAX_REL for r in results)
    assert all(r.tried == len(tune_fp8_gemm.candidates(r.m, (32, 32), quick=True)) for r in results)
    entries = json.loads(path.read_text())[triton.__version__][shape_key(45, 64, (32, 32))]
    assert entries == {"8": results[0].config, "64": results[1].config}
    rows = [line for line in lines if line.startswith("| tiny |")]
    assert len(rows) == 2 and rows[0].startswith("| tiny | 5 | 45 | 64 |") and lines[0].startswith("(compiled")
    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)
    configs._table.cache_clear()
    configs.get_config.cache_clear()
    try:
        assert configs.get_config(40, 45, 64, (32, 32), torch.device("cpu")) == results[1].config
    finally:
        configs._table.cache_clear()
        configs.get_config.cache_clear()


def test_a_spent_budget_still_runs_the_first_candidate(tmp_path):
    results = tune_fp8_gemm.tune_table(
        {(45, 64): "tiny"}, [5], tmp_path / "t.json", torch.device("cpu"), (32, 32), budget_s=0, echo=lambda _: None
    )
    assert results[0].tried == 1


def test_refuses_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        tune_fp8_gemm.main(["--m", "8"])


def test_an_unknown_model_is_refused_by_name(capsys):
    with pytest.raises(SystemExit) as exit_info:
        tune_fp8_gemm.main(["--device", "cpu", "--models", "qwen3.5-35b-a3b,no-such-model"])
    assert exit_info.value.code == 2
    assert "--models: unknown no-such-model; choose from qwen3-next-80b-a3b, qwen3.5-35b-a3b" in capsys.readouterr().err


def test_the_cublas_candidate_is_checked_or_skipped():
    """At 128 x 128 blocks the cuBLASLt candidate is tried last: where torch / the device do not offer it, it is
    skipped with its reason; where they do, it had to match the reference to be kept."""
    t = tune_fp8_gemm.tune_shape(130, 256, 5, torch.device("cpu"), (128, 128))
    assert tune_fp8_gemm.candidates(5, (128, 128))[-1] == configs.CUBLAS
    assert t.tried == len(tune_fp8_gemm.candidates(5, (128, 128))) and t.err < tune_fp8_gemm.MAX_REL
    skipped = [r for r in t.failed if r.startswith("cublas: ")]
    # a skipped candidate is never the choice; on this CPU build torch's scaled_mm refuses block scales
    assert t.config != configs.CUBLAS or not skipped
    assert skipped or torch.cuda.is_available()
