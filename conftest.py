"""Test-session setup shared by `unit_tests/` and `test/`.

Without a CUDA device, Triton kernels can only run in Triton's CPU interpreter. The interpreter is chosen when a
kernel is *defined* (at import of the module holding it), so the flag is set here, before any test module imports
lightllm. On a CUDA machine nothing is set and kernels compile for the GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def triton_bounds_checked():
    """Under the interpreter every Triton launch of every test checks that its loads and stores stay inside the
    launch's tensors (`unit_tests/helpers/bounds_check.py`): the CPU catches what the GPU's allocator hides."""
    if HAS_CUDA:
        yield
        return
    from unit_tests.helpers.bounds_check import bounds_checked

    with bounds_checked():
        yield


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device; none is visible")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# Session fixtures for tiny checkpoints (`tiny_model`, `hf_oracle`, `tiny_arch`, `tiny_arch_dir`).
pytest_plugins = ["unit_tests.helpers.tiny_fixtures"]
