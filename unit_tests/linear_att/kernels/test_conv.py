"""causal_conv_decode_triton / causal_conv_prefill_triton under the interpreter vs the torch twin (outputs and the
rewritten window), including offsets != 0, zero-width / zero-length rows and rows without initial state."""

from __future__ import annotations

import pytest
import torch

from lightllm.linear_att.kernels.conv import causal_conv_decode_triton, causal_conv_prefill_triton
from lightllm.linear_att.torch_ops import conv as twin
from unit_tests.helpers.asserts import assert_rel_close

C, KC, NUM_SLOTS = 40, 4, 5


@pytest.mark.parametrize("max_width", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("with_bias", [True, False])
def test_conv_decode_matches_twin(max_width, dtype, with_bias, nan_outputs):
    gen = torch.Generator().manual_seed(max_width)
    conv = torch.randn(NUM_SLOTS, C, KC - 1 + max_width - 1, generator=gen).to(dtype)
    offsets = torch.randint(0, max_width, (NUM_SLOTS,), generator=gen, dtype=torch.int32)
    slots = torch.tensor([2, 4, 0], dtype=torch.int32)
    widths = torch.tensor([max_width, 0, max(1, max_width - 1)], dtype=torch.int32)
    x = torch.randn(3, max_width, C, generator=gen).to(dtype)
    weight = torch.randn(C, KC, generator=gen)
    bias = torch.randn(C, generator=gen) if with_bias else None
    conv_t = conv.clone()
    y = causal_conv_decode_triton(x, conv, offsets, slots, widths, weight, bias)
    y_t = twin.causal_conv_decode(x, conv_t, offsets, slots, widths, weight, bias)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    assert not y.isnan().any()
    assert_rel_close("y", y, y_t, tol)
    assert torch.equal(conv, conv_t), "rewritten window differs from the twin"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_conv_prefill_matches_twin(dtype, nan_outputs):
    gen = torch.Generator().manual_seed(9)
    conv = torch.randn(NUM_SLOTS, C, KC - 1 + 2, generator=gen).to(dtype)
    offsets = torch.tensor([0, 2, 1, 0, 1], dtype=torch.int32)
    slots = torch.tensor([1, 3, 2, 0], dtype=torch.int32)
    lengths = [19, 0, 2, 5]  # a multi-block row, an empty row, a row shorter than the history
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    has_init = torch.tensor([True, True, True, False])
    x = torch.randn(int(cu[-1]), C, generator=gen).to(dtype)
    weight = torch.randn(C, KC, generator=gen)
    bias = torch.randn(C, generator=gen)
    conv_t = conv.clone()
    y = causal_conv_prefill_triton(x, conv, offsets, slots, cu, weight, bias, has_init)
    y_t = twin.causal_conv_prefill(x, conv_t, offsets, slots, cu, weight, bias, has_init)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    assert not y.isnan().any()
    assert_rel_close("y", y, y_t, tol)
    assert torch.equal(conv, conv_t), "written-back history differs from the twin"
