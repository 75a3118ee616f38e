"""The two grouped GEMMs of the routed experts, over the padded per-expert blocks of `align.ExpertBlocks`.

Program `(i_m, i_n)` takes block `i_m` (`BM` pair rows of one expert e) and output columns `i_n * BN ..`:
- `moe_gate_up_kernel`: `act[p, n] = silu(x[t] · gate_e[n]) * (x[t] · up_e[n])` for each pair `p = t * top_k + j`
  in the block; the gate and up rows of `gate_up [E, 2I, H]` are read as two `[BK, BN]` tiles and accumulated
  together, so SwiGLU happens in registers and `act [P, I]` is the only intermediate.
- `moe_down_kernel`: `pair_out[p, n] = weight[p] * (act[p] · down_e[n])` into fp32 `[P, H]`; the combine sums the
  top_k rows of each token in a fixed order (no atomics: the same bits every run).
Blocks whose expert is E (past the real end of the padded layout) return at once; padding rows (sentinel pair id)
load zeros and store nothing. Accumulation is fp32; fp32 inputs use `ieee` dots (tf32 would cost ~1e-3).

Block-FP8 experts (`FP8`): both operands are float8_e4m3fn, the activations quantized per row per `BK` channels
(`a_s`), the weights per `[BLOCK_N_SCALE, BK]` tile (`w_s [E, ceil(N / BLOCK_N_SCALE), ceil(K / BK)]`); the K step is
one scale group, so each step's fp8 dot is scaled by `a_s[row] · w_s[column]` before it joins the fp32 accumulator
(`_fp8_step`, the same rule as `lightllm.kernels.fp8`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightllm.kernels.fused_moe.align import ExpertBlocks


@triton.jit
def _block_rows(sorted_pairs, block_expert, i_m, num_pairs, TOP_K: tl.constexpr, BM: tl.constexpr):
    """The block's expert and, per row, its pair id, token and validity mask (`[BM]` each)."""
    e = tl.load(block_expert + i_m).to(tl.int64)
    o_m = i_m.to(tl.int64) * BM + tl.arange(0, BM)
    b_pair = tl.load(sorted_pairs + o_m).to(tl.int64)
    m_m = b_pair < num_pairs
    return e, b_pair, b_pair // TOP_K, m_m


@triton.jit
def _k_step_masks(p_a, m_m, m_n, o_k, k0, K, EVEN_K: tl.constexpr):
    """K step `k0`: the activation tile `[BM, BK]` and the weight tile's mask `[BK, BN]` (along N only when K is a
    whole number of steps). A mask along K keeps Triton (3.6) from staging the loads through shared memory
    (cp.async pipelining): it is left out where no step is partial."""
    if EVEN_K:
        b_a = tl.load(p_a, mask=m_m[:, None], other=0.0)
        m_w = tl.broadcast_to(m_n[None, :], (o_k.shape[0], m_n.shape[0]))
    else:
        m_k = k0 + o_k < K
        b_a = tl.load(p_a, mask=m_m[:, None] & m_k[None, :], other=0.0)
        m_w = m_k[:, None] & m_n[None, :]
    return b_a, m_w


@triton.jit
def _weight_tile(p_w, m_w, dtype):
    """A `[BK, BN]` weight tile in the activation dtype (masked lanes read 0)."""
    return tl.load(p_w, mask=m_w, other=0.0).to(dtype)


@triton.jit
def _fp8_step(acc, b_a, p_w, m_w, p_as, m_m, p_ws, m_n, i_k):
    """`acc [BM, BN] += (a · w) · a_scale[:, None] · w_scale[None, :]` for K step `i_k` (one scale group)."""
    b_as = tl.load(p_as + i_k, mask=m_m, other=0.0)
    b_ws = tl.load(p_ws + i_k, mask=m_n, other=0.0)
    return acc + tl.dot(b_a, tl.load(p_w, mask=m_w, other=0.0)) * b_as[:, None] * b_ws[None, :]


