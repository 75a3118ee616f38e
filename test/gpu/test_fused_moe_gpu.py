"""The fused MoE compiled on a CUDA device at the served layer shapes vs the per-expert torch loop (fp32, fp64
reference), plus the MoE block's CUDA dispatch and a CUDA-graph replay of the fused path."""

from __future__ import annotations

import pytest
import torch

from lightllm.kernels.fused_moe import fused_experts, sigmoid_topk, softmax_topk
from lightllm.kernels.fused_moe.shapes import SERVED_SHAPES
from lightllm.models.layers.moe import run_experts
from unit_tests.helpers.asserts import assert_rel_close, relative_error

pytestmark = pytest.mark.gpu

MAX_REL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
SHAPES = ["qwen3.5-35b-a3b", "qwen3-next-80b-a3b", "kimi-linear-48b-a3b"]


def layer(name: str, num_tokens: int, dtype: torch.dtype, seed: int = 0):
    s = SERVED_SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(num_tokens, s.hidden, device="cuda", generator=gen).to(dtype)
    gate_up = (torch.randn(s.num_experts, 2 * s.inter, s.hidden, device="cuda", generator=gen) / s.hidden**0.5).to(
        dtype
    )
    down = (torch.randn(s.num_experts, s.hidden, s.inter, device="cuda", generator=gen) / s.inter**0.5).to(dtype)
    logits = torch.randn(num_tokens, s.num_experts, device="cuda", generator=gen)
    if s.scoring == "sigmoid":
        bias = torch.randn(s.num_experts, device="cuda", generator=gen) * 0.1
        weights, ids = sigmoid_topk(logits, bias, s.top_k, True, 2.446)
    else:
        weights, ids = softmax_topk(logits, s.top_k, True)
    return x, gate_up, down, weights, ids


def reference(x, gate_up, down, weights, ids):
    return run_experts(x.double(), gate_up.double(), down.double(), weights.double(), ids.long())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
# 4096 tokens: the prefill class of the heuristic (128-row blocks, wide tiles) in one launch
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 256, 300, 4096])
@pytest.mark.parametrize("name", SHAPES)
def test_fused_experts_on_gpu_matches_loop(name, num_tokens, dtype):
    x, gate_up, down, weights, ids = layer(name, num_tokens, dtype)
    out = fused_experts(x, gate_up, down, weights, ids)
    assert_rel_close(f"{name} T={num_tokens}", out, reference(x, gate_up, down, weights, ids), MAX_REL[dtype])
    assert torch.equal(out, fused_experts(x, gate_up, down, weights, ids)), "two runs differ"


def test_swapped_experts_fail_on_gpu():
    x, gate_up, down, weights, ids = layer("qwen3.5-35b-a3b", 64, torch.float32)
    used = ids.flatten().unique()
    perm = torch.arange(gate_up.shape[0], device="cuda")
    perm[used[0]], perm[used[1]] = used[1], used[0]
    out = fused_experts(x, gate_up[perm].contiguous(), down[perm].contiguous(), weights, ids)
    assert relative_error(out, reference(x, gate_up, down, weights, ids)) > 1e-2


def test_all_tokens_on_one_expert_on_gpu():
    """Expert 17 is every token's first choice (19 blocks of 16 rows, a partial last one); the rest spread out."""
    x, gate_up, down, _, _ = layer("qwen3.5-35b-a3b", 300, torch.bfloat16)
    logits = torch.randn(300, 256, device="cuda")
    logits[:, 17] = logits.max(dim=1).values + 1.0
    weights, ids = softmax_topk(logits, 8, True)
    assert (ids[:, 0] == 17).all()
    out = fused_experts(x, gate_up, down, weights, ids)
    assert_rel_close("one hot expert", out, reference(x, gate_up, down, weights, ids), MAX_REL[torch.bfloat16])


def test_fused_path_replays_in_a_cuda_graph():
    """Routing and experts captured once; replays on new inputs in the same buffers equal eager runs."""
    s = SERVED_SHAPES["qwen3.5-35b-a3b"]
    x, gate_up, down, _, _ = layer(s.name, 64, torch.bfloat16)
    logits = torch.randn(64, s.num_experts, device="cuda")

    def step():
        weights, ids = softmax_topk(logits, s.top_k, True)
        return fused_experts(x, gate_up, down, weights, ids)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x.copy_(torch.randn(x.shape, device="cuda", generator=gen))
        logits.copy_(torch.randn(logits.shape, device="cuda", generator=gen))
        graph.replay()
        assert torch.equal(out, step())
