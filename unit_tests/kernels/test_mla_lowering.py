"""The MLA latent kernel (and the combine kernel at rank 512) lowers to sm_90 machine code without register
spills at Kimi-Linear's TP1 and TP2 shapes and the wrapper's launch shapes (a keys-major tile among them), checked on the CPU through Triton and
its bundled ptxas (the interpreter tests never lower a kernel); a subprocess, because this session interprets."""

from __future__ import annotations

import os

import pytest

from unit_tests.helpers.sm90 import PTXAS, run_lowering_module


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="Triton's bundled ptxas is not installed")
def test_mla_kernels_lower_to_sm90_without_spills():
    out = run_lowering_module("unit_tests.helpers.mla_sm90_lowering")
    # TP1: one tile variant x (split, unsplit) + combine; TP2: two tile variants x 2 + combine; TP1 padded to 64
    # rows: the decode and the two-token tile x 2 + combine; TP1 keys-major: x 2 + combine
    assert out.count("\n| kimi") == 16, out
    # the padded tiles' and the keys-major tile's dots are warpgroup MMAs
    assert out.count("| wgmma |") == 6, out
