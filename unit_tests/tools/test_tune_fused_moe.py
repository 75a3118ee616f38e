"""lightllm.tools.tune_fused_moe's command line: an unknown shape name is refused with the known ones before any
tuning starts; a known one gets past that check."""

from __future__ import annotations

import pytest
import torch

from lightllm.kernels.fused_moe.shapes import SERVED_SHAPES
from lightllm.tools import tune_fused_moe


def test_an_unknown_shape_is_refused_by_name(capsys):
    with pytest.raises(SystemExit) as exit_info:
        tune_fused_moe.main(["--shapes", "qwen3.5-35b-a3b,no-such-model"])
    assert exit_info.value.code == 2
    assert f"--shapes: unknown no-such-model; choose from {', '.join(SERVED_SHAPES)}" in capsys.readouterr().err


def test_twin_a_known_shape_passes_the_name_check():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the command would tune")
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        tune_fused_moe.main(["--shapes", "qwen3.5-35b-a3b"])
