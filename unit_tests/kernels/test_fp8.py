"""lightllm.kernels.fp8: block quantization and the W8A8 block GEMM (Triton under the interpreter on CPU) against
the dequantize-then-matmul reference, at odd shapes with partial edge blocks."""

from __future__ import annotations

import math

import pytest
import torch

from lightllm.kernels.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_weight_blocks,
    fp8_block_gemm,
    fp8_block_gemm_reference,
    fp8_block_linear,
    quantize_activation_groups,
    quantize_weight_blocks,
)
from unit_tests.helpers.asserts import assert_rel_close, poison_, relative_error

# (M, N, K, block): tiny odd shapes (partial tiles on both edges, one-row decode) and the real 128 x 128 blocks
SHAPES = [
    pytest.param(5, 45, 71, (32, 32), id="m5-n45-k71-b32"),
    pytest.param(1, 33, 97, (32, 32), id="m1-n33-k97-b32"),
    pytest.param(37, 70, 64, (32, 32), id="m37-n70-k64-b32"),
    pytest.param(3, 300, 260, (128, 128), id="m3-n300-k260-b128"),
]


def weights(n: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # tiles of very different magnitude, so a scale applied to the wrong tile shows
    return torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * torch.rand(1, k, generator=gen) * 4


def test_weight_blocks_scale_each_tile_including_partial_edges():
    n, k, block = 45, 71, (32, 32)
    w = weights(n, k, seed=1)
    q, scale = quantize_weight_blocks(w, block)
    assert q.dtype == FP8_DTYPE and scale.shape == (2, 3)
    for i in range(2):
        for j in range(3):
            tile = w[i * 32 : (i + 1) * 32, j * 32 : (j + 1) * 32]
            # the edge tiles are 13 rows / 7 columns: their scale comes from their own elements
            assert scale[i, j].item() == pytest.approx(tile.abs().max().item() / FP8_MAX, rel=1e-6)
            assert q[i * 32 : (i + 1) * 32, j * 32 : (j + 1) * 32].float().abs().max().item() == FP8_MAX
    # fp8 e4m3 keeps 3 mantissa bits: at most 1/16 relative error per element, ~2-3% RMS
    assert_rel_close("dequantized weight", dequantize_weight_blocks(q, scale, block), w, 0.04)


def test_weight_blocks_stacked_experts_match_one_by_one():
    w = torch.randn(3, 40, 33, generator=torch.Generator().manual_seed(2))
    q, scale = quantize_weight_blocks(w, (16, 16))
    assert scale.shape == (3, 3, 3)
    for e in range(3):
        qe, se = quantize_weight_blocks(w[e], (16, 16))
        assert torch.equal(q[e].view(torch.uint8), qe.view(torch.uint8)) and torch.equal(scale[e], se)


def test_transposed_scales_are_refused_by_shape():
    q, scale = quantize_weight_blocks(weights(45, 71, 3), (32, 32))
    with pytest.raises(ValueError, match=r"needs scales \[2, 3\], found \[3, 2\]"):
        dequantize_weight_blocks(q, scale.T.contiguous(), (32, 32))


@pytest.mark.parametrize("m,k,group", [(7, 71, 32), (1, 300, 128), (19, 16, 16)])
def test_activation_groups_triton_matches_torch(m, k, group):
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)) * 3
    q_ref, s_ref = quantize_activation_groups(x, group, backend="torch")
    q, s = quantize_activation_groups(x, group, backend="triton")
    assert s.shape == (m, math.ceil(k / group))
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


# a group whose largest magnitude is 448 has scale 1, so each value below is its own quotient: exact halfway cases
# between two e4m3 values (normal, both signs, and subnormal), which go to the even neighbour as torch's cast does,
# and a negative value rounding to -0 (the bytes are compared, so the sign of zero counts)
HALFWAY = [448.0, 1.0625, 1.1875, -1.0625, -1.1875, 17.0, 19.0, 2.0**-10, 3 * 2.0**-10, -(5 * 2.0**-10), -(2.0**-12)]
HALFWAY_EVEN = [448.0, 1.0, 1.25, -1.0, -1.25, 16.0, 20.0, 0.0, 2.0**-8, -(2.0**-8), -0.0]


