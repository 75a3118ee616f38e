"""The rotary cos/sin each architecture's model builds from its config.json equal transformers' own rotary module
of that architecture (Qwen3NextRotaryEmbedding, Qwen3.5's and Qwen3.5-MoE's interleaved M-RoPE text module), with
YaRN as Qwen documents it for long context (factor 4 over 262144 positions) at the released head widths, at
positions inside and far past the original context. Kimi-Linear's MLA uses no positions (NoPE): transformers'
model has no rotary module and ours none either."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from transformers import AutoConfig

from lightllm.models.hybrid import HybridModel
from lightllm.models.registry import model_config_from_dict
from lightllm.tools.make_tiny_model import tiny_model_dir
from lightllm.tools.tiny_model.sizes import ARCHS

# transformers' rotary module of each architecture that rotates
ROTARY_MODULES = {
    "qwen3_next": "qwen3_next.modeling_qwen3_next.Qwen3NextRotaryEmbedding",
    "qwen3_5": "qwen3_5.modeling_qwen3_5.Qwen3_5TextRotaryEmbedding",
    "qwen3_5_moe": "qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeTextRotaryEmbedding",
}
NOPE_ARCHS = ("kimi_linear",)
ORIGINAL = 262144
# Qwen's long-context setting for Qwen3-Next and Qwen3.5
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
# the released widths: 256-dim heads with a quarter rotated (32 frequencies, spanning YaRN's ramp)
RELEASED = {"head_dim": 256, "partial_rotary_factor": 0.25, "rope_theta": 10_000_000}
POSITIONS = [0, 1, 4095, ORIGINAL - 1, ORIGINAL, ORIGINAL + 1, 700_000, 4 * ORIGINAL - 1]


def released_config(arch: str, yarn: bool) -> dict:
    """The tiny checkpoint's config.json at the released rope settings, with YaRN where its release docs put it:
    Qwen3-Next's `rope_scaling`, Qwen3.5's `rope_parameters` (beside its mrope_section)."""
    raw = json.loads((tiny_model_dir(arch) / "config.json").read_text())
    text = raw.get("text_config") or raw
    text.update(head_dim=RELEASED["head_dim"], max_position_embeddings=ORIGINAL)
    if "rope_parameters" in text:
        text["rope_parameters"].update(
            mrope_section=[11, 11, 10],
            partial_rotary_factor=RELEASED["partial_rotary_factor"],
            rope_theta=RELEASED["rope_theta"],
        )
        if yarn:
            text["rope_parameters"].update(YARN)
    else:
        text.update(partial_rotary_factor=RELEASED["partial_rotary_factor"], rope_theta=RELEASED["rope_theta"])
        text["rope_scaling"] = dict(YARN) if yarn else None
    return raw


def transformers_cos_sin(arch: str, raw: dict, tmp_path) -> tuple[torch.Tensor, torch.Tensor]:
    folder = tmp_path / arch
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(raw))
    config = AutoConfig.from_pretrained(folder).get_text_config()
    module_path, name = ("transformers.models." + ROTARY_MODULES[arch]).rsplit(".", 1)
    rotary = getattr(importlib.import_module(module_path), name)(config)
    cos, sin = rotary(torch.zeros(1), torch.tensor([POSITIONS]))
    return cos[0], sin[0]


def lightllm_cos_sin(raw: dict) -> tuple[torch.Tensor, torch.Tensor]:
    # the rotary the model's attention layers are built with
    rotary = HybridModel(model_config_from_dict(raw), device="cpu").rotary
    return rotary.cos_sin(torch.tensor(POSITIONS), torch.float32)


def test_every_architecture_is_either_rotary_or_nope():
    assert set(ROTARY_MODULES) | set(NOPE_ARCHS) == set(ARCHS)


@pytest.mark.parametrize("arch", list(ROTARY_MODULES))
def test_yarn_cos_sin_match_transformers_rotary_module(arch, tmp_path):
    raw = released_config(arch, yarn=True)
    expected_cos, expected_sin = transformers_cos_sin(arch, raw, tmp_path)
    cos, sin = lightllm_cos_sin(raw)
    assert cos.shape == expected_cos.shape == (len(POSITIONS), 64)
    # the same fp32 angles: an inverse frequency off by an ulp would show at the far positions
    torch.testing.assert_close(cos, expected_cos, rtol=0, atol=1e-5)
    torch.testing.assert_close(sin, expected_sin, rtol=0, atol=1e-5)
    # the twin: the same config without YaRN gives other angles past the original context (and from the first
    # position on, YaRN's temperature scales every value)
    plain_cos, plain_sin = lightllm_cos_sin(released_config(arch, yarn=False))
    far = [i for i, p in enumerate(POSITIONS) if p > ORIGINAL]
    assert (plain_cos[far] - expected_cos[far]).abs().max() > 0.5
    assert (plain_sin[far] - expected_sin[far]).abs().max() > 0.5


@pytest.mark.parametrize("arch", NOPE_ARCHS)
def test_nope_architecture_has_no_rotary(arch):
    """A rope_scaling in its config changes nothing, here as in transformers."""
    raw = json.loads((tiny_model_dir(arch) / "config.json").read_text())
    raw["rope_scaling"] = dict(YARN)
    assert HybridModel(model_config_from_dict(raw), device="cpu").rotary is None
    module = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
    assert not [name for name in dir(module) if name.endswith("RotaryEmbedding")]
