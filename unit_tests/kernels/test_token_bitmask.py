"""kernels/token_bitmask.py: `apply_token_bitmask_triton` (under TRITON_INTERPRET=1 on CPU) and the torch path equal
a reference that reads each token's bit with integer arithmetic, over odd widths with a tail tile, every bit of a
word (the sign bit included) and spare words; a flipped bit changes exactly its token; bad shapes are refused."""

from __future__ import annotations

import pytest
import torch

from lightllm.kernels.token_bitmask import (
    BLOCK_V,
    apply_token_bitmask,
    apply_token_bitmask_torch,
    apply_token_bitmask_triton,
)
from unit_tests.helpers.asserts import poison_


def _inputs(rows: int, vocab: int, spare_words: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen).to(dtype)
    words = (vocab + 31) // 32 + spare_words
    bitmask = torch.randint(-(2**31), 2**31, (rows, words), generator=gen, dtype=torch.int64).to(torch.int32)
    return logits, bitmask


def _reference(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Token v kept when bit v % 32 of word v // 32 is set (int64 shifts, no byte view)."""
    v = torch.arange(logits.shape[1])
    words = bitmask.to(torch.int64)[:, v // 32]
    keep = ((words >> (v % 32)) & 1).bool()
    return torch.where(keep, logits, torch.full_like(logits, float("-inf")))


def _triton(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    return apply_token_bitmask_triton(logits, bitmask, out=poison_(torch.empty_like(logits)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "rows,vocab,spare", [(1, 33, 0), (3, BLOCK_V + 37, 1), (5, 2 * BLOCK_V, 0)], ids=["tiny", "tail-tile", "exact"]
)
@pytest.mark.parametrize(
    "impl", [_triton, apply_token_bitmask_torch, apply_token_bitmask], ids=["triton", "torch", "entry"]
)
def test_masked_logits_equal_the_reference(impl, rows, vocab, spare, dtype):
    logits, bitmask = _inputs(rows, vocab, spare, dtype, seed=rows * 1000 + vocab)
    before = logits.clone()
    out = impl(logits, bitmask)
    expected = _reference(logits, bitmask)
    assert torch.equal(out, expected)
    assert torch.equal(logits, before), "the input logits must be left as they are"
    assert torch.isinf(out).any() and torch.isfinite(out).any()


@pytest.mark.parametrize("impl", [_triton, apply_token_bitmask_torch], ids=["triton", "torch"])
def test_a_flipped_bit_changes_exactly_its_token(impl):
    logits, bitmask = _inputs(2, BLOCK_V + 5, 0, torch.float32, seed=7)
    token = BLOCK_V + 3  # in the tail tile, bit 3 of its word
    broken = bitmask.clone()
    broken[1, token // 32] ^= 1 << (token % 32)
    out, out_broken = impl(logits, bitmask), impl(logits, broken)
    differs = out.ne(out_broken)
    assert differs.sum() == 1 and differs[1, token]


def test_bad_shapes_are_refused():
    logits = torch.randn(2, 70)
    with pytest.raises(ValueError, match="words"):
        apply_token_bitmask(logits, torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask(logits, torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="expected"):
        apply_token_bitmask(logits, torch.zeros(3, 3, dtype=torch.int32))
