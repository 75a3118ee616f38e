"""W8A8 block-scaled GEMM: `out [M, N] = (a · a_scale) @ (w · w_scale)ᵀ` with float8_e4m3fn operands, fp32
accumulation and a bf16 / fp16 / fp32 output.

`a [M, K]` carries one scale per token per `block_k` channels (`a_scale [M, ceil(K / block_k)]`), `w [N, K]` one
per `[block_n, block_k]` tile (`w_scale [ceil(N / block_n), ceil(K / block_k)]`). The kernel's K step is one
scale group, so each step's partial dot is scaled once by `a_scale[m, k] · w_scale[n // block_n, k]` before it
joins the fp32 accumulator. The reference (and the CPU path) dequantizes both operands and multiplies in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from lightllm.kernels.fp8.configs import CUBLAS, check_config, get_config
from lightllm.kernels.fp8.quant import (
    DEFAULT_BLOCK,
    FP8_DTYPE,
    check_block_scales,
    dequantize_activation_groups,
    dequantize_weight_blocks,
    quantize_activation_groups,
)

# rows of the activation a cuBLASLt block-scaled call is given (a multiple: see `cublas_block_gemm`)
CUBLAS_ROWS = 16


@triton.jit
def _load_operand_tiles(a, w, o_m, o_n, o_k, m_m, m_n, i_m, i_n, i_k, K, stride_am, stride_wn, BM, BN, BK, TMA, EVEN_K):
    """The K step `i_k` of both operands: `[BM, BK]` of a and `[BK, BN]` of w (zeros past the edges)."""
    if TMA:
        # the descriptors zero-fill out-of-bounds rows and columns
        b_a = a.load([i_m * BM, i_k * BK])
        b_w = tl.trans(w.load([i_n * BN, i_k * BK]))
    else:
        o_kk = i_k * BK + o_k
        p_a = a + o_m[:, None] * stride_am + o_kk[None, :]
        p_w = w + o_n[None, :] * stride_wn + o_kk[:, None]
        if EVEN_K:
            # a mask along K keeps Triton (3.6) from pipelining the loads through cp.async: left out where no
            # K step is partial
            b_a = tl.load(p_a, mask=m_m[:, None], other=0.0)
            b_w = tl.load(p_w, mask=m_n[None, :], other=0.0)
        else:
            m_k = o_kk < K
            b_a = tl.load(p_a, mask=m_m[:, None] & m_k[None, :], other=0.0)
            b_w = tl.load(p_w, mask=m_k[:, None] & m_n[None, :], other=0.0)
    return b_a, b_w


# M (the token count) changes from step to step: specialising on it would compile variants while serving
@triton.heuristics(
    {
        "SCALAR_W_SCALE": lambda args: args["BLOCK_N_SCALE"] % args["BN"] == 0,
        "EVEN_K": lambda args: args["K"] % args["BK"] == 0,
    }
)
@triton.jit(do_not_specialize=["M"])
def fp8_block_gemm_kernel(
    a,  # [M, K] float8 (a tensor descriptor with [BM, BK] blocks under TMA)
    a_s,  # [M, GK] fp32
    w,  # [N, K] float8 (a tensor descriptor with [BN, BK] blocks under TMA)
    w_s,  # [GN, GK] fp32
    o,  # [M, N]
    M,
    N,
    K,
    stride_am,
    stride_asm,
    stride_wn,
    stride_wsn,
    stride_om,
    BLOCK_N_SCALE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    TMA: tl.constexpr,
    SCALAR_W_SCALE: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    # grouped launch order: GROUP_M row tiles share each weight column tile while it sits in L2
    i_pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    per_group = GROUP_M * num_n
    first_m = (i_pid // per_group) * GROUP_M
    group_rows = min(num_m - first_m, GROUP_M)
    i_m = first_m + (i_pid % per_group) % group_rows
    i_n = (i_pid % per_group) // group_rows

    o_m = (i_m * BM + tl.arange(0, BM)).to(tl.int64)
    o_n = (i_n * BN + tl.arange(0, BN)).to(tl.int64)
    o_k = tl.arange(0, BK).to(tl.int64)
    m_m, m_n = o_m < M, o_n < N
    p_as = a_s + o_m * stride_asm
    if SCALAR_W_SCALE:
        # the whole column tile lies in one weight scale row
        p_ws = w_s + (i_n * BN // BLOCK_N_SCALE).to(tl.int64) * stride_wsn
    else:
        p_ws = w_s + (o_n // BLOCK_N_SCALE) * stride_wsn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        # [BM, BK], [BK, BN] float8 straight into the tensor-core dot
        b_a, b_w = _load_operand_tiles(
            a, w, o_m, o_n, o_k, m_m, m_n, i_m, i_n, i_k, K, stride_am, stride_wn, BM, BN, BK, TMA, EVEN_K
        )
        # [BM]; a weight scale per column or one for the tile
        b_as = tl.load(p_as + i_k, mask=m_m, other=0.0)
        if SCALAR_W_SCALE:
            b_scale = b_as[:, None] * tl.load(p_ws + i_k)
        else:
            b_scale = b_as[:, None] * tl.load(p_ws + i_k, mask=m_n, other=0.0)[None, :]
        # one K step is one scale group: its partial dot is scaled once before joining the fp32 accumulator
        acc += tl.dot(b_a, b_w) * b_scale
    tl.store(o + o_m[:, None] * stride_om + o_n[None, :], acc.to(o.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


def tma_eligible(a: torch.Tensor, w: torch.Tensor) -> bool:
    """Tensor descriptors need 16-byte aligned bases and row strides (the last dim is contiguous already)."""
    return all(t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0 for t in (a, w))


def fp8_block_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    block: tuple[int, int] = DEFAULT_BLOCK,
    out: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """Triton launch (CUDA, or the interpreter on CPU tensors). `a [M, K]`, `w [N, K]` float8_e4m3fn row-major,
    `a_scale [M, ceil(K / block_k)]`, `w_scale [ceil(N / block_n), ceil(K / block_k)]` fp32. `config` overrides
    the tuned / heuristic launch configuration (`lightllm.kernels.fp8.configs`: tuning, benchmarks); a TMA
    configuration falls back to pointer loads where the operands do not allow descriptors. Returns `out [M, N]`
    in `out_dtype`."""
    m, k = a.shape
    n = w.shape[0]
    assert a.dtype == FP8_DTYPE and w.dtype == FP8_DTYPE, f"expected float8_e4m3fn operands, got {a.dtype}, {w.dtype}"
    assert w.shape[1] == k, f"a [M, {k}] and w {list(w.shape)} disagree on K"
    assert a.stride(1) == 1 and w.stride(1) == 1, "a and w must be row-major"
    check_block_scales(tuple(w.shape), tuple(w_scale.shape), block, "w_scale")
    check_block_scales(tuple(a.shape), tuple(a_scale.shape), (1, block[1]), "a_scale")
    config = check_config(config) if config is not None else get_config(m, n, k, block, a.device)
    if config == CUBLAS:
        return cublas_block_gemm(a, a_scale, w, w_scale, out_dtype, block, out)
    # the K step is one scale group; a tile's columns may span several weight scale rows (read per column)
    assert block[1] >= 16 and block[1] & (block[1] - 1) == 0, f"block_k must be a power of two >= 16, got {block}"
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], block[1]
    use_tma = config["TMA"] and tma_eligible(a, w)
    a_arg = TensorDescriptor.from_tensor(a, [bm, bk]) if use_tma else a
    w_arg = TensorDescriptor.from_tensor(w, [bn, bk]) if use_tma else w
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    fp8_block_gemm_kernel[grid](
        a_arg,
        a_scale,
        w_arg,
        w_scale,
        out,
        m,
        n,
        k,
        a.stride(0),
        a_scale.stride(0),
        w.stride(0),
        w_scale.stride(0),
        out.stride(0),
        BLOCK_N_SCALE=block[0],
        BM=bm,
        BN=bn,
        BK=bk,
        GROUP_M=config["GROUP_M"],
        TMA=use_tma,
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
    return out


def cublas_block_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    block: tuple[int, int],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`fp8_block_gemm` through cuBLASLt's block-scaled FP8 GEMM (torch's scaled_mm with 1 x 128 activation and
    128 x 128 weight scales; CUDA 12.9+ on sm_90). It wants the activation scales M-major and the weight as its
    `[K, N]` transpose (a view, as are the weight scales'). Raises where this torch / CUDA / GPU does not offer it."""
    if tuple(block) != (128, 128):
        raise ValueError(f"cuBLASLt block-scaled FP8 needs 128 x 128 blocks, got {block}")
    m = a.shape[0]
    pad = -m % CUBLAS_ROWS
    if pad:
        # cuBLASLt refuses (NOT_SUPPORTED) a row count whose M-major activation scales are not 16-byte aligned;
        # zero rows with unit scales cost one small copy and are cut off the result
        a = torch.nn.functional.pad(a.view(torch.uint8), (0, 0, 0, pad)).view(a.dtype)
        a_scale = torch.nn.functional.pad(a_scale, (0, 0, 0, pad), value=1.0)
    scale_a = a_scale.t().contiguous().t()
    scaled_mm = getattr(torch.nn.functional, "scaled_mm", None)
    if scaled_mm is not None:
        recipe = torch.nn.functional.ScalingType
        y = scaled_mm(
            a, w.t(), scale_a, recipe.BlockWise1x128, w_scale.t(), recipe.BlockWise128x128, output_dtype=out_dtype
        )
    else:
        y = torch._scaled_mm(a, w.t(), scale_a=scale_a, scale_b=w_scale.t(), out_dtype=out_dtype)
    y = y[:m]
    if out is None:
        return y
    return out.copy_(y)


