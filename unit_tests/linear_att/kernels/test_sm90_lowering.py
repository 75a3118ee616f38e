"""Every state kernel lowers to sm_90 (H200) machine code at the shapes we serve, checked on the CPU.

The interpreter tests run the kernels' semantics but never their GPU lowering; Triton 3.6 has failed to lower
(`tl.cumsum` over a `[W, 1]` block) or silently miscompiled (a 2-row window block) kernels that pass under the
interpreter. `unit_tests.helpers.sm90_lowering` compiles each kernel with the block sizes its wrapper picks on
CUDA, at the real head shapes and at the tiny test-model shape, through Triton and the bundled ptxas; it runs in a
subprocess because this test session runs Triton as the interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from unit_tests.helpers.sm90 import PTXAS

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="Triton's bundled ptxas is not installed")
def test_every_state_kernel_lowers_to_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run(
        [sys.executable, "-m", "unit_tests.helpers.sm90_lowering"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    table = run.stdout
    assert run.returncode == 0, f"{table}\n{run.stderr[-3000:]}"
    assert table.count("\n| ") >= 4 * 16, f"too few kernels compiled:\n{table}"
