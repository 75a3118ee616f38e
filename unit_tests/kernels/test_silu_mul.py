"""kernels/silu_mul.py: the Triton kernel (TRITON_INTERPRET=1 on CPU) gives the torch expression `F.silu(gate) * up`
over odd intermediate sizes, one row, many rows, strided rows and rows over several column tiles; in half precision it rounds where
torch rounds (silu rounded, then the product), bit for bit given the same exponential; swapping gate and up breaks
the match; its compile key does not depend on the token count; bad shapes are refused.

bf16 is left to the GPU: the interpreter converts fp32 to bf16 by truncation, not torch's rounding to nearest."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightllm.kernels.silu_mul import silu_mul, silu_mul_torch, silu_mul_triton
from unit_tests.helpers.asserts import poison_
from unit_tests.helpers.launch_keys import launch_keys

SHAPES = [(1, 24, False), (3, 100, False), (37, 300, False), (5, 64, True), (3, 1500, True)]
SHAPE_IDS = ["one-row", "tail-tile", "many-rows", "strided-rows", "strided-two-column-blocks"]


def _inputs(rows: int, inter: int, dtype: torch.dtype, strided: bool, seed: int) -> torch.Tensor:
    """`[rows, 2 * inter]` gate | up, values over silu's whole range; strided: a column slice of a wider tensor."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, 2 * inter + (11 if strided else 0), generator=gen) * 4
    return wide.to(dtype)[:, : 2 * inter]


def _ulps(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """|actual - expected| in units of the last place of `expected` (its dtype's, at its magnitude)."""
    info = torch.finfo(expected.dtype)
    exponent = torch.frexp(expected.double()).exponent
    ulp = (info.eps * torch.pow(2.0, exponent.double() - 1)).clamp_min(info.smallest_normal * info.eps)
    return (actual.double() - expected.double()).abs() / ulp


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("rows,inter,strided", SHAPES, ids=SHAPE_IDS)
def test_kernel_equals_the_torch_expression(dtype, rows, inter, strided):
    """Equal up to the exponential's last fp32 bit (numpy's in the interpreter, Sleef's in torch): in fp16 a silu
    one unit off on a few elements, at most two units of the product after the multiplication."""
    x = _inputs(rows, inter, dtype, strided, seed=rows * 1000 + inter)
    assert x.is_contiguous() != strided
    out = poison_(torch.empty(rows, inter, dtype=dtype))
    y = silu_mul_triton(x, out=out)
    expected = silu_mul_torch(x)
    assert y is out and y.dtype == dtype and torch.isfinite(y).all()
    off = _ulps(y, expected)
    assert off.max() <= (4 if dtype == torch.float32 else 2), f"max {off.max():.1f} ulps off"
    if dtype == torch.float16:
        assert (off > 0).float().mean() < 0.01, f"{int((off > 0).sum())} of {off.numel()} elements off"
    # twin: gate and up swapped is another function
    swapped = torch.cat(x.chunk(2, dim=-1)[::-1], dim=-1)
    assert _ulps(silu_mul_triton(swapped), expected).max() > 1000


def _contract(x: torch.Tensor, rounds_silu: bool) -> torch.Tensor:
    """The docstring's contract in numpy with the interpreter's own exponential: silu in fp32, rounded to the
    dtype (or, the twin, not), times up in fp32, rounded."""
    dt = x.numpy().dtype
    gate, up = (t.numpy().astype(np.float32) for t in x.chunk(2, dim=-1))
    s = gate / (np.float32(1) + np.exp(-gate))
    if rounds_silu:
        s = s.astype(dt).astype(np.float32)
    return torch.from_numpy((s * up).astype(dt))


def test_fp16_rounds_silu_then_the_product():
    """Given the same exponential, the kernel is the two-rounding contract bit for bit; the once-rounded form
    (silu kept in fp32) differs on some elements, so the equality sees where the kernel rounds."""
    x = _inputs(37, 300, torch.float16, strided=True, seed=3)
    y = silu_mul_triton(x)
    assert torch.equal(y, _contract(x, rounds_silu=True))
    assert not torch.equal(y, _contract(x, rounds_silu=False))


def test_entry_runs_torch_on_cpu():
    x = _inputs(4, 48, torch.float32, strided=False, seed=5)
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(silu_mul(x), torch.nn.functional.silu(gate) * up)
    # leading dimensions of the torch path
    assert torch.equal(silu_mul(x.reshape(2, 2, 96)), silu_mul(x).reshape(2, 2, 48))


def test_compile_key_does_not_depend_on_the_token_count():
    with launch_keys() as keys:
        for rows in (1, 2, 3, 16, 17, 37, 256):
            silu_mul_triton(_inputs(rows, 40, torch.float16, strided=False, seed=rows))
    assert keys.varying() == {}
    assert [len(by_const) for by_const in keys.by_kernel.values()] == [1]


def test_bad_shapes_are_refused():
    x = _inputs(2, 8, torch.float32, strided=False, seed=1)
    with pytest.raises(ValueError, match=r"\[T, 2I\]"):
        silu_mul_triton(x[:, :15])
    with pytest.raises(ValueError, match=r"\[T, 2I\]"):
        silu_mul_triton(x.reshape(2, 1, 16))
    with pytest.raises(ValueError, match=r"\[T, 2I\]"):
        silu_mul_triton(x.t())
    with pytest.raises(ValueError, match="out"):
        silu_mul_triton(x, out=torch.empty(2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="out"):
        silu_mul_triton(x, out=torch.empty(8, 2).t())
