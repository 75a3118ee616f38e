"""Every state kernel lowers to sm_90 (H200) machine code at the shapes we serve, checked on the CPU.

The interpreter tests run the kernels' semantics but never their GPU lowering; Triton 3.6 has failed to lower
(`tl.cumsum` over a `[W, 1]` block) or silently miscompiled (a 2-row window block) kernels that pass under the
interpreter. `unit_tests.helpers.sm90_lowering` compiles each kernel with the block sizes its wrapper picks on
CUDA, at the real head shapes and at the tiny test-model shape, through Triton and the bundled ptxas; it runs in a
subprocess because this test session runs Triton as the interpreter.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from unit_tests.helpers.sm90 import PTXAS, run_lowering_module

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="Triton's bundled ptxas is not installed")
def test_every_state_kernel_lowers_to_sm90():
    table = run_lowering_module("unit_tests.helpers.sm90_lowering")
    assert table.count("\n| ") >= 4 * 16, f"too few kernels compiled:\n{table}"


def _sass_mix(*args: str) -> subprocess.CompletedProcess:
    """`test/benchmark/sass_mix_linear_att.py` with `args`, compiled (not interpreted) in a subprocess."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    tool = os.path.join(ROOT, "test", "benchmark", "sass_mix_linear_att.py")
    run = subprocess.run([sys.executable, tool, *args], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="Triton's bundled ptxas is not installed")
def test_sass_mix_attributes_instructions_to_source_lines():
    """`test/benchmark/sass_mix_linear_att.py` (the CPU-side estimate of a kernel change) counts the right things: in
    the replay decode at BV = 64 x 2 warps each thread holds 128 x 64 / 64 = 128 tile elements, so the fold's
    rank-1 updates (two records per loop step) are exactly 128 FFMA each on their source lines, and the two S0
    contractions at least 2 x 128 FFMA."""
    run = _sass_mix("--kernels", "decode", "--shapes", "qwen3-next-tp1", "--configs", "64x2", "--top", "40")
    lines = run.stdout.splitlines()
    header = next(line for line in lines if line.startswith("| kernel"))
    row = next(line for line in lines if line.startswith("| decode"))
    cells = dict(zip([c.strip() for c in header.split("|")[1:-1]], [c.strip() for c in row.split("|")[1:-1]]))
    assert 64 < int(cells["registers"]) <= 255 and int(cells["instructions"]) > 1000, row
    assert int(cells["FFMA"]) >= 2 * 128, row
    fold_updates = [line for line in lines if "b_s += (b_k" in line]
    assert len(fold_updates) == 2 and all("FFMA 128 " in line for line in fold_updates), "\n".join(lines)


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="Triton's bundled ptxas is not installed")
def test_sass_mix_covers_the_serial_kernel_in_both_modes():
    """The serial verify kernel in the tool: at BV = 32 x 2 warps a thread holds 128 x 32 / 64 = 64 tile elements,
    so the shared rank-one update (`add_rank_one`) is 64 FFMA in native (the verify) and 128 in compact (the verify
    and the merge of pending records call the same line)."""
    run = _sass_mix("--kernels", "native,compact", "--shapes", "kimi-linear-tp1", "--configs", "32x2", "--top", "40")
    out = run.stdout.split("| compact |")
    assert len(out) == 2, run.stdout
    rank_one = [[line for line in part.splitlines() if "tl.fma(b_kk, b_uu, b_s)" in line] for part in out]
    assert re.search(r"\[FFMA 64\b", rank_one[0][0]), run.stdout
    assert re.search(r"\[FFMA 128\b", rank_one[1][0]), run.stdout
