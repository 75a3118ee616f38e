"""The router kernels compiled on a CUDA device at the served expert counts against the torch routers of
`lightllm.models.layers.moe` (fp32 on the same device): every token's choice, best first, and its weights.

The kernels' exp / sigmoid round differently from torch's, so two experts whose scores differ by less than
`TIE` may come in either order; every other position must name torch's expert."""

from __future__ import annotations

import pytest
import torch

from lightllm.kernels.fused_moe import sigmoid_topk, softmax_topk
from lightllm.kernels.fused_moe.shapes import SERVED_SHAPES
from lightllm.models.config import MoEConfig
from lightllm.models.layers.moe import route_sigmoid, route_softmax

pytestmark = pytest.mark.gpu

TIE = 1e-5
TOKENS = [1, 5, 8, 9, 64, 255, 256, 300, 1024]


def _logits(num_tokens: int, num_experts: int, seed: int, hot: int | None = None) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, device="cuda", generator=gen) * 2
    if hot is not None:
        logits[:, hot] = logits.max(dim=1).values + 1.0
    return logits


def _assert_choice(name, ids, weights, scores, ref_ids, ref_weights):
    """`scores [T, E]`: what the choice ranks, computed by torch; positions where the kernel and torch differ must
    be near-ties of `scores`."""
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    got = scores.gather(1, ids.long())
    want = scores.gather(1, ref_ids)
    differ = ids.long() != ref_ids
    bad = differ & ((got - want).abs() > TIE * want.abs().clamp_min(1e-3))
    if bad.any():
        row = int(bad.any(dim=1).nonzero()[0])
        raise AssertionError(
            f"{name}: {int(bad.any(dim=1).sum())} of {ids.shape[0]} tokens chose other experts; token {row}: kernel "
            f"{ids[row].tolist()} scored {got[row].tolist()}, torch {ref_ids[row].tolist()} scored {want[row].tolist()}"
        )
    assert all(len(set(r)) == ids.shape[1] for r in ids.tolist()), f"{name}: an expert chosen twice"
    # weights follow the chosen ids (torch's weight of the same expert where near-ties swapped the order)
    ref_by_id = torch.zeros_like(scores).scatter_(1, ref_ids, ref_weights.float())
    expected = torch.where(differ, ref_by_id.gather(1, ids.long()), ref_weights.float())
    assert torch.allclose(weights, expected, rtol=1e-5, atol=1e-6), f"{name}: weights differ from torch's"


@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("name", [n for n, s in SERVED_SHAPES.items() if s.scoring == "softmax"])
@pytest.mark.parametrize("hot", [None, 17], ids=["spread", "hot-expert"])
def test_softmax_topk_on_gpu_matches_torch(name, num_tokens, hot):
    s = SERVED_SHAPES[name]
    logits = _logits(num_tokens, s.num_experts, seed=num_tokens, hot=hot)
    weights, ids = softmax_topk(logits, s.top_k, True)
    ref_w, ref_ids = route_softmax(logits, MoEConfig("softmax", s.num_experts, s.top_k, 8, norm_topk_prob=True))
    _assert_choice(name, ids, weights, torch.softmax(logits, -1), ref_ids, ref_w)
    if hot is not None:
        assert bool((ids[:, 0] == hot).all())


@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("name", [n for n, s in SERVED_SHAPES.items() if s.scoring == "sigmoid"])
def test_sigmoid_topk_on_gpu_matches_torch(name, num_tokens):
    s = SERVED_SHAPES[name]
    logits = _logits(num_tokens, s.num_experts, seed=num_tokens + 1)
    bias = torch.randn(s.num_experts, device="cuda", generator=torch.Generator(device="cuda").manual_seed(9)) * 0.1
    weights, ids = sigmoid_topk(logits, bias, s.top_k, True, 2.446)
    cfg = MoEConfig("sigmoid", s.num_experts, s.top_k, 8, norm_topk_prob=True, routed_scaling_factor=2.446)
    ref_w, ref_ids = route_sigmoid(logits, bias, cfg)
    _assert_choice(name, ids, weights, torch.sigmoid(logits) + bias, ref_ids, ref_w)


def test_a_wrong_choice_is_caught():
    """Twin: torch's own choice with its second and third experts swapped must fail the comparison."""
    s = SERVED_SHAPES["qwen3.5-35b-a3b"]
    logits = _logits(64, s.num_experts, seed=3)
    ref_w, ref_ids = route_softmax(logits, MoEConfig("softmax", s.num_experts, s.top_k, 8, norm_topk_prob=True))
    swapped = ref_ids.clone()
    swapped[:, [1, 2]] = ref_ids[:, [2, 1]]
    with pytest.raises(AssertionError, match="chose other experts"):
        _assert_choice("twin", swapped.int(), ref_w.float(), torch.softmax(logits, -1), ref_ids, ref_w)
