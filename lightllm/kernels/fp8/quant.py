"""FP8 quantization: weights per `[block_n, block_k]` tile (load time, torch), activations per token and group of
`group` channels (run time: Triton on CUDA tensors, torch on CPU tensors).

Scales are "inverse" scales in the checkpoints' sense: `value ≈ fp8 · scale`, with `scale = amax / FP8_MAX` over the
tile or group, so the largest magnitude of each tile maps to ±448.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
# Qwen's and DeepSeek's released FP8 checkpoints use 128 x 128 weight tiles and 128-channel activation groups
DEFAULT_BLOCK = (128, 128)
# an all-zero tile or group still gets a positive scale, so dequantization never divides by zero
MIN_AMAX = 1e-10


def block_scale_shape(shape: tuple[int, ...], block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[int, ...]:
    """Scale shape of a weight `[..., N, K]`: `[..., ceil(N / block_n), ceil(K / block_k)]`."""
    *lead, n, k = shape
    return (*lead, math.ceil(n / block[0]), math.ceil(k / block[1]))


def check_block_scales(
    weight_shape: tuple[int, ...], scale_shape: tuple[int, ...], block: tuple[int, int], name: str = "weight"
) -> None:
    """ValueError naming `name` unless the scale grid matches the weight's tiles."""
    expected = block_scale_shape(tuple(weight_shape), block)
    if tuple(scale_shape) != expected:
        raise ValueError(
            f"{name}: weight {list(weight_shape)} with {list(block)} blocks needs scales {list(expected)}, "
            f"found {list(scale_shape)}"
        )


