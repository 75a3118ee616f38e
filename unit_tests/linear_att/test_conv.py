"""`ops.causal_conv_prefill` / `ops.causal_conv_decode` (torch path) against a plain F.conv1d over the stream,
including the widened MTP window, the accepted offset and untouched padding rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightllm.linear_att import ops
from unit_tests.helpers.asserts import assert_rel_close, poison_

C, KC = 11, 4


def _conv_ref(x_stream: torch.Tensor, weight, bias) -> torch.Tensor:
    """silu(causal depthwise conv) over [T, C] from zero history."""
    y = F.conv1d(F.pad(x_stream.T[None], (KC - 1, 0)), weight[:, None, :], bias, groups=C)
    return F.silu(y[0].T)


def _setup(num_slots, max_width, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight, bias = torch.randn(C, KC, generator=gen), torch.randn(C, generator=gen)
    conv = torch.zeros(num_slots, C, KC - 1 + max_width - 1)
    offset = torch.zeros(num_slots, dtype=torch.int32)
    return gen, weight, bias, conv, offset


@pytest.mark.parametrize("lengths", [[7], [1, 9, 0, 3]], ids=["one_row", "varlen_with_empty"])
def test_prefill_two_chunks_equals_whole(lengths):
    gen, weight, bias, conv, offset = _setup(5, 3)
    slots = torch.tensor([3, 0, 2, 1][: len(lengths)], dtype=torch.int32)
    streams = [torch.randn(2 * n, C, generator=gen) for n in lengths]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    ys = []
    for half in range(2):
        x = torch.cat([s[half * n : (half + 1) * n] for s, n in zip(streams, lengths)])
        has = torch.full((len(lengths),), half == 1)
        ys.append(ops.causal_conv_prefill(x, conv, offset, slots, cu, weight, bias, has, backend="torch"))
    for i, n in enumerate(lengths):
        if n == 0:
            continue
        got = torch.cat([ys[0][cu[i] : cu[i + 1]], ys[1][cu[i] : cu[i + 1]]])
        assert_rel_close(f"row {i}", got, _conv_ref(streams[i], weight, bias), 1e-6)
    assert conv[4].abs().sum() == 0, "a slot outside the batch was written"


@pytest.mark.parametrize("max_width", [1, 2, 4], ids=lambda w: f"wmax{w}")
def test_decode_windows_with_accept_equal_stream(max_width):
    """Verify windows of random width, accept a random prefix, continue: accepted outputs == conv over the stream."""
    gen, weight, bias, conv, offset = _setup(3, max_width, seed=max_width)
    slots = torch.tensor([2, 0], dtype=torch.int32)
    stream = [torch.randn(200, C, generator=gen) for _ in range(2)]
    pos, outs = [0, 0], [[], []]
    # a short prefill first, so the decode starts from a real history
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    x = torch.cat([stream[0][:2], stream[1][:3]])
    y = ops.causal_conv_prefill(x, conv, offset, slots, cu, weight, bias, torch.tensor([False, False]), backend="torch")
    outs[0].append(y[:2])
    outs[1].append(y[2:])
    pos = [2, 3]
    for _ in range(25):
        widths = torch.randint(0, max_width + 1, (2,), generator=gen)
        acc = [int(torch.randint(1, int(w) + 1, (1,), generator=gen)) if w > 0 else 0 for w in widths]
        x = torch.randn(2, max_width, C, generator=gen)
        for i in range(2):
            x[i, : acc[i]] = stream[i][pos[i] : pos[i] + acc[i]]
        before = conv.clone()
        y = poison_(torch.empty(2, max_width, C))
        y = ops.causal_conv_decode(x, conv, offset, slots, widths.int(), weight, bias, backend="torch")
        for i in range(2):
            w = int(widths[i])
            assert torch.all(y[i, w:] == 0), "tokens past the row width must be zero"
            if w == 0:
                assert torch.equal(conv[slots[i]], before[slots[i]]), "a zero-width row wrote its conv window"
                continue
            outs[i].append(y[i, : acc[i]])
            offset[slots[i]] = acc[i] - 1
            pos[i] += acc[i]
        assert torch.equal(conv[1], before[1])
    for i in range(2):
        assert_rel_close(f"row {i}", torch.cat(outs[i]), _conv_ref(stream[i][: pos[i]], weight, bias), 1e-6)


def test_prefill_continues_from_accepted_offset():
    """A prefill chunk after MTP decode reads the history at the accepted offset."""
    gen, weight, bias, conv, offset = _setup(2, 4, seed=5)
    slots = torch.tensor([0], dtype=torch.int32)
    stream = torch.randn(20, C, generator=gen)
    y0 = ops.causal_conv_prefill(
        stream[:4], conv, offset, slots, torch.tensor([0, 4]), weight, bias, torch.tensor([False]), backend="torch"
    )
    x = torch.cat([stream[4:7], torch.randn(1, C, generator=gen)])[None]
    y1 = ops.causal_conv_decode(
        x, conv, offset, slots, torch.tensor([4], dtype=torch.int32), weight, bias, backend="torch"
    )
    offset[0] = 2  # accepted 3 of 4
    y2 = ops.causal_conv_prefill(
        stream[7:20], conv, offset, slots, torch.tensor([0, 13]), weight, bias, torch.tensor([True]), backend="torch"
    )
    got = torch.cat([y0, y1[0, :3], y2])
    assert_rel_close("stream", got, _conv_ref(stream, weight, bias), 1e-6)
