"""Per-slot scalar updates after acceptance: replay cursor / parity / conv offset, native slot index.

One program covers `BLOCK` rows; every row touches only its own slot, so there is no cross-program hazard (slots
of live rows are distinct; padding rows, width 0, write nothing). Runs once per model step after the last layer,
entirely on the device (CUDA-graph safe). It folds exactly the rows the replay decode and
window kernels folded: all three decide with `common.replay_folds`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightllm.linear_att.kernels.common import BATCH_VARYING_ARGS, replay_folds

# rows per program, the same for every batch size: a block sized to the batch would be a new compile (seconds, in
# the middle of a serving step) the first time a batch of a new power-of-two size accepts
ACCEPT_BLOCK = 128


@triton.jit
def accepted_rows(slots, widths, accepted, N, BLOCK: tl.constexpr):
    """The rows of one accept program (`BLOCK` rows of `N`): slot, width and accepted count of each, and the mask
    of those that verified (width > 0; padding rows and the HOLD slot change nothing)."""
    o_n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m_n = o_n < N
    width = tl.load(widths + o_n, mask=m_n, other=0)
    m = m_n & (width > 0)
    slot = tl.load(slots + o_n, mask=m, other=0).to(tl.int64)
    num_acc = tl.load(accepted + o_n, mask=m, other=1)
    return slot, width, num_acc, m


@triton.jit(do_not_specialize=BATCH_VARYING_ARGS)
def replay_accept_kernel(cursor, parity, conv_offset, slots, widths, accepted, N, L: tl.constexpr, BLOCK: tl.constexpr):
    slot, width, num_acc, m = accepted_rows(slots, widths, accepted, N, BLOCK)
    h = tl.load(cursor + slot, mask=m, other=0)
    par = tl.load(parity + slot, mask=m, other=0)
    fold = replay_folds(h, width, L)
    tl.store(cursor + slot, tl.where(fold, num_acc, h + num_acc), mask=m)
    tl.store(parity + slot, tl.where(fold, 1 - par, par), mask=m)
    tl.store(conv_offset + slot, num_acc - 1, mask=m)


def replay_accept_triton(cursor, parity, conv_offset, slots, widths, accepted, replay_capacity: int) -> None:
    """Advance replay cursors after acceptance (see `ops.replay_accept`).

    cursor, parity, conv_offset `[S]` int32, in place; slots, widths, accepted `[N]` int32. For rows with W > 0:
    `h + W > replay_capacity` -> cursor = a, parity ^= 1; else cursor = h + a; conv_offset = a - 1.
    """
    N = slots.shape[0]
    assert widths.shape == accepted.shape == (N,)
    assert cursor.dtype == parity.dtype == conv_offset.dtype == torch.int32
    if N == 0:
        return
    replay_accept_kernel[(triton.cdiv(N, ACCEPT_BLOCK),)](
        cursor, parity, conv_offset, slots, widths, accepted, N, L=replay_capacity, BLOCK=ACCEPT_BLOCK, num_warps=4
    )


@triton.jit(do_not_specialize=BATCH_VARYING_ARGS)
def native_accept_kernel(ssm_index, conv_offset, slots, widths, accepted, N, BLOCK: tl.constexpr):
    slot, width, num_acc, m = accepted_rows(slots, widths, accepted, N, BLOCK)
    tl.store(ssm_index + slot, num_acc - 1, mask=m)
    tl.store(conv_offset + slot, num_acc - 1, mask=m)


def native_accept_triton(
    ssm_index: torch.Tensor,
    conv_offset: torch.Tensor,
    slots: torch.Tensor,
    widths: torch.Tensor,
    accepted: torch.Tensor,
) -> None:
    """Native accept: in place `ssm_index[slot] = conv_offset[slot] = a - 1` for rows with W > 0 (no copy)."""
    N = slots.shape[0]
    assert widths.shape == accepted.shape == (N,)
    if N == 0:
        return
    native_accept_kernel[(triton.cdiv(N, ACCEPT_BLOCK),)](
        ssm_index, conv_offset, slots, widths, accepted, N, BLOCK=ACCEPT_BLOCK
    )
