"""RoPE scaling (`rope_scaling` / `rope_parameters`): linear and YaRN frequencies and cos/sin against transformers'
rope init functions, logits of a tiny Qwen3-Next with YaRN against transformers past the original context, YaRN
added as `rope_scaling` beside a transformers 5 `rope_parameters` (Qwen3.5) keeping its theta and partial factor,
and refusals of the types the engine does not implement and of spellings that disagree."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen3NextConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from lightllm.models.config import rope_scaling
from lightllm.models.kimi_linear.config import map_config as kimi_map_config
from lightllm.models.layers.rotary import Rotary
from lightllm.models.qwen3_next.config import qwen_attention
from lightllm.server.model_info import read_model_info
from lightllm.tools.make_tiny_model import tiny_model_dir
from unit_tests.helpers.hf_oracle import HFOracle
from unit_tests.models.drive import make_runner, prefill
from unit_tests.server.live_server import single_threaded_env

HEAD_DIM, PARTIAL, THETA = 64, 0.5, 1_000_000.0
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
CASES = {
    "yarn": YARN,
    "yarn-legacy-type-key": {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096},
    "yarn-betas-no-truncate": {**YARN, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    "yarn-mscale": {**YARN, "mscale": 0.707, "mscale_all_dim": 1.0},
    "yarn-attention-factor": {**YARN, "attention_factor": 1.3},
    "linear": {"rope_type": "linear", "factor": 3.0},
}


def raw_config(rope: dict, spelling: str = "rope_scaling") -> dict:
    return {
        "head_dim": HEAD_DIM,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "partial_rotary_factor": PARTIAL,
        "rope_theta": THETA,
        "max_position_embeddings": 32768,
        spelling: dict(rope),
    }


def transformers_inv_freq(raw: dict) -> tuple[torch.Tensor, float]:
    config = Qwen3NextConfig(**raw)
    return ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config, "cpu")


@pytest.mark.parametrize("spelling", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("case", list(CASES))
def test_frequencies_and_cos_sin_match_transformers(case, spelling):
    raw = raw_config(CASES[case], spelling)
    expected_inv_freq, expected_factor = transformers_inv_freq(raw)
    rotary = Rotary(int(HEAD_DIM * PARTIAL), THETA, "cpu", rope_scaling(raw))
    torch.testing.assert_close(rotary.inv_freq, expected_inv_freq, rtol=1e-6, atol=0)
    assert rotary.attention_factor == pytest.approx(expected_factor, rel=1e-9)
    # positions inside and far past the original context
    positions = torch.tensor([0, 1, 2047, 2048, 2049, 5000, 8191, 30000])
    cos, sin = rotary.cos_sin(positions, torch.float32)
    angles = positions[:, None].float() * expected_inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    torch.testing.assert_close(cos, angles.cos() * expected_factor, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin, angles.sin() * expected_factor, rtol=1e-5, atol=1e-5)


def test_plain_rope_differs_from_yarn_past_the_original_context():
    """The twin: unscaled frequencies must not pass as YaRN's."""
    expected_inv_freq, _ = transformers_inv_freq(raw_config(YARN))
    plain = Rotary(int(HEAD_DIM * PARTIAL), THETA, "cpu", rope_scaling(raw_config({"rope_type": "default"})))
    assert rope_scaling(raw_config({"rope_type": "default"})) is None
    assert not torch.allclose(plain.inv_freq, expected_inv_freq, rtol=1e-3)


@pytest.mark.parametrize("kind", ["dynamic", "longrope", "llama3", "su"])
def test_unsupported_types_are_refused_by_name(kind):
    with pytest.raises(ValueError, match=f"rope_scaling type '{kind}' is not supported"):
        rope_scaling(raw_config({"rope_type": kind, "factor": 2.0}))


