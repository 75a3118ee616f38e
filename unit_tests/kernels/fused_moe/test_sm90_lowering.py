"""Every fused MoE kernel lowers to sm_90 (H200) machine code without a register spill, at the served MoE shapes
with the tiles the heuristic picks (and block-FP8 experts), checked on the CPU: the interpreter tests run the
kernels' semantics but never their GPU lowering. `unit_tests.helpers.moe_sm90_lowering` runs in a subprocess
because this test session runs Triton as the interpreter."""

from __future__ import annotations

import os

import pytest

from unit_tests.helpers.sm90 import PTXAS, run_lowering_module


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="Triton's bundled ptxas is not installed")
def test_every_fused_moe_kernel_lowers_to_sm90_without_spills():
    out = run_lowering_module("unit_tests.helpers.moe_sm90_lowering")
    rows = [line for line in out.splitlines() if line.startswith("| ") and "FAILED" not in line]
    for kernel in (
        "softmax_topk",
        "sigmoid_topk",
        "align_count",
        "align_plan",
        "align_scatter",
        "gate_up",
        "down",
        "combine",
        "fp8 gate_up",
        "fp8 down",
    ):
        assert any(f" {kernel}" in row for row in rows), f"{kernel} not compiled:\n{out}"