def test_activation_groups_triton_rounds_halfway_cases_to_even():
    x = torch.tensor([HALFWAY + [0.0] * (16 - len(HALFWAY))])
    q, s = quantize_activation_groups(x, 16, backend="triton")
    assert s.item() == 1.0
    assert q.float()[0, : len(HALFWAY)].tolist() == HALFWAY_EVEN
    q_ref, _ = quantize_activation_groups(x, 16, backend="torch")
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    # twin: a hair above the halfway points whose even neighbour is the smaller magnitude rounds to the larger one
    down = [i for i, (v, e) in enumerate(zip(HALFWAY, HALFWAY_EVEN)) if 0 < abs(e) < abs(v)]
    above = x.clone()
    above[0, down] *= 1 + 2.0**-20
    q_above, _ = quantize_activation_groups(above, 16, backend="triton")
    assert all(abs(q_above[0, i].item()) > abs(HALFWAY[i]) for i in down), q_above[0, down]


def quantized_operands(m, n, k, block, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    a, a_scale = quantize_activation_groups(x, block[1], backend="torch")
    w, w_scale = quantize_weight_blocks(weights(n, k, seed + 1), block)
    return a, a_scale, w, w_scale


@pytest.mark.parametrize("m,n,k,block", SHAPES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_fp8_block_gemm_matches_dequantized_reference(m, n, k, block, out_dtype):
    a, a_scale, w, w_scale = quantized_operands(m, n, k, block, seed=m * 1000 + n)
    out = poison_(torch.empty(m, n, dtype=out_dtype))
    fp8_block_gemm(a, a_scale, w, w_scale, out_dtype, block, out=out)
    ref = fp8_block_gemm_reference(a, a_scale, w, w_scale, torch.float64, block)
    assert_rel_close("fp8_block_gemm", out, ref, 1e-6 if out_dtype == torch.float32 else 1e-3)


def test_fp8_block_gemm_tile_wider_than_a_scale_block():
    """A 64-column tile over 32-row scale blocks reads each column's own scale row."""
    a, a_scale, w, w_scale = quantized_operands(19, 150, 71, (32, 32), seed=11)
    config = {"BLOCK_M": 32, "BLOCK_N": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 2, "TMA": False}
    out = fp8_block_gemm(a, a_scale, w, w_scale, torch.float32, (32, 32), config=config)
    ref = fp8_block_gemm_reference(a, a_scale, w, w_scale, torch.float64, (32, 32))
    assert_rel_close("fp8_block_gemm BN 64 > block 32", out, ref, 1e-6)


# (M, N, K, BM, BN, GROUP_M): K a multiple of 16 (descriptors allowed) with partial M, N and K tiles, and K = 71
# (not allowed: the launch falls back to pointer loads)
TMA_CASES = [
    pytest.param(37, 70, 80, 16, 32, 1, id="m37-n70-k80-bn32"),
    pytest.param(19, 150, 96, 32, 64, 2, id="m19-n150-k96-bn64"),
    pytest.param(5, 45, 71, 16, 32, 8, id="m5-n45-k71-fallback"),
]


@pytest.mark.parametrize("m,n,k,bm,bn,group_m", TMA_CASES)
def test_fp8_block_gemm_tensor_descriptor_loads_match_reference(m, n, k, bm, bn, group_m):
    """TMA configurations (operand tiles through tensor descriptors, zero-filled past the edges) equal the
    reference, as do the grouped launch orders; twin: transposed weight scales through the same loads fail."""
    a, a_scale, w, w_scale = quantized_operands(m, n, k, (32, 32), seed=m + n + k)
    config = {"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": group_m, "num_warps": 4, "num_stages": 2, "TMA": True}
    out = poison_(torch.empty(m, n))
    fp8_block_gemm(a, a_scale, w, w_scale, torch.float32, (32, 32), out=out, config=config)
    ref = fp8_block_gemm_reference(a, a_scale, w, w_scale, torch.float64, (32, 32))
    assert_rel_close("fp8_block_gemm TMA", out, ref, 1e-6)
    wrong = w_scale.T.contiguous().view(w_scale.shape)
    assert relative_error(fp8_block_gemm(a, a_scale, w, wrong, torch.float32, (32, 32), config=config), ref) > 0.05


def test_fp8_block_gemm_refuses_a_broken_config():
    a, a_scale, w, w_scale = quantized_operands(5, 45, 71, (32, 32), seed=3)
    with pytest.raises(ValueError, match="needs exactly"):
        fp8_block_gemm(a, a_scale, w, w_scale, torch.float32, (32, 32), config={"BLOCK_M": 16})


@pytest.mark.parametrize("m,n,k,block", SHAPES[:1] + SHAPES[3:])
def test_fp8_block_gemm_twin_with_transposed_scales_fails(m, n, k, block):
    """Twin: the same operands with the weight's scale grid transposed (reshaped back to its shape) must not match."""
    a, a_scale, w, w_scale = quantized_operands(m, n, k, block, seed=m * 1000 + n)
    wrong = w_scale.T.contiguous().view(w_scale.shape)
    out = fp8_block_gemm(a, a_scale, w, wrong, torch.float32, block)
    ref = fp8_block_gemm_reference(a, a_scale, w, w_scale, torch.float64, block)
    assert relative_error(out, ref) > 0.05


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp8_block_linear_close_to_full_precision(backend):
    """End to end: x [2, 3, K] in fp32 through quantization and the GEMM stays within FP8's error of x @ wᵀ."""
    gen = torch.Generator().manual_seed(7)
    x, w, bias = torch.randn(2, 3, 71, generator=gen), weights(45, 71, 8), torch.randn(45, generator=gen)
    q, scale = quantize_weight_blocks(w, (32, 32))
    y = fp8_block_linear(x, q, scale, bias, (32, 32), backend=backend)
    assert y.shape == (2, 3, 45) and y.dtype == torch.float32
    assert_rel_close("fp8 linear vs fp32", y, torch.nn.functional.linear(x, w, bias), 0.06)


def test_warmup_meets_every_launch_key_of_serving_sizes():
    """`warmup_fp8_linears` runs each FP8 projection shape once per launch configuration: the keys of a linear at
    any token count are among its keys (twin: a warm-up at one token count misses the taller tiles)."""
    from lightllm.kernels.fp8.configs import warmup_token_counts
    from lightllm.models.layers.quantized_linear import Fp8Weight, warmup_fp8_linears
    from unit_tests.helpers.launch_keys import launch_keys
    from unit_tests.kernels.fused_moe.test_compile_keys import missing

    model = torch.nn.Module()
    model.a = Fp8Weight.quantize(weights(45, 71, 12), (32, 32))
    model.b = Fp8Weight.quantize(weights(45, 71, 13), (32, 32))
    with launch_keys() as warmed:
        assert warmup_fp8_linears(model, torch.float32, backend="triton") == len(
            warmup_token_counts(45, 71, (32, 32), torch.device("cpu"))
        )
    with launch_keys() as served:
        for tokens in (1, 5, 16, 17, 40, 64, 65, 150):
            fp8_block_linear(
                torch.randn(tokens, 71), model.b.weight, model.b.weight_scale_inv, None, (32, 32), "triton"
            )
    assert not missing(served, warmed), missing(served, warmed)
    with launch_keys() as short:
        fp8_block_linear(torch.randn(1, 71), model.a.weight, model.a.weight_scale_inv, None, (32, 32), "triton")
    assert "fp8_block_gemm_kernel" in missing(served, short)
