"""`lightllm.tools.tune_fla_configs`: merging a new recording into a GPU kind's table (new keys and kernels added,
a recorded key replaces the old choice, the old default kept; a table of other versions replaced), and the refusal
to tune without a GPU."""

from __future__ import annotations

import pytest
import torch

from lightllm.tools.tune_fla_configs import main, merge_tables

VERSIONS = {"fla": "0.6.0", "triton": "3.6.0"}


def _cfg(block: int, warps: int = 4) -> dict:
    return {"kwargs": {"BV": block}, "num_warps": warps, "num_stages": 2}


def _entry(key: list, block: int) -> dict:
    return {"key": key, "config": _cfg(block)}


def test_merge_adds_keys_and_kernels_and_replaces_recorded_keys():
    old_a = {"default": _cfg(32), "by_key": [_entry([16, "bf16"], 32), _entry([32, "bf16"], 64)]}
    new_a = {"default": _cfg(16), "by_key": [_entry([32, "bf16"], 16), _entry([8, "bf16"], 16)]}
    new_b = {"default": _cfg(64), "by_key": [_entry([1], 64)]}
    old = {"versions": VERSIONS, "kernels": {"m:a": old_a}}
    new = {"versions": VERSIONS, "kernels": {"m:a": new_a, "m:b": new_b}}
    merged = merge_tables(old, new)
    a = merged["kernels"]["m:a"]
    assert a["default"] == _cfg(32)
    assert {tuple(e["key"]): e["config"]["kwargs"]["BV"] for e in a["by_key"]} == {
        (16, "bf16"): 32,
        (32, "bf16"): 16,
        (8, "bf16"): 16,
    }
    assert merged["kernels"]["m:b"] == new["kernels"]["m:b"]
    # the recording's capability is kept (a table written before it existed gains it)
    assert "capability" not in merged
    assert merge_tables(old, {**new, "capability": [9, 0]})["capability"] == [9, 0]


def test_merge_replaces_a_table_of_other_versions():
    old = {"versions": {"fla": "0.5.0", "triton": "3.6.0"}, "kernels": {"m:old": {"default": _cfg(32), "by_key": []}}}
    new = {"versions": VERSIONS, "kernels": {"m:a": {"default": _cfg(16), "by_key": []}}}
    assert merge_tables(old, new) == new
    assert merge_tables(None, new) == new


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal applies without a GPU")
def test_refuses_to_tune_without_a_gpu():
    with pytest.raises(SystemExit, match="no CUDA device"):
        main(["--serving_model"])
