"""Session-scoped pytest fixtures for tiny checkpoints and their transformers oracles.

Registered for every test through `pytest_plugins` in the root conftest.py, so tests just name them:

    def test_something(tiny_model, hf_oracle):
        model_dir = tiny_model("qwen3_next")                 # built once per session and argument set
        model_dir = tiny_model("kimi_linear", num_layers=5)  # any make_tiny_model size knob
        oracle = hf_oracle(model_dir)                        # HFOracle, loaded once per directory

    def test_every_arch(tiny_arch_dir):                      # parametrized over all four architectures
        ...

and `one_torch_thread` (module scope) runs a module's tiny forwards on one intra-op thread.
"""

from __future__ import annotations

import pytest

from lightllm.tools.tiny_model.sizes import ARCHS


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module's tiny forwards: on a busy 2-core box OpenMP workers spin-waiting for each
    other cost far more than they give (~6x). Use with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """`tiny_model(arch, seed=0, dtype="float32", **sizes) -> Path`, cached in this session's temporary directory."""
    from lightllm.tools.make_tiny_model import tiny_model_dir

    root = tmp_path_factory.mktemp("tiny_models")

    def build(arch: str, seed: int = 0, dtype: str = "float32", **sizes):
        return tiny_model_dir(arch, seed=seed, dtype=dtype, cache_dir=root, **sizes)

    return build


@pytest.fixture(scope="session")
def hf_oracle():
    """`hf_oracle(model_dir) -> HFOracle`, one loaded transformers model per directory for the whole session."""
    from unit_tests.helpers.hf_oracle import HFOracle

    loaded = {}

    def get(model_dir):
        key = str(model_dir)
        if key not in loaded:
            loaded[key] = HFOracle(key)
        return loaded[key]

    return get


@pytest.fixture(params=ARCHS, ids=ARCHS)
def tiny_arch(request) -> str:
    """Each supported architecture name in turn."""
    return request.param


@pytest.fixture
def tiny_arch_dir(tiny_model, tiny_arch):
    """The default tiny checkpoint of each architecture in turn."""
    return tiny_model(tiny_arch)
