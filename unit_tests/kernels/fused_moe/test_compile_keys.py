"""No fused MoE kernel compiles in the middle of serving: the compile keys (`unit_tests.helpers.launch_keys`) of
routing, layout, both GEMMs and the combine depend on the model and the batch bucket's launch configuration only,
and `warmup_fused_moe` meets every key that token counts up to its bound can produce."""

from __future__ import annotations

import pytest
import torch

from lightllm.kernels.fused_moe import fused_experts, sigmoid_topk, softmax_topk
from lightllm.kernels.fused_moe.warmup import warmup_fused_moe
from unit_tests.helpers.launch_keys import LaunchKeys, launch_keys
from unit_tests.kernels.fused_moe import test_moe_block as block

E, INTER, HIDDEN, TOP_K = 8, 16, 16, 2
FIXED = {
    "BLOCK_M": 16,
    "gate_up": {"BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 2},
    "down": {"BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 2},
}


def serve(num_tokens: int, config: dict | None, sigmoid: bool = False) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    gate_up = torch.randn(E, 2 * INTER, HIDDEN, generator=gen)
    down = torch.randn(E, HIDDEN, INTER, generator=gen)
    logits = torch.randn(num_tokens, E, generator=gen)
    if sigmoid:
        weights, ids = sigmoid_topk(logits, torch.zeros(E), TOP_K, True, 1.0, 4, 2)
    else:
        weights, ids = softmax_topk(logits, TOP_K, True)
    shared, gate = torch.randn(num_tokens, HIDDEN, generator=gen), torch.randn(num_tokens, 1, generator=gen)
    fused_experts(x, gate_up, down, weights, ids, shared, gate, config=config)


def scratch_experts() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(99)
    return torch.randn(E, 2 * INTER, HIDDEN, generator=gen), torch.randn(E, HIDDEN, INTER, generator=gen)


def missing(served: LaunchKeys, warmed: LaunchKeys) -> dict[str, int]:
    out = {}
    for kernel, by_const in served.by_kernel.items():
        for const, runtime in by_const.items():
            unmet = runtime - warmed.by_kernel.get(kernel, {}).get(const, set())
            if unmet:
                out[kernel] = out.get(kernel, 0) + len(unmet)
    return out


def test_keys_do_not_depend_on_the_token_count():
    with launch_keys() as keys:
        for num_tokens in (1, 2, 3, 5, 16, 17, 33):
            serve(num_tokens, FIXED)
            serve(num_tokens, FIXED, sigmoid=True)
    assert len(keys.by_kernel) == 8, sorted(keys.by_kernel)
    assert not keys.varying(), keys.varying()
    assert all(len(by_const) == 1 for by_const in keys.by_kernel.values())


def test_warmup_meets_every_key_of_serving():
    with launch_keys() as warmed:
        warmup_fused_moe(*scratch_experts(), TOP_K, 140, shared=True, shared_gate=True)
    with launch_keys() as served:
        for num_tokens in (1, 3, 7, 20, 70, 140):
            serve(num_tokens, None)
    assert not missing(served, warmed), missing(served, warmed)
    # twin: a warm-up bounded below the served counts misses the larger buckets' GEMM variants
    with launch_keys() as short:
        warmup_fused_moe(*scratch_experts(), TOP_K, 8, shared=True, shared_gate=True)
    assert set(missing(served, short)) >= {"moe_gate_up_kernel", "moe_down_kernel"}


@pytest.mark.parametrize("cfg", [block.QWEN, block.KIMI], ids=["qwen", "kimi"])
def test_moe_layer_warmup_meets_its_forward_keys(cfg):
    """`MoE.warmup_fused` (the start-up hook) covers what `MoE.forward_fused` launches, for both routers."""
    moe = block.build(cfg, seed=1)
    with launch_keys() as warmed:
        assert moe.warmup_fused(40) > 0
    with launch_keys() as served:
        for num_tokens in (1, 6, 40):
            moe.forward_fused(
                torch.randn(num_tokens, block.HIDDEN, generator=torch.Generator().manual_seed(num_tokens))
            )
    assert not missing(served, warmed), missing(served, warmed)
