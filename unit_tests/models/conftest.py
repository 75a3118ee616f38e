"""Session-wide tiny checkpoints, transformers oracles and runner factories for the model tests."""

from __future__ import annotations

import pytest

from lightllm.tools.make_tiny_model import tiny_model_dir
from unit_tests.helpers.hf_oracle import HFOracle

# readable id -> (arch, TinySizes overrides); GDN cases cover grouped value heads HV/H = 2 and 4
MODEL_CASES = {
    "qwen3_next-hv2": ("qwen3_next", {}),
    "qwen3_next-hv4": ("qwen3_next", {"linear_num_value_heads": 8}),
    "qwen3_5-hv2": ("qwen3_5", {}),
    "qwen3_5_moe-hv4": ("qwen3_5_moe", {"linear_num_value_heads": 8}),
    "kimi_linear": ("kimi_linear", {}),
}
ARCH_CASES = ("qwen3_next-hv2", "qwen3_5-hv2", "qwen3_5_moe-hv4", "kimi_linear")
MTP_CASES = ("qwen3_next-hv2", "qwen3_5-hv2", "qwen3_5_moe-hv4")

_dirs: dict[str, str] = {}
_oracles: dict[str, HFOracle] = {}


def case_dir(case: str) -> str:
    if case not in _dirs:
        arch, sizes = MODEL_CASES[case]
        _dirs[case] = str(tiny_model_dir(arch, seed=0, **sizes))
    return _dirs[case]


def case_oracle(case: str) -> HFOracle:
    if case not in _oracles:
        _oracles[case] = HFOracle(case_dir(case))
    return _oracles[case]


@pytest.fixture(scope="session")
def tiny():
    """`tiny(case) -> (model_dir, oracle)`, built once per session."""
    return lambda case: (case_dir(case), case_oracle(case))


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every models test module runs on one intra-op thread (see `one_torch_thread`)."""
