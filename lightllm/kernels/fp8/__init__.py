"""Block-scaled FP8 (float8_e4m3fn) weights and W8A8 GEMMs.

Layout (Qwen's and DeepSeek's block-FP8 checkpoints): a weight `[N, K]` (or stacked experts `[E, N, K]`) is
stored as float8_e4m3fn with one fp32 scale per `[block_n, block_k]` tile, `weight_scale_inv [ceil(N / block_n),
ceil(K / block_k)]`, so that `weight ≈ fp8 · scale` (the tile at the right and bottom edges may be partial).
Activations are quantized at run time, one scale per token per group of `block_k` channels.
"""

from lightllm.kernels.fp8.gemm import fp8_block_gemm, fp8_block_gemm_reference, fp8_block_linear
from lightllm.kernels.fp8.quant import (
    DEFAULT_BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    block_scale_shape,
    check_block_scales,
    dequantize_activation_groups,
    dequantize_weight_blocks,
    quantize_activation_groups,
    quantize_activation_groups_torch,
    quantize_weight_blocks,
)

__all__ = [
    "DEFAULT_BLOCK",
    "FP8_DTYPE",
    "FP8_MAX",
    "block_scale_shape",
    "check_block_scales",
    "dequantize_activation_groups",
    "dequantize_weight_blocks",
    "fp8_block_gemm",
    "fp8_block_gemm_reference",
    "fp8_block_linear",
    "quantize_activation_groups",
    "quantize_activation_groups_torch",
    "quantize_weight_blocks",
]
