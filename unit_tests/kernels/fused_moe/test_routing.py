"""softmax_topk / sigmoid_topk (Triton, interpreted on CPU) vs the torch routers of `lightllm.models.layers.moe`."""

from __future__ import annotations

import pytest
import torch

from lightllm.kernels.fused_moe import sigmoid_topk, softmax_topk
from lightllm.models.config import MoEConfig
from lightllm.models.layers.moe import route_sigmoid, route_softmax
from unit_tests.helpers.asserts import assert_rel_close


def _logits(num_tokens: int, num_experts: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k,norm",
    [(1, 8, 2, True), (37, 12, 3, True), (300, 20, 8, False), (5, 6, 6, True)],
    ids=["one-token", "odd-experts", "many-tokens-no-norm", "top_k-is-experts"],
)
def test_softmax_topk_matches_route_softmax(num_tokens, num_experts, top_k, norm):
    logits = _logits(num_tokens, num_experts, seed=num_tokens)
    weights, ids = softmax_topk(logits, top_k, norm)
    ref_w, ref_ids = route_softmax(logits, MoEConfig("softmax", num_experts, top_k, 8, norm_topk_prob=norm))
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), ref_ids)
    assert_rel_close("weights", weights, ref_w, 1e-6)


def test_softmax_topk_fp16_logits():
    logits = _logits(19, 10, seed=3, dtype=torch.float16)
    weights, ids = softmax_topk(logits, 4, True)
    ref_w, ref_ids = route_softmax(logits.float(), MoEConfig("softmax", 10, 4, 8))
    assert torch.equal(ids.long(), ref_ids)
    assert_rel_close("weights", weights, ref_w, 1e-6)


SIGMOID_CASES = [
    # tokens, experts, top_k, groups, top groups, renormalise, scaling
    (1, 8, 2, 1, 1, True, 1.0),
    (41, 16, 4, 4, 2, True, 2.5),
    (300, 24, 6, 8, 3, False, 1.5),
    (7, 6, 6, 1, 1, True, 2.0),
]


@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k,groups,top_groups,norm,scaling",
    SIGMOID_CASES,
    ids=["one-group", "grouped", "grouped-no-norm-many-tokens", "top_k-is-experts"],
)
def test_sigmoid_topk_matches_route_sigmoid(num_tokens, num_experts, top_k, groups, top_groups, norm, scaling):
    logits = _logits(num_tokens, num_experts, seed=num_tokens + 1)
    bias = torch.randn(num_experts, generator=torch.Generator().manual_seed(9)) * 0.3
    cfg = MoEConfig(
        "sigmoid",
        num_experts,
        top_k,
        8,
        norm_topk_prob=norm,
        routed_scaling_factor=scaling,
        num_groups=groups,
        topk_groups=top_groups,
        score_correction_bias=True,
    )
    weights, ids = sigmoid_topk(logits, bias, top_k, norm, scaling, groups, top_groups)
    ref_w, ref_ids = route_sigmoid(logits, bias, cfg)
    assert torch.equal(ids.long(), ref_ids)
    assert_rel_close("weights", weights, ref_w, 1e-6)


def test_sigmoid_topk_uses_the_bias_and_the_groups():
    """Twin: the same logits routed without the bias, or without the group limit, choose other experts."""
    logits = _logits(64, 16, seed=5)
    bias = torch.randn(16, generator=torch.Generator().manual_seed(6))
    _, ids = sigmoid_topk(logits, bias, 4, True, 1.0, 4, 1)
    _, no_bias = sigmoid_topk(logits, torch.zeros(16), 4, True, 1.0, 4, 1)
    _, no_groups = sigmoid_topk(logits, bias, 4, True, 1.0, 1, 1)
    assert not torch.equal(ids, no_bias)
    assert not torch.equal(ids, no_groups)


def test_bad_arguments_raise():
    with pytest.raises(AssertionError, match="top_k"):
        softmax_topk(_logits(3, 4, 0), 5, True)
    with pytest.raises(AssertionError, match="groups"):
        sigmoid_topk(_logits(3, 12, 0), torch.zeros(12), 2, True, 1.0, 5, 1)
