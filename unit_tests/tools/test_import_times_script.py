"""`test/gpu/import_times.py` on the CPU: every step gets a row (Triton's driver fails without a GPU and says why),
the two process trees are timed and their `-X importtime` lines kept."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_step_and_both_trees_get_a_row(tmp_path):
    run = subprocess.run(
        [sys.executable, "test/gpu/import_times.py", "--log_dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    rows = dict(re.findall(r"^\| (.+?) \| (.+?) \|$", run.stdout, re.M))
    assert float(rows["import torch"]) > 0.05
    # timed, not skipped (under the Triton interpreter fla's modules import in ~0.05 s)
    assert float(rows["fla's prefill modules (the engine's import)"]) > 0.0
    assert "triton and its driver" in rows
    # the API server's own tree is light (torch comes with the flags' resolution, after the engine's spawn); the
    # engine's holds torch
    assert float(rows["api_server process, interpreter and imports"]) < float(
        rows["engine process, interpreter and imports"]
    )
    engine_tree = (tmp_path / "engine.txt").read_text()
    assert re.search(r"\|\s+torch$", engine_tree, re.M)
    assert not re.search(r"\|\s+torch$", (tmp_path / "api_server.txt").read_text(), re.M)
