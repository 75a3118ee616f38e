"""kernels/split_columns.py: the Triton kernel (TRITON_INTERPRET=1 on CPU) copies each column block of `x` into its
own contiguous tensor bit for bit as `split` + `contiguous()` does, for 2, 3 and 4 parts of odd widths (parts
narrower than a tile, parts over several column tiles, an empty part), one row, rows sharing a program and strided
rows, in every dtype; permuted sizes break the match; the compile key does not depend on the token count; bad
shapes are refused."""

from __future__ import annotations

import pytest
import torch

from lightllm.kernels.split_columns import split_columns, split_columns_torch, split_columns_triton
from unit_tests.helpers.asserts import poison_
from unit_tests.helpers.launch_keys import launch_keys

SIZES = {
    "two": (17, 40),
    "three": (100, 3, 29),
    "four-gdn-like": (72, 48, 3, 3),  # conv channels q|k|v, z, b, a of a tiny GDN layer
    "four-wide": (1500, 700, 32, 32),  # parts over several column tiles, with tails
    "empty-part": (5, 0, 9),
}
ROWS = [(1, False), (3, False), (37, False), (5, True), (37, True)]
ROW_IDS = ["one-row", "three-rows", "rows-share-a-program", "strided-rows", "strided-many-rows"]


def _input(rows: int, width: int, dtype: torch.dtype, strided: bool, seed: int) -> torch.Tensor:
    """Fresh random `[rows, width]`; strided: a column slice from the middle of a wider tensor."""
    gen = torch.Generator().manual_seed(seed)
    wide = (torch.randn(rows, width + (13 if strided else 0), generator=gen) * 3).to(dtype)
    return wide[:, 6 : 6 + width] if strided else wide


def _same_parts(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return len(got) == len(want) and all(g.shape == w.shape and torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("rows,strided", ROWS, ids=ROW_IDS)
@pytest.mark.parametrize("sizes", SIZES.values(), ids=SIZES.keys())
def test_parts_equal_split_and_contiguous(sizes, rows, strided, dtype):
    x = _input(rows, sum(sizes), dtype, strided, seed=rows * 31 + len(sizes))
    assert x.is_contiguous() != strided
    outs = [poison_(torch.empty(rows, s, dtype=dtype)) for s in sizes]
    parts = split_columns_triton(x, sizes, outs=outs)
    assert all(p is o and p.is_contiguous() for p, o in zip(parts, outs))
    assert _same_parts(parts, split_columns_torch(x, sizes))
    # twin: the sizes in another order are other parts
    permuted = sizes[1:] + sizes[:1]
    assert permuted != sizes
    assert not _same_parts(split_columns_triton(x, permuted), split_columns_torch(x, sizes))


def test_entry_runs_torch_on_cpu():
    x = _input(4, 30, torch.float32, strided=True, seed=2)
    parts = split_columns(x, [10, 15, 5])
    assert _same_parts(parts, [p.contiguous() for p in x.split([10, 15, 5], dim=-1)])
    assert all(p.is_contiguous() for p in parts)


def test_compile_key_does_not_depend_on_the_token_count():
    sizes = (72, 48, 3, 3)
    with launch_keys() as keys:
        for rows in (1, 2, 3, 16, 17, 37, 256):
            split_columns_triton(_input(rows, sum(sizes), torch.float16, strided=False, seed=rows), sizes)
    assert keys.varying() == {}
    assert [len(by_const) for by_const in keys.by_kernel.values()] == [1]


def test_bad_shapes_are_refused():
    x = _input(3, 12, torch.float32, strided=False, seed=1)
    with pytest.raises(ValueError, match="sum"):
        split_columns_triton(x, (5, 6))
    with pytest.raises(ValueError, match="sum"):
        split_columns_triton(x, (14, -2))
    with pytest.raises(ValueError, match=r"\[T, N\]"):
        split_columns_triton(x.t(), (1, 2))
    with pytest.raises(ValueError, match=r"\[T, N\]"):
        split_columns_triton(x.reshape(3, 2, 6), (3, 3))
    with pytest.raises(ValueError, match="outs"):
        split_columns_triton(x, (5, 7), outs=[torch.empty(3, 5)])
    with pytest.raises(ValueError, match="outs"):
        split_columns_triton(x, (5, 7), outs=[torch.empty(3, 5), torch.empty(3, 7, dtype=torch.float16)])
