"""Grammar masks applied to logits: `out[r, v] = logits[r, v]` where bit `v` of row `r` of an int32 bitmask is set
(bit `b` of word `w` is token `32 w + b`, llguidance's layout), `-inf` elsewhere.

One pass over the logits: the bitmask (4 bytes per 32 tokens) is read as words and never unpacked into a
`[rows, V]` tensor, and rows are not gathered or scattered (a row without a grammar has every bit set). The input
is left as it is (log-probabilities are reported from the model's own distribution).

`apply_token_bitmask` dispatches: Triton for CUDA tensors, `apply_token_bitmask_torch` (the same contract, the CPU
path and the reference) otherwise.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

BLOCK_V = 1024


@triton.jit(do_not_specialize=["vocab", "num_words", "stride_l_r", "stride_m_r", "stride_o_r"])
def apply_token_bitmask_kernel(
    logits,  # [R, V]
    bitmask,  # [R, W] int32, W >= cdiv(V, 32)
    out,  # [R, V]
    vocab,
    num_words,
    stride_l_r,
    stride_m_r,
    stride_o_r,
    BLOCK_V: tl.constexpr,
):
    i_v, i_r = tl.program_id(0), tl.program_id(1)
    row = i_r.to(tl.int64)
    o_v = i_v.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    m_v = o_v < vocab
    o_w = o_v // 32
    b_x = tl.load(logits + row * stride_l_r + o_v, mask=m_v, other=0.0)  # [BLOCK_V]
    b_w = tl.load(bitmask + row * stride_m_r + o_w, mask=m_v & (o_w < num_words), other=0)  # [BLOCK_V]
    b_bit = (b_w >> (o_v % 32).to(tl.int32)) & 1
    b_o = tl.where(b_bit != 0, b_x, float("-inf"))
    tl.store(out + row * stride_o_r + o_v, b_o.to(out.dtype.element_ty), mask=m_v)


def _check(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise ValueError(
            f"logits [R, V] and bitmask [R, W] expected, got {tuple(logits.shape)}, {tuple(bitmask.shape)}"
        )
    if bitmask.dtype != torch.int32 or bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(f"bitmask must be int32 with at least {(logits.shape[1] + 31) // 32} words per row")
    if bitmask.device != logits.device:
        raise ValueError(f"bitmask on {bitmask.device}, logits on {logits.device}")


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 [rows, words] (bit b of word w: token 32 w + b) → bool [rows, vocab] (a view of one uint8 tensor)."""
    # little-endian words (x86, ARM, CUDA): byte k of word w holds tokens 32 w + 8 k .. 32 w + 8 k + 7, so the bytes
    # unpack in token order, one byte per token instead of four
    as_bytes = bitmask.contiguous().view(torch.uint8)
    if as_bytes.device.type == "cpu":
        # numpy's unpacking is one C loop (tens of times faster than the broadcast shifts below)
        bits = np.unpackbits(as_bytes.numpy(), axis=1, count=vocab, bitorder="little")
        return torch.from_numpy(bits).view(torch.bool)
    shifts = torch.arange(8, device=bitmask.device, dtype=torch.uint8)
    bits = (as_bytes[:, :, None] >> shifts) & 1
    return bits.view(torch.bool).reshape(bitmask.shape[0], -1)[:, :vocab]


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` masked by `bitmask` (a new tensor); the reference and the CPU path."""
    _check(logits, bitmask)
    return torch.where(unpack_bitmask(bitmask, logits.shape[1]), logits, float("-inf"))


def apply_token_bitmask_triton(
    logits: torch.Tensor, bitmask: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The Triton launch (CUDA tensors, or any under TRITON_INTERPRET=1); `out` [R, V] receives the result."""
    _check(logits, bitmask)
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("logits and bitmask rows must be contiguous")
    out = torch.empty_like(logits) if out is None else out
    if out.shape != logits.shape or out.stride(1) != 1:
        raise ValueError(f"out must be [R, V] with contiguous rows, got {tuple(out.shape)}")
    rows, vocab = logits.shape
    if rows and vocab:
        grid = (triton.cdiv(vocab, BLOCK_V), rows)
        apply_token_bitmask_kernel[grid](
            logits,
            bitmask,
            out,
            vocab,
            bitmask.shape[1],
            logits.stride(0),
            bitmask.stride(0),
            out.stride(0),
            BLOCK_V=BLOCK_V,
        )
    return out


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` [R, V] masked by `bitmask` [R, W] int32 (a new tensor; Triton on CUDA, torch otherwise)."""
    if logits.is_cuda:
        return apply_token_bitmask_triton(logits, bitmask)
    return apply_token_bitmask_torch(logits, bitmask)
