"""`kernels/conv.py` (`ops.causal_conv_decode` / `ops.causal_conv_prefill` with backend="triton") under the
interpreter: against the torch twin, against a direct F.conv1d over each row's stream, and over many MTP rounds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton

from lightllm.linear_att import ops
from lightllm.linear_att.kernels import conv as conv_kernels
from unit_tests.helpers.asserts import assert_rel_close

# odd channel count: one partial channel block
C = 13
NUM_SLOTS = 6
HOLD = NUM_SLOTS - 1
DTYPES = [torch.float32, torch.float16]
# fp16 outputs are rounded once from fp32: half an fp16 ulp, relative
MAX_REL = {torch.float32: 1e-6, torch.float16: 1e-3}


def _dtype_id(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _conv_stream(stream: torch.Tensor, weight, bias) -> torch.Tensor:
    """silu(depthwise conv) over `[n, C]` with no padding: `n - Kc + 1` outputs, one per full window."""
    y = F.conv1d(stream.float().T[None], weight.float()[:, None, :], bias.float(), groups=C)
    return F.silu(y[0].T)


def _params(kc: int, max_width: int, dtype, gen):
    weight, bias = torch.randn(C, kc, generator=gen), torch.randn(C, generator=gen)
    conv = torch.randn(NUM_SLOTS, C, kc - 1 + max_width - 1, generator=gen).to(dtype)
    offset = torch.randint(0, max_width, (NUM_SLOTS,), generator=gen, dtype=torch.int32)
    return weight, bias, conv, offset


@pytest.mark.parametrize("max_width", [1, 2, 4], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("kc", [2, 4], ids=lambda k: f"Kc{k}")
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_causal_conv_decode(dtype, kc, max_width, nan_outputs):
    gen = torch.Generator().manual_seed(100 * kc + max_width)
    weight, bias, conv, offset = _params(kc, max_width, dtype, gen)
    slots = torch.tensor([4, 1, HOLD, 0, 2], dtype=torch.int32)
    # a full row, a zero-width row, the HOLD row, and random widths
    widths = torch.tensor([max_width, 0, 0, *torch.randint(1, max_width + 1, (2,), generator=gen)], dtype=torch.int32)
    x = torch.randn(len(slots), max_width, C, generator=gen).to(dtype)
    before = conv.clone()
    twin_conv = conv.clone()
    y = ops.causal_conv_decode(x, conv, offset, slots, widths, weight, bias, backend="triton")
    y_twin = ops.causal_conv_decode(x, twin_conv, offset, slots, widths, weight, bias, backend="torch")

    assert_rel_close("y vs twin", y, y_twin, MAX_REL[dtype])
    assert torch.equal(conv, twin_conv), "window buffer differs from the twin"
    hl = kc - 1
    for i, (slot, w) in enumerate(zip(slots.tolist(), widths.tolist())):
        assert torch.all(y[i, w:] == 0), f"row {i}: tokens past width {w} must be zero"
        if w == 0:
            assert torch.equal(conv[slot], before[slot]), f"row {i}: a zero-width row wrote slot {slot}"
            continue
        off = int(offset[slot])
        stream = torch.cat([before[slot, :, off : off + hl].T, x[i, :w]])
        assert_rel_close(f"row {i} vs conv1d", y[i, :w], _conv_stream(stream, weight, bias), MAX_REL[dtype])
        expected = before[slot].clone()
        expected[:, : hl - 1 + w] = stream[1:].T
        assert torch.equal(conv[slot], expected), f"row {i}: buffer is not [history[1:] | x_0 .. x_(W-1)]"
    assert torch.equal(conv[3], before[3]), "a slot outside the batch was written"


@pytest.mark.parametrize("kc", [2, 4], ids=lambda k: f"Kc{k}")
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_causal_conv_prefill(dtype, kc, nan_outputs):
    """Varlen rows (empty, shorter than the history, spanning token tiles), mixed initial state, offsets != 0."""
    gen = torch.Generator().manual_seed(7 * kc)
    weight, bias, conv, offset = _params(kc, 3, dtype, gen)
    offset[:] = torch.tensor([1, 2, 0, 2, 1, 1], dtype=torch.int32)
    slots = torch.tensor([3, 0, 4, 1, 2], dtype=torch.int32)
    lengths = [5, 0, 1, 19, 2]
    has = torch.tensor([True, True, False, True, False])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    x = torch.randn(int(cu[-1]), C, generator=gen).to(dtype)
    before = conv.clone()
    twin_conv = conv.clone()
    y = ops.causal_conv_prefill(x, conv, offset, slots, cu, weight, bias, has, backend="triton")
    y_twin = ops.causal_conv_prefill(x, twin_conv, offset, slots, cu, weight, bias, has, backend="torch")

    assert_rel_close("y vs twin", y, y_twin, MAX_REL[dtype])
    assert torch.equal(conv, twin_conv), "window buffer differs from the twin"
    hl = kc - 1
    for i, (slot, n) in enumerate(zip(slots.tolist(), lengths)):
        off = int(offset[slot])
        hist = before[slot, :, off : off + hl].T if has[i] else torch.zeros(hl, C, dtype=dtype)
        stream = torch.cat([hist, x[cu[i] : cu[i + 1]]])
        if n == 0:
            assert torch.equal(conv[slot], before[slot]), f"row {i}: an empty row wrote slot {slot}"
            continue
        assert_rel_close(f"row {i} vs conv1d", y[cu[i] : cu[i + 1]], _conv_stream(stream, weight, bias), MAX_REL[dtype])
        expected = before[slot].clone()
        expected[:, off : off + hl] = stream[-hl:].T
        assert torch.equal(conv[slot], expected), f"row {i}: write-back is not the last Kc - 1 stream elements"
    assert torch.equal(conv[HOLD], before[HOLD]), "a slot outside the batch was written"


@pytest.mark.parametrize("kc", [2, 4], ids=lambda k: f"Kc{k}")
def test_causal_conv_prefill_long_row_over_many_programs(kc, monkeypatch, nan_outputs):
    """A row much longer than the others spreads its token tiles over several programs (a grid-stride loop), the
    histories written by a second launch once every tile has read them: outputs and buffers equal the torch twin
    and a direct conv1d over the stream. Twin: the same rows with one history flag flipped differ."""
    monkeypatch.setattr(conv_kernels, "CONV_PREFILL_TILES_PER_PROGRAM", 1)
    gen = torch.Generator().manual_seed(31 * kc)
    weight, bias, conv, offset = _params(kc, 3, torch.float32, gen)
    slots = torch.tensor([2, 4, 0, 1], dtype=torch.int32)
    lengths = [150, 0, 2, 37]
    has = torch.tensor([True, True, False, True])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    x = torch.randn(int(cu[-1]), C, generator=gen)
    # 150 tokens are 10 tiles: each program of row 0 takes every third one or so
    assert -(-x.shape[0] // (len(lengths) * conv_kernels.CONV_PREFILL_TILE)) >= 3
    before, twin_conv = conv.clone(), conv.clone()
    y = ops.causal_conv_prefill(x, conv, offset, slots, cu, weight, bias, has, backend="triton")
    y_twin = ops.causal_conv_prefill(x, twin_conv, offset, slots, cu, weight, bias, has, backend="torch")
    assert_rel_close("y vs twin", y, y_twin, MAX_REL[torch.float32])
    assert torch.equal(conv, twin_conv), "window buffer differs from the twin"
    hist = before[2, :, offset[2] : offset[2] + kc - 1].T
    stream = torch.cat([hist, x[:150]])
    assert_rel_close("long row vs conv1d", y[:150], _conv_stream(stream, weight, bias), MAX_REL[torch.float32])
    flipped = before.clone()
    y_flipped = ops.causal_conv_prefill(x, flipped, offset, slots, cu, weight, bias, ~has, backend="triton")
    assert not torch.allclose(y_flipped[:150], y[:150])


@pytest.mark.parametrize("max_width", [2, 4], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("kc", [2, 4], ids=lambda k: f"Kc{k}")
def test_multi_round_accept_equals_stream(kc, max_width):
    """Prefill, verify windows of random width (incl. 0), accept a random prefix (`conv_offset = a - 1`), a prefill
    chunk in between: the accepted outputs of each row equal one uninterrupted conv over its stream."""
    gen = torch.Generator().manual_seed(kc * 10 + max_width)
    weight, bias, conv, offset = _params(kc, max_width, torch.float32, gen)
    conv.zero_()
    offset.zero_()
    slots = torch.tensor([2, 0, 4], dtype=torch.int32)
    num_rows = len(slots)
    streams = [torch.randn(120, C, generator=gen) for _ in range(num_rows)]
    pos, outs = [0] * num_rows, [[] for _ in range(num_rows)]

    def prefill(lengths, has_initial):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        x = torch.cat([streams[i][pos[i] : pos[i] + n] for i, n in enumerate(lengths)])
        has = torch.full((num_rows,), has_initial)
        y = ops.causal_conv_prefill(x, conv, offset, slots, cu, weight, bias, has, backend="triton")
        for i, n in enumerate(lengths):
            outs[i].append(y[cu[i] : cu[i + 1]])
            pos[i] += n

    prefill([3, 1, 6], has_initial=False)
    for step in range(14):
        if step == 7:
            prefill([2, 5, 0], has_initial=True)
            continue
        widths = torch.randint(0, max_width + 1, (num_rows,), generator=gen, dtype=torch.int32)
        widths[step % num_rows] = max_width
        accepted = [int(torch.randint(1, w + 1, (1,), generator=gen)) if w else 0 for w in widths.tolist()]
        x = torch.randn(num_rows, max_width, C, generator=gen)
        for i, a in enumerate(accepted):
            x[i, :a] = streams[i][pos[i] : pos[i] + a]
        y = ops.causal_conv_decode(x, conv, offset, slots, widths, weight, bias, backend="triton")
        for i, a in enumerate(accepted):
            if a == 0:
                continue
            outs[i].append(y[i, :a])
            offset[slots[i]] = a - 1
            pos[i] += a
    for i in range(num_rows):
        stream = torch.cat([torch.zeros(kc - 1, C), streams[i][: pos[i]]])
        assert_rel_close(f"row {i}", torch.cat(outs[i]), _conv_stream(stream, weight, bias), 1e-6)


@pytest.mark.parametrize("max_width", [1, 3], ids=lambda w: f"W{w}")
def test_causal_conv_decode_over_several_channel_blocks(max_width):
    """More channels than one decode program holds (`decode_channel_block`: up to 1024), with a partial last block:
    every block reads and rewrites its own channels only."""
    kc = 4
    channels = 2 * conv_kernels.decode_channel_block(1 << 20, triton.next_power_of_2(kc - 1 + max_width)) + 37
    gen = torch.Generator().manual_seed(7 + max_width)
    weight, bias = torch.randn(channels, kc, generator=gen), torch.randn(channels, generator=gen)
    conv = torch.randn(3, channels, kc - 1 + max_width - 1, generator=gen)
    offset = torch.zeros(3, dtype=torch.int32)
    slots, widths = torch.tensor([2, 0], dtype=torch.int32), torch.tensor([max_width, 1], dtype=torch.int32)
    x = torch.randn(2, max_width, channels, generator=gen)
    before, twin = conv.clone(), conv.clone()
    y = ops.causal_conv_decode(x, conv, offset, slots, widths, weight, bias, backend="triton")
    y_twin = ops.causal_conv_decode(x, twin, offset, slots, widths, weight, bias, backend="torch")
    assert_rel_close("y vs twin", y, y_twin, MAX_REL[torch.float32])
    assert torch.equal(conv, twin)
    # twin: the last block's channels broken in the input must change the output there
    x[0, 0, -5:] += 1.0
    y_broken = ops.causal_conv_decode(x, before, offset, slots, widths, weight, bias, backend="triton")
    assert not torch.allclose(y_broken[0, 0, -5:], y[0, 0, -5:])
    assert torch.equal(y_broken[0, 0, :-5], y[0, 0, :-5])
