"""read_model_info with `load_format="dummy"`: a folder with config.json and a tokenizer but no weights is
accepted (and still checked); without dummy it is refused for its missing weights."""

from __future__ import annotations

import shutil

import pytest

from lightllm.server.model_info import read_model_info
from lightllm.tools.make_tiny_model import tiny_model_dir


@pytest.fixture
def weightless_dir(tmp_path):
    source = tiny_model_dir("qwen3_5_moe")
    for path in source.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, tmp_path / path.name)
    return tmp_path


def test_dummy_needs_no_weights(weightless_dir):
    info = read_model_info(str(weightless_dir), "dummy")
    real = read_model_info(str(tiny_model_dir("qwen3_5_moe")))
    assert (info.model_type, info.vocab_size, info.num_mtp_layers) == (real.model_type, real.vocab_size, 1)
    assert info.num_mtp_layers == real.num_mtp_layers


def test_without_dummy_the_missing_weights_are_refused(weightless_dir):
    with pytest.raises(ValueError, match="expected \\*.safetensors weight files"):
        read_model_info(str(weightless_dir))


def test_dummy_still_checks_config_and_tokenizer(weightless_dir):
    (weightless_dir / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="tokenizer"):
        read_model_info(str(weightless_dir), "dummy")
    with pytest.raises(ValueError, match="load_format"):
        read_model_info(str(weightless_dir), "safetensor")
