"""The block-FP8 GEMM lowers to sm_90 (H200) machine code without register spills and with its operand loads
multi-buffered, for every configuration the heuristic or the tuner can give (pointer and TMA loads), checked on the
CPU through Triton and its bundled ptxas (the interpreter tests never lower a kernel); a subprocess, because this
session interprets. Twin: a K-tail mask in the loop (the kernel's non-EVEN_K path) is not buffered."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from unit_tests.helpers.sm90 import PTXAS

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _run(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="Triton's bundled ptxas is not installed")
def test_fp8_gemm_lowers_to_sm90_buffered_without_spills():
    run = _run("import sys; from unit_tests.helpers.fp8_sm90_lowering import main; sys.exit(main())")
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr[-3000:]}"
    rows = [line for line in run.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) >= 12 and any("| tma |" in r for r in rows) and any("| pointer |" in r for r in rows)


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="Triton's bundled ptxas is not installed")
def test_a_k_tail_mask_leaves_the_loads_unbuffered():
    code = (
        "from unit_tests.helpers import fp8_sm90_lowering as h\n"
        "from unit_tests.helpers.sm90 import lower_sm90\n"
        "c = {'BLOCK_M': 128, 'BLOCK_N': 128, 'GROUP_M': 8, 'num_warps': 8, 'num_stages': 3, 'TMA': False}\n"
        "types = {'a': '*fp8e4nv', 'w': '*fp8e4nv', 'a_s': '*fp32', 'w_s': '*fp32', 'o': '*bf16', 'M': 'i32',"
        " 'N': 'i32', 'K': 'i32'}\n"
        "k = dict(BLOCK_N_SCALE=128, BM=128, BN=128, BK=128, GROUP_M=8, TMA=False, SCALAR_W_SCALE=True)\n"
        "even = lower_sm90(h.fp8_block_gemm_kernel, {**k, 'EVEN_K': True}, 8, 3, types).metadata.shared\n"
        "tail = lower_sm90(h.fp8_block_gemm_kernel, {**k, 'EVEN_K': False}, 8, 3, types).metadata.shared\n"
        "print(even, tail)\n"
    )
    run = _run(code)
    assert run.returncode == 0, run.stderr[-3000:]
    even, tail = (int(v) for v in run.stdout.split())
    stage_bytes = (128 + 128) * 128
    assert even >= 2 * stage_bytes and tail < 2 * stage_bytes
