"""MoE.forward_fused (the CUDA path, interpreted on CPU) vs MoE.forward's CPU path (torch routers + run_experts),
for Qwen's softmax router with a gated shared expert and Kimi's grouped, biased sigmoid router."""

from __future__ import annotations

import pytest
import torch

from lightllm.models.config import MoEConfig
from lightllm.models.layers.moe import MoE
from lightllm.models.loader import CheckpointReader, WeightLoader
from lightllm.models.quant_config import Fp8Config
from lightllm.models.tp import TPInfo
from unit_tests.helpers.asserts import assert_rel_close, relative_error

QWEN = MoEConfig("softmax", 10, 3, 24, shared_intermediate_size=20, shared_expert_gate=True)
KIMI = MoEConfig(
    "sigmoid",
    12,
    4,
    16,
    shared_intermediate_size=32,
    routed_scaling_factor=2.5,
    num_groups=4,
    topk_groups=2,
    score_correction_bias=True,
)
HIDDEN = 40


def build(cfg: MoEConfig, seed: int, dtype=torch.float32, quant: Fp8Config | None = None) -> MoE:
    moe = MoE(cfg, kimi_names=cfg.scoring == "sigmoid")
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        name: torch.randn(*shape, generator=gen) / (shape[-1] ** 0.5 if len(shape) > 1 else 3.0)
        for name, shape in moe.checkpoint_shapes("", HIDDEN).items()
    }
    moe.load(WeightLoader(CheckpointReader(tensors), dtype, "cpu", TPInfo(), quant=quant), "")
    return moe


@pytest.mark.parametrize("cfg", [QWEN, KIMI], ids=["qwen-softmax-gated-shared", "kimi-sigmoid-grouped"])
@pytest.mark.parametrize("num_tokens", [1, 29])
def test_forward_fused_matches_forward(cfg, num_tokens):
    moe = build(cfg, seed=num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(100 + num_tokens))
    assert_rel_close("moe out", moe.forward_fused(x), moe(x), 1e-4)


def test_forward_fused_fp16():
    moe32 = build(QWEN, seed=3)
    moe16 = build(QWEN, seed=3, dtype=torch.float16)
    x = torch.randn(17, HIDDEN, generator=torch.Generator().manual_seed(4))
    assert_rel_close("moe out", moe16.forward_fused(x.half()), moe32(x), 5e-3)


def test_swapped_experts_fail():
    """Twin: swapping two experts' stacked weights changes the fused block's output beyond the tolerance."""
    moe = build(KIMI, seed=5)
    x = torch.randn(29, HIDDEN, generator=torch.Generator().manual_seed(6))
    expected = moe(x)
    perm = torch.arange(KIMI.num_experts)
    perm[0], perm[1] = 1, 0
    moe.gate_up.copy_(moe.gate_up[perm].clone())
    moe.down.copy_(moe.down[perm].clone())
    assert relative_error(moe.forward_fused(x), expected) > 1e-2


def test_the_router_and_the_shared_gate_share_one_gemm():
    """Qwen's router rows and shared-expert gate row are one weight (views of it), read by one GEMM in the fused
    path; twin: a fused weight whose gate row differs from the layer's gate changes the fused block's output."""
    moe = build(QWEN, seed=7)
    both = moe.router_and_gate
    assert both is not None and both.shape == (QWEN.num_experts + 1, HIDDEN)
    assert moe.router.data_ptr() == both.data_ptr() and moe.shared_gate.data_ptr() == both[-1:].data_ptr()
    x = torch.randn(13, HIDDEN, generator=torch.Generator().manual_seed(8))
    expected = moe(x)
    moe.router_and_gate = both.clone()
    moe.router_and_gate[-1] = -both[-1]
    assert relative_error(moe.forward_fused(x), expected) > 1e-2
    # Kimi has no shared-expert gate: nothing to fuse
    assert build(KIMI, seed=9).router_and_gate is None
