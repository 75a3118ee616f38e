"""quant_config.parse_quantization: block-FP8 accepted, every other quantization refused with its name and what is
supported (the server prints the message and exits 2, see unit_tests/server/test_bad_checkpoints.py)."""

from __future__ import annotations

import pytest

from lightllm.models.quant_config import Fp8Config, UnsupportedQuantization, parse_quantization

QWEN_FP8 = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "weight_block_size": [128, 128],
    "activation_scheme": "dynamic",
    "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate"],
}


def test_qwen_block_fp8_is_accepted():
    assert parse_quantization({"quantization_config": QWEN_FP8}) == Fp8Config((128, 128), in_checkpoint=True)
    # Qwen3.5's multimodal layout may keep it under text_config
    nested = {"text_config": {"quantization_config": {**QWEN_FP8, "weight_block_size": [64, 32]}}}
    assert parse_quantization(nested) == Fp8Config((64, 32), in_checkpoint=True)


def test_quantize_at_load_only_when_asked():
    assert parse_quantization({}) is None
    assert parse_quantization({}, "fp8") == Fp8Config((128, 128), in_checkpoint=False)
    # an FP8 checkpoint stays what it is with the flag
    assert parse_quantization({"quantization_config": QWEN_FP8}, "fp8").in_checkpoint
    with pytest.raises(UnsupportedQuantization, match=r"--quantization 'int8' is not supported; choose one of fp8"):
        parse_quantization({}, "int8")


@pytest.mark.parametrize(
    "config,method",
    [
        ({"quant_method": "awq", "bits": 4, "group_size": 128}, "awq"),
        ({"quant_method": "gptq", "bits": 4}, "gptq"),
        ({"quant_method": "compressed-tensors", "config_groups": {}}, "compressed-tensors"),
        ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "modelopt"),
        ({"quant_method": "mxfp4"}, "mxfp4"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
        # written before transformers named the method
        ({"load_in_8bit": True}, "bitsandbytes"),
        ({"quant_method": "fbgemm_fp8"}, "fbgemm_fp8"),
        ({"bits": 4}, "<none>"),
    ],
    ids=[
        "awq",
        "gptq",
        "compressed-tensors",
        "nvfp4",
        "mxfp4",
        "bitsandbytes",
        "bnb-legacy",
        "fbgemm-fp8",
        "no-method",
    ],
)
def test_other_methods_are_refused_by_name(config, method):
    with pytest.raises(UnsupportedQuantization) as err:
        parse_quantization({"quantization_config": config})
    text = str(err.value)
    assert f"quantization_config.quant_method {method!r} is not supported" in text
    assert "supported: quant_method fp8 with fmt e4m3" in text and "lightllm.tools.quantize_fp8" in text
    assert "\n" not in text, "one line"


@pytest.mark.parametrize(
    "change,fragment",
    [
        ({"fmt": "e5m2"}, "fp8 with fmt 'e5m2' is not supported"),
        ({"activation_scheme": "static"}, "activation_scheme 'static' (per-tensor input scales) is not supported"),
        ({"weight_block_size": None}, "fp8 without weight_block_size (per-tensor weight scales)"),
        ({"weight_block_size": [128]}, "weight_block_size [128] is not supported"),
        ({"weight_block_size": [96, 128]}, "weight_block_size [96, 128] is not supported"),
    ],
    ids=["e5m2", "static", "per-tensor", "one-dim-block", "non-power-of-two"],
)
def test_fp8_variants_the_kernels_cannot_run_are_refused(change, fragment):
    config = {k: v for k, v in {**QWEN_FP8, **change}.items() if v is not None}
    with pytest.raises(UnsupportedQuantization) as err:
        parse_quantization({"quantization_config": config})
    assert fragment in str(err.value)