def _pad_to_blocks(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """`[..., N, K]` zero-padded to whole tiles and viewed as `[..., N / bn, bn, K / bk, bk]`."""
    *lead, n, k = w.shape
    bn, bk = block
    gn, gk = math.ceil(n / bn), math.ceil(k / bk)
    padded = torch.nn.functional.pad(w, (0, gk * bk - k, 0, gn * bn - n))
    return padded.view(*lead, gn, bn, gk, bk)


def quantize_weight_blocks(
    w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """`w [..., N, K]` (any float dtype, any device) -> (float8_e4m3fn `[..., N, K]`, fp32 scales
    `[..., ceil(N / bn), ceil(K / bk)]`). Partial edge tiles take their scale from their own elements only."""
    *lead, n, k = w.shape
    tiles = _pad_to_blocks(w.float(), block)
    amax = tiles.abs().amax(dim=(-3, -1)).clamp_min(MIN_AMAX)
    # a tensor divisor: CUDA turns division by a Python number into multiplication by its rounded reciprocal, which
    # is not the IEEE quotient the kernel (and the CPU) computes
    scale = amax / amax.new_tensor(FP8_MAX)
    # the quotient of a tile's largest element can round a hair above FP8_MAX; the cast does not saturate
    q = (tiles / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    gn, gk = scale.shape[-2:]
    q = q.view(*lead, gn * block[0], gk * block[1])[..., :n, :k].contiguous()
    return q, scale.contiguous()


def dequantize_weight_blocks(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """float8 `[..., N, K]` and scales `[..., ceil(N / bn), ceil(K / bk)]` -> `fp8 · scale` in `dtype` (computed
    in fp32)."""
    check_block_scales(tuple(q.shape), tuple(scale.shape), block)
    n, k = q.shape[-2:]
    full = scale.float().repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return (q.float() * full[..., :n, :k]).to(dtype)


def quantize_activation_groups_torch(
    x: torch.Tensor, group: int = DEFAULT_BLOCK[1]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [M, K]` -> (float8 `[M, K]`, fp32 scales `[M, ceil(K / group)]`), one scale per token and channel group."""
    q, scale = quantize_weight_blocks(x, (1, group))
    return q, scale


def dequantize_activation_groups(q: torch.Tensor, scale: torch.Tensor, group: int = DEFAULT_BLOCK[1]) -> torch.Tensor:
    return dequantize_weight_blocks(q, scale, (1, group))


@triton.jit
def round_to_e4m3(x):
    """fp32 `x` (|x| <= 448) rounded to the nearest float8_e4m3fn value (ties to even, as torch's cast), still fp32.

    The cast that follows is then exact. Rounding here rather than in the cast keeps the GPU and Triton's CPU
    interpreter in agreement: the interpreter's fp32 -> e4m3 cast drops the carry when the mantissa rounds up
    into the next binade (126.6 becomes 64, not 128)."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    # 3 mantissa bits: the spacing is 2^(e - 3) in binade e, and 2^-9 throughout the subnormals (e < -6)
    step_exponent = tl.maximum(exponent - 3, 127 - 9)
    step = (step_exponent << 23).to(tl.float32, bitcast=True)
    # exact: a power-of-two divisor, and a quotient below 2^4 leaves room for the + 0.5
    units = tl.abs(x) / step
    rounded = tl.floor(units + 0.5)
    odd = rounded - 2.0 * tl.floor(rounded * 0.5)
    rounded = tl.where((rounded - units == 0.5) & (odd == 1.0), rounded - 1.0, rounded)
    magnitude = (rounded * step).to(tl.int32, bitcast=True)
    # the sign bit copied, so a negative value rounding to zero stays -0 as in torch's cast
    return (magnitude | (bits & -2147483648)).to(tl.float32, bitcast=True)


# the token count changes from step to step: specialising on it would compile variants while serving
@triton.jit(do_not_specialize=["M"])
def fp8_group_quant_kernel(
    x,  # [M, K]
    q,  # [M, K] float8_e4m3fn
    s,  # [M, G] fp32, G = ceil(K / GROUP)
    M,
    K,
    stride_xm,
    stride_qm,
    stride_sm,
    fp8_max: tl.constexpr,
    min_amax: tl.constexpr,
    BM: tl.constexpr,
    GROUP: tl.constexpr,
):
    i_m, i_g = tl.program_id(0), tl.program_id(1)
    o_m = (i_m * BM + tl.arange(0, BM)).to(tl.int64)
    o_k = (i_g * GROUP + tl.arange(0, GROUP)).to(tl.int64)
    m_m, m_k = o_m < M, o_k < K
    mask = m_m[:, None] & m_k[None, :]
    # [BM, GROUP]
    b_x = tl.load(x + o_m[:, None] * stride_xm + o_k[None, :], mask=mask, other=0.0).to(tl.float32)
    # IEEE divisions, as torch's: the GPU's default fp32 `/` is approximate, a scale one ulp off moves the quotients
    b_s = tl.div_rn(tl.maximum(tl.max(tl.abs(b_x), axis=1), min_amax), fp8_max)
    b_q = round_to_e4m3(tl.clamp(tl.div_rn(b_x, b_s[:, None]), -fp8_max, fp8_max))
    tl.store(q + o_m[:, None] * stride_qm + o_k[None, :], b_q.to(q.dtype.element_ty), mask=mask)
    tl.store(s + o_m * stride_sm + i_g, b_s, mask=m_m)


def quantize_activation_groups_triton(
    x: torch.Tensor, group: int = DEFAULT_BLOCK[1]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton twin of `quantize_activation_groups_torch` (any device Triton runs on, the interpreter included)."""
    assert x.dim() == 2 and x.stride(1) == 1, f"expected a row-major [M, K] activation, got {tuple(x.shape)}"
    assert group >= 16 and group & (group - 1) == 0, f"group must be a power of two >= 16, got {group}"
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((m, math.ceil(k / group)), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, s
    bm = 16
    grid = (triton.cdiv(m, bm), s.shape[1])
    fp8_group_quant_kernel[grid](
        x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), FP8_MAX, MIN_AMAX, BM=bm, GROUP=group
    )
    return q, s


def quantize_activation_groups(
    x: torch.Tensor, group: int = DEFAULT_BLOCK[1], backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group FP8 quantization of `x [M, K]`: Triton on CUDA tensors, torch on CPU tensors (`backend`
    "torch" | "triton" forces one). Returns (float8_e4m3fn `[M, K]`, fp32 scales `[M, ceil(K / group)]`)."""
    use_triton = backend == "triton" or (backend is None and x.is_cuda)
    if use_triton:
        return quantize_activation_groups_triton(x.contiguous(), group)
    return quantize_activation_groups_torch(x, group)
