"""Block-FP8 Kimi-Linear, written by the test from a bf16 tiny checkpoint with `lightllm.tools.quantize_fp8` at
odd widths (hidden 80 = 2.5 blocks of 32, experts of 40 = 1.25): its router stays unquantized as Qwen's routers do,
the KDA projections, experts, shared experts and MLA's output projection load as the checkpoint's blocks and
scales, MLA's fused query | latent projection holds the checkpoint's values (its latent rows quantized again over
the fused weight's tiles), its kv_b_proj (absorbed in latent space) the checkpoint's blocks times their scales,
partial edge blocks included, and the FP8 model's logits follow the dequantized-weight model's."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from lightllm.models.layers.quantized_linear import Fp8Weight
from lightllm.tools.quantize_fp8 import dequantize_checkpoint, quantize_checkpoint
from unit_tests.models.test_fp8_loading import blockwise_dequantized, load, prompt_logits

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK = (32, 32)
SIZES = dict(hidden_size=80, moe_intermediate_size=40)
ROUTER = "model.layers.1.block_sparse_moe.gate.weight"
# checkpoint name -> the loaded model's tensor (KDA is layer 0 with the dense MLP, MLA layer 3, experts from layer 1)
FP8_MODULES = {
    "model.layers.0.self_attn.o_proj.weight": lambda m: m.layers[0].mixer.o_proj,
    "model.layers.0.mlp.down_proj.weight": lambda m: m.layers[0].ffn.down,
    "model.layers.1.block_sparse_moe.experts.2.w2.weight": lambda m: m.layers[1].ffn.down[2],
    "model.layers.1.block_sparse_moe.shared_experts.down_proj.weight": lambda m: m.layers[1].ffn.shared.down,
    "model.layers.3.self_attn.o_proj.weight": lambda m: m.layers[3].mixer.o_proj,
}
KV_A = "model.layers.3.self_attn.kv_a_proj_with_mqa.weight"
KV_B = "model.layers.3.self_attn.kv_b_proj.weight"


@pytest.fixture(scope="module")
def bf16_dir(tiny_model):
    return tiny_model("kimi_linear", dtype="bfloat16", **SIZES)


@pytest.fixture(scope="module")
def fp8_dir(bf16_dir, tmp_path_factory):
    return quantize_checkpoint(bf16_dir, tmp_path_factory.mktemp("kimi_fp8") / "ckpt", BLOCK)


@pytest.fixture(scope="module")
def fp8_model(fp8_dir):
    return load(fp8_dir)


def test_router_and_its_bias_stay_unquantized(bf16_dir, fp8_dir):
    tensors, source = load_file(fp8_dir / "model.safetensors"), load_file(bf16_dir / "model.safetensors")
    assert tensors[ROUTER].dtype == torch.bfloat16 and ROUTER + "_scale_inv" not in tensors
    assert torch.equal(tensors[ROUTER], source[ROUTER])
    bias = "model.layers.1.block_sparse_moe.gate.e_score_correction_bias"
    assert torch.equal(tensors[bias], source[bias])
    qc = json.loads((fp8_dir / "config.json").read_text())["quantization_config"]
    assert "model.layers.1.block_sparse_moe.gate" in qc["modules_to_not_convert"]
    # the twin: the experts beside it are FP8
    assert tensors["model.layers.1.block_sparse_moe.experts.0.w1.weight"].dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("name", list(FP8_MODULES), ids=["kda-o", "dense-down", "expert-down", "shared-down", "mla-o"])
def test_fp8_weights_are_the_checkpoint_blocks(fp8_dir, fp8_model, name):
    tensors = load_file(fp8_dir / "model.safetensors")
    q, scale = tensors[name], tensors[name + "_scale_inv"]
    w = FP8_MODULES[name](fp8_model)
    assert isinstance(w, Fp8Weight)
    assert torch.equal(w.weight.view(torch.uint8), q.view(torch.uint8))
    torch.testing.assert_close(w.weight_scale_inv, scale, rtol=1e-6, atol=0)
    torch.testing.assert_close(w.dequantize().double(), blockwise_dequantized(q, scale, BLOCK), rtol=1e-6, atol=0)


def test_mla_latent_rows_and_kv_b_are_the_checkpoint_values(fp8_dir, fp8_model):
    """kv_a (40 x 80: kv_lora_rank 32 + rope 8 rows, partial in both dimensions) as the last rows of the FP8 query |
    latent projection, within e4m3's rounding of the checkpoint's dequantized blocks (its 8-row partial block shares
    a tile with nothing else only when the query rows are whole blocks); kv_b_proj dequantized exactly. Twins: the
    scale grids' rows reversed put scales on other tiles."""
    tensors, mla = load_file(fp8_dir / "model.safetensors"), fp8_model.layers[3].mixer
    assert isinstance(mla.q_kv_a, Fp8Weight) and isinstance(mla.o_proj, Fp8Weight)
    kv_a = mla.q_kv_a.dequantize().double()[-40:]
    expected = blockwise_dequantized(tensors[KV_A], tensors[KV_A + "_scale_inv"], BLOCK)
    assert ((kv_a - expected).norm() / expected.norm()).item() < 0.03
    q, scale = tensors[KV_B], tensors[KV_B + "_scale_inv"]
    assert mla.kv_b.dtype == torch.float32
    torch.testing.assert_close(mla.kv_b.double(), blockwise_dequantized(q, scale, BLOCK), rtol=1e-6, atol=0)
    assert scale.shape[0] > 1
    wrong = blockwise_dequantized(q, scale.flip(0), BLOCK)
    assert not torch.allclose(mla.kv_b.double(), wrong, rtol=1e-3, atol=0)
    wrong_kv_a = blockwise_dequantized(tensors[KV_A], tensors[KV_A + "_scale_inv"].flip(0), BLOCK)
    assert ((kv_a - wrong_kv_a).norm() / wrong_kv_a.norm()).item() > 0.03


# W8A8's activation rounding moves the logits of this untrained model about as far as the weights' own rounding
# does (bf16 source against the dequantized weights: ~17% here, twice the tiny Qwen3-Next's, as its KDA gates and
# sigmoid routing amplify any perturbation); never by nothing (a path that skipped the rounding would show)
MAX_OVER_WEIGHT_ROUNDING = 1.5
MIN_LOGITS_REL = 1e-3


def relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm()).item()


def test_fp8_logits_follow_the_dequantized_weight_model(bf16_dir, fp8_dir, tmp_path, tiny_model):
    reference = dequantize_checkpoint(fp8_dir, tmp_path / "dequantized")
    ids = torch.randint(0, 470, (96,), generator=torch.Generator().manual_seed(3))
    actual, expected = prompt_logits(fp8_dir, ids), prompt_logits(reference, ids)
    weight_rounding = relative(prompt_logits(bf16_dir, ids), expected)
    rel = relative(actual, expected)
    assert MIN_LOGITS_REL < rel <= MAX_OVER_WEIGHT_ROUNDING * weight_rounding, (rel, weight_rounding)
    # the twin: another checkpoint of the same shapes is far outside that bound
    other = prompt_logits(tiny_model("kimi_linear", seed=1, dtype="bfloat16", **SIZES), ids)
    assert relative(other, expected) > 4 * MAX_OVER_WEIGHT_ROUNDING * weight_rounding
