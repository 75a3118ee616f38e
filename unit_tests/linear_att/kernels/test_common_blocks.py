"""The small-block helpers of `kernels/common.py` that the replay window kernel's "precompute" projection is built
from, under the interpreter against torch: `unit_lower_inverse` ((I + N)^{-1} of a strictly lower triangular block
by repeated squaring), `small_matmul`, and the row stacking / zero padding / unpadding around its tensor-core
products (`stack_rows`, `first_half_rows`; the GPU pads the stacked key/query rows to 16)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from lightllm.linear_att.kernels.common import first_half_rows, small_matmul, stack_rows, unit_lower_inverse


@triton.jit
def _inverse_kernel(n_ptr, x_ptr, inv_ptr, y_ptr, R: tl.constexpr, LOG2_R: tl.constexpr, X: tl.constexpr):
    o_r = tl.arange(0, R)
    o_x = tl.arange(0, X)
    b_n = tl.load(n_ptr + o_r[:, None] * R + o_r[None, :])
    b_x = tl.load(x_ptr + o_r[:, None] * X + o_x[None, :])
    b_inv = unit_lower_inverse(b_n, LOG2_R)
    tl.store(inv_ptr + o_r[:, None] * R + o_r[None, :], b_inv)
    tl.store(y_ptr + o_r[:, None] * X + o_x[None, :], small_matmul(b_inv, b_x))


@pytest.mark.parametrize("R", [1, 2, 4, 8, 16])
def test_unit_lower_inverse_and_small_matmul_match_torch(R):
    gen = torch.Generator().manual_seed(R)
    # entries of the size the window solve sees: beta * (decayed k_hat . k_hat), |.| <= 1
    n = torch.tril(torch.rand(R, R, generator=gen) * 2 - 1, diagonal=-1)
    x = torch.randn(R, 8, generator=gen)
    inv = torch.full((R, R), float("nan"))
    y = torch.full((R, 8), float("nan"))
    _inverse_kernel[(1,)](n, x, inv, y, R=R, LOG2_R=R.bit_length() - 1, X=8)
    want = torch.linalg.inv(torch.eye(R, dtype=torch.float64) + n.double())
    torch.testing.assert_close(inv.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.double(), want @ x.double(), rtol=1e-5, atol=1e-5)


@triton.jit
def _stacked_product_kernel(
    a_ptr, b_ptr, s_ptr, ya_ptr, yb_ptr, R: tl.constexpr, K: tl.constexpr, X: tl.constexpr, PAD: tl.constexpr
):
    o_r = tl.arange(0, R)
    o_k = tl.arange(0, K)
    o_x = tl.arange(0, X)
    b_a = tl.load(a_ptr + o_r[:, None] * K + o_k[None, :])
    b_b = tl.load(b_ptr + o_r[:, None] * K + o_k[None, :])
    b_s = tl.load(s_ptr + o_k[:, None] * X + o_x[None, :])
    b_ab = stack_rows(b_a, b_b)
    for _ in tl.static_range(PAD):
        b_ab = stack_rows(b_ab, tl.zeros_like(b_ab))
    b_y = tl.dot(b_ab, b_s, input_precision="ieee")
    for _ in tl.static_range(PAD):
        b_y = first_half_rows(b_y)
    b_ya, b_yb = tl.split(tl.permute(tl.reshape(b_y, (2, R, X)), (1, 2, 0)))
    tl.store(ya_ptr + o_r[:, None] * X + o_x[None, :], b_ya)
    tl.store(yb_ptr + o_r[:, None] * X + o_x[None, :], b_yb)


@pytest.mark.parametrize(("R", "pad"), [(1, 3), (2, 2), (4, 1), (8, 0)])
def test_stacked_rows_padded_product_unpads_to_each_block(R, pad):
    gen = torch.Generator().manual_seed(10 + R)
    a, b = torch.randn(R, 16, generator=gen), torch.randn(R, 16, generator=gen)
    st = torch.randn(16, 8, generator=gen)
    ya, yb = torch.full((R, 8), float("nan")), torch.full((R, 8), float("nan"))
    _stacked_product_kernel[(1,)](a, b, st, ya, yb, R=R, K=16, X=8, PAD=pad)
    torch.testing.assert_close(ya, a @ st, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(yb, b @ st, rtol=1e-5, atol=1e-5)
