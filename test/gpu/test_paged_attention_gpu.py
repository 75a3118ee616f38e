"""The Triton paged-attention kernel compiled on a CUDA device, at the real models' head dims, vs fp64 softmax."""

from __future__ import annotations

import pytest
import torch
import triton

from lightllm.kernels.paged_attention import paged_attention
from unit_tests.helpers.asserts import assert_rel_close
from unit_tests.kernels.test_paged_attention import reference, scattered_pool

pytestmark = pytest.mark.gpu

# (query heads, key heads, Dk, Dv): Qwen3-Next TP1 gated attention; Kimi-Linear MLA after kv_b_proj expansion
SHAPES = {"qwen3-next": (16, 2, 256, 256), "kimi-mla": (32, 32, 192, 128)}
MAX_REL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_paged_attention_on_gpu_matches_reference(shape, dtype):
    heads, kv_heads, dk, dv = SHAPES[shape]
    # a long prefill chunk after a prefix, a fresh prompt, and verify windows of width 1 and 4 in one launch
    cached, q_lens = [700, 0, 1500, 33], [257, 190, 1, 4]
    k_pool, v_pool, slots = scattered_pool(cached, q_lens, kv_heads, dk, dv, dtype, seed=7)
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(sum(q_lens), heads, dk, generator=gen).to(dtype)
    scale = dk**-0.5
    out = _run_on_cuda(q, k_pool, v_pool, slots, cached, q_lens, scale)
    _assert_rows(shape, out, q, k_pool, v_pool, slots, cached, q_lens, scale, dtype)


# launches with too few programs to fill the GPU, so the context is split (asserted): a 100-token chunk after an
# 8k cached prefix (a prefix-cache hit), and small decode / verify batches over long contexts
SPLIT_ROWS = {"hit-8192+100": ([8192], [100]), "decode-long": ([4000, 20, 900], [1, 4, 1])}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", list(SPLIT_ROWS), ids=list(SPLIT_ROWS))
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_split_context_on_gpu_matches_reference(shape, rows, dtype):
    from lightllm.kernels import paged_attention as kernel

    heads, kv_heads, dk, dv = SHAPES[shape]
    cached, q_lens = SPLIT_ROWS[rows]
    longest = max(c + n for c, n in zip(cached, q_lens))
    tile = kernel._tile(max(q_lens), heads // kv_heads, max(16, triton.next_power_of_2(max(dk, dv))), dtype.itemsize)
    programs = -(-max(q_lens) // tile.bt) * len(q_lens) * kv_heads
    assert kernel.num_context_splits(programs, longest, tile.bn, torch.device("cuda")) > 1
    k_pool, v_pool, slots = scattered_pool(cached, q_lens, kv_heads, dk, dv, dtype, seed=11)
    q = torch.randn(sum(q_lens), heads, dk, generator=torch.Generator().manual_seed(12)).to(dtype)
    out = _run_on_cuda(q, k_pool, v_pool, slots, cached, q_lens, dk**-0.5, max_context_len=longest)
    _assert_rows(shape, out, q, k_pool, v_pool, slots, cached, q_lens, dk**-0.5, dtype)


def _assert_rows(shape, out, q, k_pool, v_pool, slots, cached, q_lens, scale, dtype):
    start = 0
    for i, (c, n) in enumerate(zip(cached, q_lens)):
        expected = reference(q[start : start + n], k_pool[slots[i]], v_pool[slots[i]], c, scale)
        assert_rel_close(f"{shape} row {i}", out[start : start + n].cpu(), expected, MAX_REL[dtype])
        start += n


def _run_on_cuda(q, k_pool, v_pool, slots, cached, q_lens, scale, max_context_len=None):
    table = torch.full((len(slots), max(s.numel() for s in slots) + 3), -1, dtype=torch.int64)
    for i, s in enumerate(slots):
        table[i, : s.numel()] = s
    starts = torch.tensor([0] + q_lens[:-1]).cumsum(0).to(torch.int32)
    lens, prefix = torch.tensor(q_lens, dtype=torch.int32), torch.tensor(cached, dtype=torch.int32)
    dev = "cuda"
    out = torch.full((q.shape[0], q.shape[1], v_pool.shape[-1]), float("nan"), dtype=q.dtype, device=dev)
    args = [t.to(dev) for t in (q, k_pool, v_pool, table, starts, lens, prefix)]
    paged_attention(*args, scale, max(q_lens), out, max_context_len=max_context_len)
    return out


def _compiled_variants(kernel) -> int:
    while not hasattr(kernel, "device_caches"):  # `@triton.heuristics` wraps the JIT function
        kernel = kernel.fn
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


def test_split_counts_share_one_compiled_kernel():
    """The split count is a runtime argument: a serving process that meets counts 2, 3, 5 and 7 (other batch
    sizes, other context bounds) compiles each kernel once for them, not once per count mid-step."""
    from lightllm.kernels import paged_attention as kernel

    heads, kv_heads, dk, dv = SHAPES["qwen3-next"]
    cached, q_lens = [300, 41], [3, 1]
    k_pool, v_pool, slots = scattered_pool(cached, q_lens, kv_heads, dk, dv, torch.bfloat16, seed=13)
    q = torch.randn(sum(q_lens), heads, dk, generator=torch.Generator().manual_seed(14)).bfloat16()
    table = torch.full((2, 310), -1, dtype=torch.int64)
    for i, s in enumerate(slots):
        table[i, : s.numel()] = s
    args = [
        t.cuda()
        for t in (
            q,
            k_pool,
            v_pool,
            table,
            torch.tensor([0, 3]).int(),
            torch.tensor(q_lens).int(),
            torch.tensor(cached).int(),
        )
    ]
    outputs, counts = [], []
    for splits in (2, 3, 5, 7):
        outputs.append(kernel.paged_attention(*args, dk**-0.5, 3, num_splits=splits))
        counts.append(
            (
                _compiled_variants(kernel.paged_attention_kernel),
                _compiled_variants(kernel.paged_attention_combine_kernel),
            )
        )
    assert counts[1:] == counts[:1] * 3, f"compiled variants after each split count: {counts}"
    for out in outputs[1:]:
        assert_rel_close("split counts agree", out.float().cpu(), outputs[0].float().cpu(), 2e-2)
