"""SwiGLU's `silu_mul` and GDN's `split_columns` compiled on a CUDA device at the served shapes: bit for bit the torch
expressions they replace (`F.silu(gate) * up` on CUDA in bf16, fp16 and fp32; `split` + `contiguous()`), over
decode and prefill token counts and strided rows, and the same inside a CUDA graph replayed on new inputs."""

from __future__ import annotations

import pytest
import torch

from lightllm.kernels.silu_mul import silu_mul, silu_mul_torch
from lightllm.kernels.split_columns import split_columns, split_columns_torch

pytestmark = pytest.mark.gpu

# Qwen3.5-35B-A3B TP1: shared expert I = 512; a dense FFN of 6144; GDN in_proj parts (q|k|v, z, b, a)
INTERS = [512, 6144]
GDN = (2 * 16 * 128 + 32 * 128, 32 * 128, 32, 32)


def _rows(rows: int, width: int, dtype: torch.dtype, strided: bool, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    extra = 8 if strided else 0
    return (torch.randn(rows, width + extra, device="cuda", generator=gen) * 4).to(dtype)[:, extra:]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("rows", [1, 7, 256, 3000])
@pytest.mark.parametrize("inter", INTERS)
def test_silu_mul_is_the_torch_expression_bit_for_bit(inter, rows, strided, dtype):
    x = _rows(rows, 2 * inter, dtype, strided, seed=rows + inter)
    y = silu_mul(x)
    expected = silu_mul_torch(x)
    diff = (y.float() - expected.float()).abs()
    assert torch.equal(y, expected), f"{int((y != expected).sum())} of {y.numel()} differ, max {diff.max().item()}"


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("rows", [1, 7, 256, 3000])
@pytest.mark.parametrize("sizes", [GDN, GDN[:2], GDN[2:]], ids=["qkvzba", "qkvz", "ba"])
def test_split_columns_is_split_and_contiguous(sizes, rows, strided):
    x = _rows(rows, sum(sizes), torch.bfloat16, strided, seed=rows)
    parts = split_columns(x, sizes)
    assert all(p.is_contiguous() for p in parts)
    assert all(torch.equal(p, q) for p, q in zip(parts, split_columns_torch(x, sizes), strict=True))


def test_both_inside_a_cuda_graph_replay_on_new_inputs():
    x = _rows(256, 2 * 512, torch.bfloat16, False, seed=1)
    w = _rows(256, sum(GDN), torch.bfloat16, False, seed=2)
    silu_mul(x), split_columns(w, GDN)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = silu_mul(x)
        parts = split_columns(w, GDN)
    for seed in (3, 4):
        x.copy_(_rows(256, 2 * 512, torch.bfloat16, False, seed=seed))
        w.copy_(_rows(256, sum(GDN), torch.bfloat16, False, seed=seed + 10))
        graph.replay()
        assert torch.equal(y, silu_mul_torch(x))
        assert all(torch.equal(p, q) for p, q in zip(parts, split_columns_torch(w, GDN)))