@triton.heuristics({"EVEN_K": lambda args: args["H"] % args["BK"] == 0})
@triton.jit(do_not_specialize=["num_pairs"])
def moe_gate_up_kernel(
    x,  # [T, H]
    gate_up,  # [E, 2I, H]
    act,  # [P, I] activation dtype
    sorted_pairs,  # [num_blocks * BM] int32
    block_expert,  # [num_blocks] int32
    num_pairs,
    num_experts,
    H,
    I,
    stride_xt,
    stride_we,
    stride_wn,
    stride_ap,
    x_s,  # FP8: [T, ceil(H / BK)] fp32
    w_s,  # FP8: [E, ceil(2I / BLOCK_N_SCALE), ceil(H / BK)] fp32
    stride_xst,
    stride_wse,
    stride_wsn,
    TOP_K: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr = False,
    BLOCK_N_SCALE: tl.constexpr = 128,
    EVEN_K: tl.constexpr = False,
):
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    e, b_pair, b_tok, m_m = _block_rows(sorted_pairs, block_expert, i_m, num_pairs, TOP_K, BM)
    if e >= num_experts:
        return
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < I
    o_k = tl.arange(0, BK)
    p_x = x + b_tok[:, None] * stride_xt + o_k[None, :]  # [BM, BK]
    p_g = gate_up + e * stride_we + o_n.to(tl.int64)[None, :] * stride_wn + o_k[:, None]  # [BK, BN]
    p_u = p_g + I * stride_wn
    # FP8: each row's token scales, each column's gate and up scale rows
    p_xs = x_s + b_tok * stride_xst
    p_gs = w_s + e * stride_wse + (o_n // BLOCK_N_SCALE).to(tl.int64) * stride_wsn
    p_us = w_s + e * stride_wse + ((I + o_n) // BLOCK_N_SCALE).to(tl.int64) * stride_wsn
    b_g = tl.zeros([BM, BN], dtype=tl.float32)
    b_u = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, H, BK):
        b_x, m_w = _k_step_masks(p_x, m_m, m_n, o_k, k0, H, EVEN_K)
        if FP8:
            b_g = _fp8_step(b_g, b_x, p_g, m_w, p_xs, m_m, p_gs, m_n, k0 // BK)
            b_u = _fp8_step(b_u, b_x, p_u, m_w, p_xs, m_m, p_us, m_n, k0 // BK)
        else:
            b_g = tl.dot(b_x, _weight_tile(p_g, m_w, b_x.dtype), b_g, input_precision=DOT_PRECISION)
            b_u = tl.dot(b_x, _weight_tile(p_u, m_w, b_x.dtype), b_u, input_precision=DOT_PRECISION)
        p_x += BK
        p_g += BK
        p_u += BK
    b_a = b_g * tl.sigmoid(b_g) * b_u
    p_a = act + b_pair[:, None] * stride_ap + o_n[None, :]
    tl.store(p_a, b_a.to(act.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


@triton.heuristics({"EVEN_K": lambda args: args["I"] % args["BK"] == 0})
@triton.jit(do_not_specialize=["num_pairs"])
def moe_down_kernel(
    act,  # [P, I]
    down,  # [E, H, I]
    weights,  # [P] fp32 routing weight of each pair
    pair_out,  # [P, H] fp32
    sorted_pairs,
    block_expert,
    num_pairs,
    num_experts,
    H,
    I,
    stride_ap,
    stride_we,
    stride_wn,
    stride_op,
    act_s,  # FP8: [P, ceil(I / BK)] fp32
    w_s,  # FP8: [E, ceil(H / BLOCK_N_SCALE), ceil(I / BK)] fp32
    stride_asp,
    stride_wse,
    stride_wsn,
    TOP_K: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr = False,
    BLOCK_N_SCALE: tl.constexpr = 128,
    EVEN_K: tl.constexpr = False,
):
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    e, b_pair, _, m_m = _block_rows(sorted_pairs, block_expert, i_m, num_pairs, TOP_K, BM)
    if e >= num_experts:
        return
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < H
    o_k = tl.arange(0, BK)
    p_a = act + b_pair[:, None] * stride_ap + o_k[None, :]  # [BM, BK]
    p_d = down + e * stride_we + o_n.to(tl.int64)[None, :] * stride_wn + o_k[:, None]  # [BK, BN]
    p_as = act_s + b_pair * stride_asp
    p_ds = w_s + e * stride_wse + (o_n // BLOCK_N_SCALE).to(tl.int64) * stride_wsn
    b_o = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, I, BK):
        b_a, m_w = _k_step_masks(p_a, m_m, m_n, o_k, k0, I, EVEN_K)
        if FP8:
            b_o = _fp8_step(b_o, b_a, p_d, m_w, p_as, m_m, p_ds, m_n, k0 // BK)
        else:
            b_o = tl.dot(b_a, _weight_tile(p_d, m_w, b_a.dtype), b_o, input_precision=DOT_PRECISION)
        p_a += BK
        p_d += BK
    b_w = tl.load(weights + b_pair, mask=m_m, other=0.0)
    p_o = pair_out + b_pair[:, None] * stride_op + o_n[None, :]
    tl.store(p_o, b_o * b_w[:, None], mask=m_m[:, None] & m_n[None, :])


def _precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _fp8_args(
    a_scale: torch.Tensor | None,
    w_scale: torch.Tensor | None,
    block: tuple[int, int] | None,
    tile: dict,
    unused: torch.Tensor,
):
    """The FP8 kernel arguments (scales, their strides, flags) and the K tile: one scale group per K step.
    Without FP8 the scale arguments are `unused` (any tensor: the FP8 branch is compiled out)."""
    if a_scale is None:
        return (unused, unused, 0, 0, 0), {}, tile["BLOCK_K"]
    assert w_scale is not None and block is not None, "FP8 experts need their weight scales and block"
    args = (a_scale, w_scale, a_scale.stride(0), w_scale.stride(0), w_scale.stride(1))
    return args, {"FP8": True, "BLOCK_N_SCALE": block[0]}, block[1]


def gate_up_swiglu(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    blocks: ExpertBlocks,
    top_k: int,
    tile: dict,
    act: torch.Tensor,
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Fill `act [P, I]` with each pair's SwiGLU activation; `tile`: BLOCK_N, BLOCK_K, num_warps, num_stages.
    FP8: `x` and `gate_up` float8 with `x_scale [T, ceil(H / block_k)]`, `w_scale [E, ceil(2I / block_n),
    ceil(H / block_k)]` (the K tile is then `block_k`)."""
    num_experts, two_i, hidden = gate_up.shape
    inter = two_i // 2
    scale_args, flags, block_k = _fp8_args(x_scale, w_scale, block, tile, x)
    grid = (blocks.num_blocks, triton.cdiv(inter, tile["BLOCK_N"]))
    moe_gate_up_kernel[grid](
        x,
        gate_up,
        act,
        blocks.sorted_pairs,
        blocks.block_expert,
        blocks.num_pairs,
        num_experts,
        hidden,
        inter,
        x.stride(0),
        gate_up.stride(0),
        gate_up.stride(1),
        act.stride(0),
        *scale_args,
        TOP_K=top_k,
        BM=blocks.block_m,
        BN=tile["BLOCK_N"],
        BK=block_k,
        DOT_PRECISION=_precision(x),
        num_warps=tile["num_warps"],
        num_stages=tile["num_stages"],
        **flags,
    )
    return act


def down_weighted(
    act: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    blocks: ExpertBlocks,
    top_k: int,
    tile: dict,
    pair_out: torch.Tensor,
    act_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Fill `pair_out [P, H]` (fp32) with `weights[p] * down_e(act[p])`; `weights [P]` fp32. FP8: `act` and
    `down` float8 with `act_scale [P, ceil(I / block_k)]`, `w_scale [E, ceil(H / block_n), ceil(I / block_k)]`."""
    num_experts, hidden, inter = down.shape
    scale_args, flags, block_k = _fp8_args(act_scale, w_scale, block, tile, act)
    grid = (blocks.num_blocks, triton.cdiv(hidden, tile["BLOCK_N"]))
    moe_down_kernel[grid](
        act,
        down,
        weights,
        pair_out,
        blocks.sorted_pairs,
        blocks.block_expert,
        blocks.num_pairs,
        num_experts,
        hidden,
        inter,
        act.stride(0),
        down.stride(0),
        down.stride(1),
        pair_out.stride(0),
        *scale_args,
        TOP_K=top_k,
        BM=blocks.block_m,
        BN=tile["BLOCK_N"],
        BK=block_k,
        DOT_PRECISION=_precision(act),
        num_warps=tile["num_warps"],
        num_stages=tile["num_stages"],
        **flags,
    )
    return pair_out
