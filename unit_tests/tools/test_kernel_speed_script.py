"""`test/gpu/kernel_speed.py --dry_run` on the CPU (Triton's interpreter, tiny shapes): every part runs its checked
sweep, prints its rows and writes its table under `--out` with the keys the kernels look up (and nothing into the
package with `--no_repo_tables`); twin: a part left out writes no table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import triton

from unit_tests.server.live_server import single_threaded_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "test" / "gpu" / "kernel_speed.py"


def _run(out: Path, *args: str) -> str:
    env = {**single_threaded_env(), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(SCRIPT), "--dry_run", "--no_repo_tables", "--out", str(out), *args]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


def test_dry_run_writes_checked_tables(tmp_path):
    stdout = _run(tmp_path)
    tables = {p.parent.name: json.loads(p.read_text())[triton.__version__] for p in tmp_path.glob("tables/*/cpu.json")}
    assert set(tables) == {"fp8_gemm", "mla", "fused_moe"}
    assert set(tables["fp8_gemm"]) == {"N=45,K=64,block=32x32", "N=64,K=96,block=32x32"}
    assert all(set(b) == {"8", "64"} for b in tables["fp8_gemm"].values())
    assert list(tables["mla"]) == ["H=4,C=32,R=8,dtype=float32"]
    assert list(tables["fused_moe"]) == ["E=8,N=24,K=32,top_k=2,dtype=float32"]
    assert set(tables["fused_moe"]["E=8,N=24,K=32,top_k=2,dtype=float32"]) == {"1", "8"}
    # each part's rows: 4 FP8 (2 shapes x 2 M), 2 MLA tiles, 2 MoE buckets; the report holds the same lines
    assert stdout.count("| tiny") == 4 + 2 and stdout.count("| tiny-moe |") == 2
    assert "| decode b3 @70 |" in stdout and "wrong" not in stdout and "failed" not in stdout
    assert (tmp_path / "kernel_speed.md").read_text().strip() == stdout.strip()
    assert not list((ROOT / "lightllm" / "kernels").glob("**/cpu.json"))


def test_a_part_left_out_writes_no_table(tmp_path):
    _run(tmp_path, "--parts", "mla")
    assert [p.parent.name for p in tmp_path.glob("tables/*/cpu.json")] == ["mla"]


def test_skips_cleanly_without_cuda_when_not_a_dry_run(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0 and "no CUDA device; skipped" in run.stdout
    assert not (tmp_path / "tables").exists()
