"""The worker tests build tiny runners: one intra-op thread per module, as in the model tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every worker test module runs on one intra-op thread (see `one_torch_thread`)."""