def test_disagreeing_spellings_and_bad_fields_are_refused():
    raw = raw_config(YARN)
    raw["rope_parameters"] = {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(ValueError, match="disagree"):
        rope_scaling(raw)
    with pytest.raises(ValueError, match="positive factor"):
        rope_scaling(raw_config({"rope_type": "yarn", "factor": -1, "original_max_position_embeddings": 16}))
    # a default-typed rope_parameters beside a yarn rope_scaling: yarn applies
    raw = raw_config(YARN)
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": THETA}
    assert rope_scaling(raw).rope_type == "yarn"


def test_kimi_rotary_or_biased_mla_is_refused(tmp_path):
    raw = json.loads((tiny_model_dir("kimi_linear") / "config.json").read_text())
    assert kimi_map_config(raw).attention.rotary_dim == 0
    assert kimi_map_config({**raw, "attention_bias": False}).attention.bias is False
    with pytest.raises(ValueError, match="mla_use_nope"):
        kimi_map_config({**raw, "mla_use_nope": False})
    with pytest.raises(ValueError, match="attention_bias"):
        kimi_map_config({**raw, "attention_bias": True})


@pytest.fixture(scope="module")
def yarn_model(tmp_path_factory):
    """The tiny Qwen3-Next with YaRN over an original context of 16 positions (factor 4)."""
    folder = tmp_path_factory.mktemp("yarn") / "qwen3_next"
    shutil.copytree(tiny_model_dir("qwen3_next"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    config["max_position_embeddings"] = 16
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_yarn_context_is_the_factor_times_the_original(yarn_model):
    assert read_model_info(str(yarn_model)).max_position_embeddings == 64
    assert read_model_info(str(tiny_model_dir("qwen3_next"))).max_position_embeddings == 262144


def test_yarn_logits_match_transformers_past_the_original_context(yarn_model):
    ids = torch.randint(0, 470, (57,), generator=torch.Generator().manual_seed(7)).tolist()
    expected = HFOracle(str(yarn_model)).prefill_logits(ids)[0, -1]
    runner = make_runner(str(yarn_model))
    logits = prefill(runner, runner.add_request(), ids)
    err = ((logits - expected).abs().max() / expected.abs().max()).item()
    assert err < 1e-4, f"yarn prefill logits: max relative error {err:.3e}"
    # the twin: the same weights without YaRN must not match
    plain = make_runner(str(tiny_model_dir("qwen3_next")))
    plain_logits = prefill(plain, plain.add_request(), ids)
    assert ((plain_logits - expected).abs().max() / expected.abs().max()).item() > 1e-3


def _dynamic_rope(config: dict) -> None:
    config["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}


def _theta_spelt_twice(config: dict) -> None:
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 2 * config["rope_theta"]}


def _yarn_without_factor(config: dict) -> None:
    config["rope_scaling"] = {"rope_type": "yarn", "original_max_position_embeddings": 16}


@pytest.mark.parametrize(
    "edit,message",
    [
        (_dynamic_rope, "rope_scaling type 'dynamic' is not supported"),
        (_theta_spelt_twice, "rope settings disagree: rope_parameters.rope_theta is "),
        (_yarn_without_factor, "rope_scaling yarn: expected a factor (the context extension), found none"),
    ],
    ids=["dynamic", "theta-disagrees", "yarn-without-factor"],
)
def test_server_refuses_a_bad_rope_config_at_start_up(tmp_path, edit, message):
    folder = tmp_path / "bad-rope"
    shutil.copytree(tiny_model_dir("qwen3_next"), folder)
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    proc = subprocess.run(
        [sys.executable, "-m", "lightllm.server.api_server", "--model_dir", str(folder), "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=120,
        env=single_threaded_env(),
    )
    assert proc.returncode == 2, proc.stderr
    refusals = [line for line in proc.stderr.splitlines() if line.startswith("lightllm: refusing to start: ")]
    assert len(refusals) == 1, proc.stderr
    assert refusals[0].startswith(f"lightllm: refusing to start: {folder / 'config.json'}: {message}"), proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


# Qwen3.5 (transformers 5) keeps theta and the rotated share inside rope_parameters; YaRN may be added beside it
# as a top-level rope_scaling (Qwen's docs spell it so) or inside it
def v5_config(theta: float, yarn_in: str) -> dict:
    raw = raw_config({"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": PARTIAL}, "rope_parameters")
    del raw["rope_theta"], raw["partial_rotary_factor"]
    raw["num_key_value_heads"] = 2
    raw.setdefault(yarn_in, {}).update(YARN)
    return raw


def rotary_of(raw: dict) -> Rotary:
    attention = qwen_attention(raw)
    return Rotary(attention.rotary_dim, attention.rope_theta, "cpu", attention.rope_scaling)


def random_theta(seed: int) -> float:
    # far from the 1e4 default, so that a theta lost between spellings shows
    return float(10 ** torch.empty(()).uniform_(5.0, 7.0, generator=torch.Generator().manual_seed(seed)))


@pytest.mark.parametrize("seed", [1, 2])
def test_yarn_beside_rope_parameters_keeps_their_theta_and_partial_factor(seed):
    theta = random_theta(seed)
    inside, beside = rotary_of(v5_config(theta, "rope_parameters")), rotary_of(v5_config(theta, "rope_scaling"))
    expected_inv_freq, expected_factor = transformers_inv_freq(v5_config(theta, "rope_parameters"))
    assert beside.rotary_dim == inside.rotary_dim == int(HEAD_DIM * PARTIAL)
    torch.testing.assert_close(inside.inv_freq, expected_inv_freq, rtol=1e-6, atol=0)
    assert torch.equal(beside.inv_freq, inside.inv_freq)
    assert beside.attention_factor == inside.attention_factor == pytest.approx(expected_factor, rel=1e-9)
    # the twin: another theta must give other frequencies
    other = rotary_of(v5_config(theta * 1.5, "rope_scaling"))
    assert not torch.allclose(other.inv_freq, expected_inv_freq, rtol=1e-3)


def test_a_field_spelt_twice_must_agree():
    raw = v5_config(THETA, "rope_scaling")
    # the same value written as an int and as a float agrees
    raw["rope_scaling"]["rope_theta"] = int(THETA)
    assert qwen_attention(raw).rope_theta == THETA
    raw["rope_scaling"]["rope_theta"] = THETA / 10
    with pytest.raises(
        ValueError, match=r"rope_parameters\.rope_theta is 1000000\.0, rope_scaling\.rope_theta is 100000\.0"
    ):
        qwen_attention(raw)
    raw = v5_config(THETA, "rope_scaling")
    raw["partial_rotary_factor"] = 1.0
    with pytest.raises(
        ValueError, match=r"rope_parameters\.partial_rotary_factor is 0\.5, partial_rotary_factor is 1\.0"
    ):
        qwen_attention(raw)
    raw["partial_rotary_factor"] = PARTIAL
    assert qwen_attention(raw).rotary_dim == int(HEAD_DIM * PARTIAL)


def test_yarn_without_a_factor_is_refused():
    raw = raw_config({"rope_type": "yarn", "original_max_position_embeddings": 2048})
    with pytest.raises(ValueError, match=r"rope_scaling yarn: expected a factor \(the context extension\), found none"):
        rope_scaling(raw)
    # the twin: the same dict with a factor is YaRN
    raw["rope_scaling"]["factor"] = 2.0
    assert rope_scaling(raw).factor == 2.0


def qwen3_5_variant(tmp_path, name: str, edit) -> str:
    """The tiny Qwen3.5 (theta 1e7, a quarter of each head rotated) with an original context of 16 positions."""
    folder = tmp_path / name
    shutil.copytree(tiny_model_dir("qwen3_5"), folder)
    config = json.loads((folder / "config.json").read_text())
    text = config["text_config"]
    text["max_position_embeddings"] = 16
    edit(text)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_qwen3_5_logits_with_yarn_as_rope_scaling_match_transformers_with_it_inside_rope_parameters(tmp_path):
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    inside = qwen3_5_variant(tmp_path, "inside", lambda text: text["rope_parameters"].update(yarn))
    beside = qwen3_5_variant(tmp_path, "beside", lambda text: text.update(rope_scaling=dict(yarn)))

    def other_theta(text: dict) -> None:
        # the tiny heads rotate two frequencies over 57 positions: a theta near 1e7 barely turns the slow one, so
        # the twin takes the 1e4 default, what a theta lost between spellings would give
        text["rope_parameters"]["rope_theta"] = 1e4
        text["rope_scaling"] = dict(yarn)

    twin = qwen3_5_variant(tmp_path, "other-theta", other_theta)
    rope = json.loads(Path(inside, "config.json").read_text())["text_config"]["rope_parameters"]
    assert rope["rope_theta"] != 1e4 and rope["partial_rotary_factor"] != 1, "the defaults would hide a lost field"
    ids = torch.randint(0, 470, (57,), generator=torch.Generator().manual_seed(11)).tolist()
    # transformers applies YaRN written inside rope_parameters with that dict's theta and partial factor
    expected = HFOracle(inside).prefill_logits(ids)[0, -1]

    def error(model_dir: str) -> float:
        runner = make_runner(model_dir)
        logits = prefill(runner, runner.add_request(), ids)
        return ((logits - expected).abs().max() / expected.abs().max()).item()

    assert error(inside) < 1e-4 and error(beside) < 1e-4
    assert error(twin) > 1e-3
