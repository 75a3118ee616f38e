"""The memcheck cases of the layers' one-launch glue kernels (`lightllm/kernels/`): SwiGLU's `silu_mul` and the
projection split `split_columns`, at served and odd tiny shapes (`build_elementwise_cases`). A strided input is a
column slice that ends where its allocation ends, so a read past its last row's last element leaves the
allocation; every output is its own exact-size allocation."""

from __future__ import annotations

from collections.abc import Callable

from memcheck_common import Case, Ctx

# (name, T, I, dtype, strided, tiny): decode batch 256 of Qwen3.5-35B-A3B's shared expert (I = 512) and of a dense
# FFN with I = 6144, one decode token (a row of another allocation), and the tail tile of an odd I
SILU_MUL_SHAPES = (
    ("qwen3.5-moe-shared", 256, 512, "bfloat16", False, False),
    ("dense-6144", 256, 6144, "bfloat16", False, False),
    ("dense-6144", 1, 6144, "bfloat16", True, False),
    ("tiny-silu-mul", 37, 100, "float32", True, True),
    ("tiny-silu-mul", 1, 24, "float16", False, True),
)

# Qwen3.5-35B-A3B's GDN in_proj at TP1 (GatedDeltaNet.split_sizes): 16 key heads and 32 value heads of 128 give
# conv channels 2 * 16 * 128 + 32 * 128, z 32 * 128, b and a 32 each; a checkpoint whose b|a projection is a GEMM of
# its own (unquantized beside FP8) splits the two outputs in two launches
_KEY, _VALUE, _HV = 16 * 128, 32 * 128, 32
QWEN35_GDN = (2 * _KEY + _VALUE, _VALUE, _HV, _HV)
# Kimi-Linear-48B-A3B's KDA in_proj at TP1 (KimiDeltaAttention.split_sizes): f_a and g_a (head_dim 128 each), q|k|v
# of 32 heads of 128, b one per head
KIMI_KDA = (128, 128, 3 * 32 * 128, 32)
# (name, T, sizes, dtype, strided, tiny)
SPLIT_SHAPES = (
    ("qwen3.5-moe-gdn", 256, QWEN35_GDN, "bfloat16", False, False),
    ("qwen3.5-moe-gdn", 1, QWEN35_GDN, "bfloat16", False, False),
    ("qwen3.5-moe-gdn-qkvz", 256, QWEN35_GDN[:2], "bfloat16", False, False),
    ("qwen3.5-moe-gdn-ba", 256, QWEN35_GDN[2:], "bfloat16", False, False),
    ("qwen3.5-moe-gdn", 1000, QWEN35_GDN, "bfloat16", True, False),  # a prefill chunk
    ("kimi-linear-kda", 256, KIMI_KDA, "bfloat16", False, False),
    ("kimi-linear-kda", 1, KIMI_KDA, "bfloat16", False, False),
    ("tiny-split", 37, (72, 48, 3, 3), "float32", True, True),
    ("tiny-split", 3, (1500, 700, 32, 32), "float16", False, True),
    ("tiny-split", 1, (17, 40), "float32", False, True),
)


def _rows(ctx: Ctx, rows: int, width: int, dtype: str, strided: bool):
    """`[rows, width]`: exact, or the last `width` columns of a wider allocation (ends where it ends)."""
    extra = 5 if strided else 0
    return ctx.randn(rows, extra + width, dtype=dtype)[:, extra:]


def case_silu_mul(rows: int, inter: int, dtype: str, strided: bool) -> Callable[[Ctx], str]:
    def run(ctx: Ctx) -> str:
        from lightllm.kernels.silu_mul import silu_mul_triton

        x = _rows(ctx, rows, 2 * inter, dtype, strided)
        out = silu_mul_triton(x)
        assert bool(ctx.torch.isfinite(out).all()), "non-finite silu_mul outputs"
        return f"stride {x.stride(0)}"

    return run


def case_split_columns(rows: int, sizes: tuple[int, ...], dtype: str, strided: bool) -> Callable[[Ctx], str]:
    def run(ctx: Ctx) -> str:
        from lightllm.kernels.split_columns import split_columns_triton

        x = _rows(ctx, rows, sum(sizes), dtype, strided)
        parts = split_columns_triton(x, sizes)
        assert all(ctx.torch.equal(p, q) for p, q in zip(parts, x.split(sizes, dim=-1))), "parts differ from x"
        return f"stride {x.stride(0)}"

    return run


def build_elementwise_cases() -> list[Case]:
    cases = []
    for name, rows, inter, dtype, strided, tiny in SILU_MUL_SHAPES:
        detail = f"T={rows} I={inter}" + (" strided" if strided else "")
        run = case_silu_mul(rows, inter, dtype, strided)
        cases.append(Case("silu_mul", name, detail, ("silu_mul_kernel",), tiny, run))
    for name, rows, sizes, dtype, strided, tiny in SPLIT_SHAPES:
        detail = f"T={rows} sizes={'-'.join(map(str, sizes))}" + (" strided" if strided else "")
        run = case_split_columns(rows, sizes, dtype, strided)
        cases.append(Case("split_columns", name, detail, ("split_columns_kernel",), tiny, run))
    return cases
