"""The interpreter's bounds check (`unit_tests/helpers/bounds_check.py`, on for every test): an off-by-one mask
is caught on load and on store, a correct one passes, and a slice may not reach into its neighbours."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU interpreter")


@triton.jit
def _copy_kernel(x, y, n, SLACK: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    b = tl.load(x + o, mask=o < n + SLACK, other=0)
    tl.store(y + o, b, mask=o < n)


@triton.jit
def _store_kernel(y, n, SLACK: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(y + o, o.to(tl.float32), mask=o < n + SLACK)


def test_in_bounds_masks_pass():
    x = torch.randn(13)
    y = torch.full((13,), float("nan"))
    _copy_kernel[(1,)](x, y, 13, SLACK=0, BLOCK=16)
    assert torch.equal(x, y)


def test_read_one_past_the_end_is_caught():
    x, y = torch.randn(13), torch.empty(13)
    with pytest.raises(Exception, match="load of 1 element.*byte 52 of 'x'"):
        _copy_kernel[(1,)](x, y, 13, SLACK=1, BLOCK=16)


def test_write_one_past_the_end_is_caught():
    y = torch.empty(13)
    with pytest.raises(Exception, match="store of 1 element.*byte 52 of 'y'"):
        _store_kernel[(1,)](y, 13, SLACK=1, BLOCK=16)


def test_a_slice_may_not_read_its_neighbour():
    base = torch.randn(32)
    x, y = base[:13], torch.empty(13)
    with pytest.raises(Exception, match="load of 1 element"):
        _copy_kernel[(1,)](x, y, 13, SLACK=1, BLOCK=16)