def fp8_block_gemm_reference(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    block: tuple[int, int] = DEFAULT_BLOCK,
) -> torch.Tensor:
    """Dequantize both operands, multiply in fp32: the specification of `fp8_block_gemm` and its CPU path."""
    a32 = dequantize_activation_groups(a, a_scale, block[1])
    w32 = dequantize_weight_blocks(w, w_scale, block)
    return (a32 @ w32.T).to(out_dtype)


def fp8_block_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    block: tuple[int, int] = DEFAULT_BLOCK,
    backend: str | None = None,
) -> torch.Tensor:
    """`F.linear` with a block-FP8 weight: `x [..., K]` (bf16 / fp16 / fp32) is quantized per token per `block_k`
    channels, multiplied by `w [N, K]` (float8, scales `w_scale`) and returned as `[..., N]` in x's dtype. Triton
    on CUDA tensors, the dequantize-then-matmul path on CPU tensors; `backend` "torch" | "triton" forces one."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    use_triton = backend == "triton" or (backend is None and x.is_cuda)
    a, a_scale = quantize_activation_groups(x2, block[1], backend="triton" if use_triton else "torch")
    gemm = fp8_block_gemm if use_triton else fp8_block_gemm_reference
    y = gemm(a, a_scale, w, w_scale, x.dtype, block)
    if bias is not None:
        y = y + bias
    return y.view(*lead, w.shape[0])
