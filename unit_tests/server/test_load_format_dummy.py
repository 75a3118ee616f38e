"""read_model_info with `load_format="dummy"`: a folder with config.json and a tokenizer but no weights is
accepted (and still checked); without dummy it is refused for its missing weights."""

from __future__ import annotations

import json
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


def _edit_text_config(model_dir, edit) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    edit(config["text_config"])
    path.write_text(json.dumps(config))


QWEN_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


@pytest.mark.parametrize(
    "edit,message",
    [
        (
            lambda text: text.update(quantization_config={"quant_method": "gptq", "bits": 4}),
            "quantization_config.quant_method 'gptq' is not supported; supported: quant_method fp8",
        ),
        (
            lambda text: text["rope_parameters"].update(rope_type="longrope", factor=2.0),
            "rope_scaling type 'longrope' is not supported",
        ),
    ],
    ids=["gptq", "longrope"],
)
def test_dummy_refuses_what_the_config_asks_and_the_engine_cannot_run(weightless_dir, edit, message):
    """Random weights do not make an unsupported quantization or rope servable: refused from config.json (here
    under Qwen3.5's text_config) by name. The twin: block FP8 in the same place is accepted."""
    _edit_text_config(weightless_dir, edit)
    with pytest.raises(ValueError) as err:
        read_model_info(str(weightless_dir), "dummy")
    assert str(err.value).startswith(f"{weightless_dir / 'config.json'}: {message}")
    _edit_text_config(weightless_dir, lambda text: text.update(quantization_config=QWEN_FP8))
    _edit_text_config(weightless_dir, lambda text: text["rope_parameters"].update(rope_type="default"))
    assert read_model_info(str(weightless_dir), "dummy").vocab_size == 512
