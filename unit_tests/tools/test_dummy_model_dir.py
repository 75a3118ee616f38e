"""dummy_model_dir: weightless folders at the released widths that the server accepts with load_format dummy."""

from __future__ import annotations

import pytest

from lightllm.models.registry import load_model_config
from lightllm.server.model_info import read_model_info
from lightllm.tools.dummy_model_dir import make_dummy_model_dir

# preset -> (hidden, layers, experts, top_k, expert intermediate, vocab)
RELEASED = {
    "qwen3-next-80b-a3b": (2048, 48, 512, 10, 512, 151936),
    "qwen3.5-35b-a3b": (2048, 40, 256, 8, 512, 248320),
    "kimi-linear-48b-a3b": (2304, 27, 256, 8, 1024, 163840),
}


@pytest.mark.parametrize("preset", list(RELEASED))
def test_presets_have_the_released_widths(tmp_path, preset):
    out = make_dummy_model_dir(preset, tmp_path / preset)
    assert not list(out.glob("*.safetensors"))
    cfg = load_model_config(out)
    moe = cfg.moe
    assert (cfg.hidden_size, cfg.num_layers, moe.num_experts, moe.top_k, moe.intermediate_size, cfg.vocab_size) == (
        RELEASED[preset]
    )
    info = read_model_info(str(out), "dummy")
    assert info.vocab_size == RELEASED[preset][5]
    with pytest.raises(ValueError, match="safetensors"):
        read_model_info(str(out))


def test_num_layers_cuts_the_depth_and_keeps_the_pattern(tmp_path):
    cfg = load_model_config(make_dummy_model_dir("kimi-linear-48b-a3b", tmp_path, num_layers=4))
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert cfg.ffn_types == ("dense", "moe", "moe", "moe") and cfg.attention.kind == "mla"
    with pytest.raises(ValueError, match="preset"):
        make_dummy_model_dir("qwen3.5-9b", tmp_path)
