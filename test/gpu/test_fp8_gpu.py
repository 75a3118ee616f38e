"""Block-FP8 on a CUDA device: the W8A8 GEMM compiled at Qwen3-Next-80B-A3B's layer shapes and at odd shapes vs
the dequantize-then-matmul reference, a CUDA-graph replay of an FP8 linear, and the fused MoE's FP8 experts at the
served expert shapes vs the per-expert W8A8 loop (`run_experts` over the same Fp8Weight experts)."""

from __future__ import annotations

import pytest
import torch

from lightllm.kernels.fp8 import (
    fp8_block_gemm,
    fp8_block_gemm_reference,
    fp8_block_linear,
    quantize_activation_groups,
    quantize_weight_blocks,
)
from lightllm.kernels.fp8.gemm import CUBLAS_ROWS, cublas_block_gemm
from lightllm.kernels.fused_moe import fused_experts, softmax_topk
from lightllm.kernels.fused_moe.shapes import SERVED_SHAPES
from lightllm.models.layers.moe import run_experts
from lightllm.models.layers.quantized_linear import Fp8Weight
from unit_tests.helpers.asserts import assert_rel_close, poison_, relative_error

pytestmark = pytest.mark.gpu

# (M, N, K): Qwen3-Next-80B-A3B's GDN in_proj and o_proj at prefill and decode sizes, and odd shapes with
# partial 128 x 128 blocks on every edge
GEMM_SHAPES = [(4096, 12352, 2048), (64, 2048, 4096), (1, 8192, 2048), (37, 300, 260), (129, 1000, 1500)]


@pytest.mark.parametrize("m,n,k", GEMM_SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fp8_block_gemm_matches_reference_on_gpu(m, n, k, out_dtype):
    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    x = torch.randn(m, k, device="cuda", generator=gen)
    w = torch.randn(n, k, device="cuda", generator=gen) * torch.rand(n, 1, device="cuda", generator=gen)
    a, a_scale = quantize_activation_groups(x)
    q, scale = quantize_weight_blocks(w)
    # the Triton activation quantization equals the torch one
    a_ref, a_scale_ref = quantize_activation_groups(x, backend="torch")
    assert torch.equal(a.view(torch.uint8), a_ref.view(torch.uint8)) and torch.equal(a_scale, a_scale_ref)
    out = poison_(torch.empty(m, n, device="cuda", dtype=out_dtype))
    fp8_block_gemm(a, a_scale, q, scale, out_dtype, out=out)
    assert_rel_close("fp8 gemm", out, fp8_block_gemm_reference(a, a_scale, q, scale, torch.float64), 5e-3)
    # twin: scales of the wrong layout
    wrong = scale.flip(0).contiguous()
    assert relative_error(fp8_block_gemm(a, a_scale, q, wrong, out_dtype), out) > 0.05


@pytest.mark.parametrize("m", [1, 3, 2049, 4096])
def test_cublas_block_gemm_at_any_row_count(m):
    """The tuned tables route large prefill buckets to cuBLASLt, whose warm-up and serving row counts are
    arbitrary (2049: the warm-up's first count of the 4096 bucket); cuBLASLt itself refuses unaligned ones."""
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, 2048, device="cuda", generator=gen)
    q, scale = quantize_weight_blocks(torch.randn(12352, 2048, device="cuda", generator=gen))
    a, a_scale = quantize_activation_groups(x)
    try:
        out = cublas_block_gemm(
            a,
            a_scale,
            q,
            scale,
            torch.bfloat16,
            (128, 128),
            poison_(torch.empty(m, 12352, device="cuda", dtype=torch.bfloat16)),
        )
    except (RuntimeError, AttributeError, TypeError) as exc:
        if m % CUBLAS_ROWS == 0 and "NOT_SUPPORTED" not in str(exc):
            pytest.skip(f"this torch / CUDA has no block-scaled cuBLASLt FP8: {exc}")
        raise
    assert_rel_close("cublas fp8 gemm", out, fp8_block_gemm_reference(a, a_scale, q, scale, torch.float64), 5e-3)


def test_fp8_linear_replays_in_a_cuda_graph():
    gen = torch.Generator(device="cuda").manual_seed(1)
    w = Fp8Weight.quantize(torch.randn(2048, 4096, device="cuda", generator=gen), (128, 128))
    x = torch.randn(16, 4096, device="cuda", generator=gen, dtype=torch.bfloat16)
    eager = fp8_block_linear(x, w.weight, w.weight_scale_inv)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_block_linear(x, w.weight, w.weight_scale_inv)
    x.copy_(torch.randn(16, 4096, device="cuda", generator=gen, dtype=torch.bfloat16))
    graph.replay()
    assert torch.equal(out, fp8_block_linear(x, w.weight, w.weight_scale_inv))
    assert not torch.equal(out, eager)


@pytest.mark.parametrize("num_tokens", [1, 64, 256])
def test_fp8_fused_experts_match_the_per_expert_loop(num_tokens):
    s = SERVED_SHAPES["qwen3-next-80b-a3b"]
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = torch.randn(num_tokens, s.hidden, device="cuda", generator=gen, dtype=torch.bfloat16)
    gate_up = Fp8Weight.quantize(
        torch.randn(s.num_experts, 2 * s.inter, s.hidden, device="cuda", generator=gen) / s.hidden**0.5, (128, 128)
    )
    down = Fp8Weight.quantize(
        torch.randn(s.num_experts, s.hidden, s.inter, device="cuda", generator=gen) / s.inter**0.5, (128, 128)
    )
    weights, ids = softmax_topk(torch.randn(num_tokens, s.num_experts, device="cuda", generator=gen), s.top_k, True)
    out = fused_experts(
        x,
        gate_up.weight,
        down.weight,
        weights,
        ids,
        block=(128, 128),
        gate_up_scale=gate_up.weight_scale_inv,
        down_scale=down.weight_scale_inv,
    )
    assert_rel_close("fp8 experts", out, run_experts(x.float(), gate_up, down, weights, ids), 2e-2)
