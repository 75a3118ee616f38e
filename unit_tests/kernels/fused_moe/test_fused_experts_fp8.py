"""Block-FP8 experts: fused_experts' W8A8 path (Triton, interpreted on CPU) vs run_experts over the same
Fp8Weight experts (per-expert dequantize-then-matmul), at odd sizes with partial scale blocks; the MoE block
loaded with FP8 experts (quantize-at-load) through forward_fused vs forward; twin: transposed expert scales."""

from __future__ import annotations

import pytest
import torch

from lightllm.kernels.fused_moe import fused_experts, softmax_topk
from lightllm.models.layers.moe import run_experts
from lightllm.models.layers.quantized_linear import Fp8Weight
from lightllm.models.quant_config import Fp8Config
from unit_tests.helpers.asserts import assert_rel_close, relative_error
from unit_tests.helpers.launch_keys import launch_keys
from unit_tests.kernels.fused_moe.test_compile_keys import missing
from unit_tests.kernels.fused_moe.test_fused_experts import SMALL, experts
from unit_tests.kernels.fused_moe.test_moe_block import HIDDEN, KIMI, QWEN, build

BLOCK = (16, 16)
# tokens, hidden, inter, experts, top_k: hidden 40 and inter 24 leave partial 16-wide scale blocks
CASES = [(1, 40, 24, 8, 2), (29, 40, 24, 6, 3), (70, 48, 40, 7, 2)]


def fp8_experts(num_experts, hidden, inter, seed):
    gate_up, down = experts(num_experts, hidden, inter, seed, torch.float32)
    return Fp8Weight.quantize(gate_up, BLOCK), Fp8Weight.quantize(down, BLOCK)


def run_fused(x, gate_up: Fp8Weight, down: Fp8Weight, weights, ids, gate_up_scale=None):
    return fused_experts(
        x,
        gate_up.weight,
        down.weight,
        weights,
        ids,
        config=SMALL,
        block=BLOCK,
        gate_up_scale=gate_up.weight_scale_inv if gate_up_scale is None else gate_up_scale,
        down_scale=down.weight_scale_inv,
    )


@pytest.mark.parametrize("num_tokens,hidden,inter,num_experts,top_k", CASES, ids=["T1", "T29", "T70"])
def test_fp8_fused_experts_match_the_per_expert_reference(num_tokens, hidden, inter, num_experts, top_k):
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, generator=gen)
    gate_up, down = fp8_experts(num_experts, hidden, inter, seed=1)
    weights, ids = softmax_topk(torch.randn(num_tokens, num_experts, generator=gen), top_k, True)
    out = run_fused(x, gate_up, down, weights, ids)
    # the same W8A8 math expert by expert; an activation sitting on an fp8 rounding boundary may round the
    # other way after a differently ordered fp32 sum, hence not bit equality
    assert_rel_close("fp8 experts", out, run_experts(x, gate_up, down, weights, ids), 2e-3)
    # and within FP8's error of the unquantized experts
    full = run_experts(x, *experts(num_experts, hidden, inter, 1, torch.float32), weights, ids)
    assert_rel_close("fp8 vs fp32 experts", out, full, 0.08)


def test_twin_with_transposed_expert_scales_fails():
    num_tokens, hidden, inter, num_experts = 29, 48, 24, 6
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(num_tokens, hidden, generator=gen)
    gate_up, down = fp8_experts(num_experts, hidden, inter, seed=2)
    weights, ids = softmax_topk(torch.randn(num_tokens, num_experts, generator=gen), 2, True)
    # gate_up's per-expert grid is 3 x 3: transposed, every scale lands on another block
    wrong = gate_up.weight_scale_inv.transpose(1, 2).contiguous()
    out = run_fused(x, gate_up, down, weights, ids, gate_up_scale=wrong)
    assert relative_error(out, run_experts(x, gate_up, down, weights, ids)) > 0.05


@pytest.mark.parametrize("cfg", [QWEN, KIMI], ids=["qwen-softmax-gated-shared", "kimi-sigmoid-grouped"])
def test_moe_block_with_fp8_experts_fused_matches_forward(cfg):
    """Quantize-at-load experts (and shared expert) in the MoE block: forward_fused vs the CPU forward."""
    moe = build(cfg, seed=7, quant=Fp8Config(BLOCK, in_checkpoint=False))
    assert isinstance(moe.gate_up, Fp8Weight) and isinstance(moe.down, Fp8Weight)
    assert moe.gate_up.block == BLOCK and isinstance(moe.shared.down, Fp8Weight)
    x = torch.randn(29, HIDDEN, generator=torch.Generator().manual_seed(8))
    assert_rel_close("fp8 moe", moe.forward_fused(x), moe(x), 2e-3)


@pytest.mark.parametrize("cfg", [QWEN, KIMI], ids=["qwen", "kimi"])
def test_fp8_moe_layer_warmup_meets_its_forward_keys(cfg):
    """`MoE.warmup_fused` with FP8 experts compiles what `forward_fused` launches (quantization kernels and the
    FP8 grouped GEMMs included); without the activation dtype it runs nothing (the twin)."""
    moe = build(cfg, seed=1, quant=Fp8Config(BLOCK, in_checkpoint=False))
    assert moe.warmup_fused(40) == 0
    with launch_keys() as warmed:
        assert moe.warmup_fused(40, torch.float32) > 0
    with launch_keys() as served:
        for num_tokens in (1, 6, 40):
            moe.forward_fused(torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(num_tokens)))
    assert "fp8_group_quant_kernel" in served.by_kernel and "moe_gate_up_kernel" in served.by_kernel
    assert not missing(served, warmed), missing(served, warmed)
