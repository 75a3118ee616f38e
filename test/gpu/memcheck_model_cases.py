"""The memcheck cases of the kernels models share (`lightllm/kernels/`): paged attention, MLA latent attention,
the fused MoE, the block-FP8 GEMM and the grammar-mask kernel, at served and odd tiny shapes (`build_model_cases`). The linear-attention
state kernels' cases are `memcheck_cases.py`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from memcheck_common import Case, Ctx


@dataclass(frozen=True)
class AttentionShape:
    name: str
    heads: int
    kv_heads: int
    dk: int
    dv: int
    dtype: str
    tiny: bool


ATTENTION_SHAPES = (
    AttentionShape("qwen-attention", 16, 2, 256, 256, "bfloat16", tiny=False),  # Qwen3-Next / Qwen3.5 gated attention
    AttentionShape("kimi-mla", 32, 32, 192, 128, "bfloat16", tiny=False),  # Kimi-Linear MLA after kv_b_proj
    AttentionShape("tiny-attention", 6, 3, 24, 40, "float32", tiny=True),
)


@dataclass(frozen=True)
class LatentShape:
    """MLA attention in latent space: query heads, latent rank C and rope dims R of the cached `[c_kv | k_rot]`."""

    name: str
    heads: int
    rank: int
    rope: int
    dtype: str
    tiny: bool


LATENT_SHAPES = (
    LatentShape("kimi-mla-latent", 32, 512, 64, "bfloat16", tiny=False),  # Kimi-Linear TP1
    LatentShape("tiny-mla-latent", 3, 24, 12, "float32", tiny=True),
)


@dataclass(frozen=True)
class MoEShape:
    """Routed experts of one MoE layer: E experts of hidden H and intermediate I, top-k of a router."""

    name: str
    experts: int
    top_k: int
    hidden: int
    inter: int
    scoring: str  # "softmax" (Qwen, with the gated shared expert) or "sigmoid" (Kimi: bias, groups, scaling)
    dtype: str
    tiny: bool


@dataclass(frozen=True)
class Fp8Shape:
    """A block-FP8 linear layer: M tokens x K inputs -> N outputs, 128 x 128 weight blocks."""

    name: str
    m: int
    n: int
    k: int
    dtype: str
    tiny: bool


FP8_SHAPES = (
    Fp8Shape("qwen3-next-in_proj", 70, 12352, 2048, "bfloat16", tiny=False),  # GDN in_proj_qkvz + ba, TP1
    Fp8Shape("qwen3-next-o_proj", 300, 2048, 4096, "bfloat16", tiny=False),
    # partial edge blocks in N and K, M not a multiple of any tile
    Fp8Shape("tiny-fp8-odd", 37, 200, 136, "float32", tiny=True),
)


MOE_SHAPES = (
    MoEShape("qwen3.5-moe", 256, 8, 2048, 512, "softmax", "bfloat16", tiny=False),  # Qwen3.5-35B-A3B TP1
    MoEShape("kimi-moe", 256, 8, 2304, 1024, "sigmoid", "bfloat16", tiny=False),  # Kimi-Linear-48B-A3B TP1
    MoEShape("tiny-moe", 6, 2, 40, 24, "softmax", "float32", tiny=True),
    MoEShape("tiny-moe-grouped", 8, 3, 24, 40, "sigmoid", "float16", tiny=True),
)


@dataclass(frozen=True)
class BitmaskShape:
    """Grammar masks over R logits rows of a V-token vocabulary (int32 words of 32 tokens, `words` per row)."""

    name: str
    rows: int
    vocab: int
    words: int
    dtype: str
    tiny: bool


BITMASK_SHAPES = (
    BitmaskShape("qwen3.5-vocab", 64, 248320, 7760, "float32", tiny=False),  # batch 64, Qwen3.5's padded vocabulary
    # a tail tile and a last word that are both partial, and rows wider than the vocabulary needs
    BitmaskShape("tiny-bitmask", 5, 1000, 40, "float32", tiny=True),
)


@dataclass(frozen=True)
class NormShape:
    """RMSNorm over `rows` rows of `dim` (strided rows: views of a wider tensor), in one weight convention."""

    name: str
    rows: int
    dim: int
    dtype: str
    tiny: bool


NORM_SHAPES = (
    NormShape("hidden-2048", 70, 2048, "bfloat16", tiny=False),  # a decoder norm of a step of 70 tokens
    NormShape("head-128", 1000, 128, "bfloat16", tiny=False),  # GDN output norm rows (tokens x heads)
    # a tail tile of the row, a last program with fewer rows than its tile
    NormShape("tiny-norm", 37, 100, "float32", tiny=True),
)

# ---------------------------------------------------------------------------------------------------------------
# cases


def case_paged_attention(shape: AttentionShape, rows: list[tuple[int, int]], splits: int) -> Callable[[Ctx], str]:
    """rows: (cached prefix, new tokens). The pool has exactly the rows' context slots (every one used, the last
    included), the slot table exactly the longest context's width (that row last), q and out exactly the new
    tokens; `splits` > 1 splits each context (the split outputs and the combine kernel)."""

    def run(ctx: Ctx) -> str:
        from lightllm.kernels.paged_attention import paged_attention

        torch = ctx.torch
        totals = [c + q for c, q in rows]
        assert totals[-1] == max(totals), "the longest context goes last: its table row ends the table"
        perm = torch.randperm(sum(totals), generator=ctx.cpu_gen)
        table = torch.zeros(len(rows), max(totals), dtype=torch.int32)
        start = 0
        for i, t in enumerate(totals):
            table[i, :t] = perm[start : start + t]
            start += t
        k_pool = ctx.randn(sum(totals), shape.kv_heads, shape.dk, dtype=shape.dtype)
        v_pool = ctx.randn(sum(totals), shape.kv_heads, shape.dv, dtype=shape.dtype)
        q_lens = [q for _, q in rows]
        q = ctx.randn(sum(q_lens), shape.heads, shape.dk, dtype=shape.dtype)
        out = torch.empty(sum(q_lens), shape.heads, shape.dv, dtype=q.dtype, device=ctx.device)
        starts = ctx.ints([0, *torch.tensor(q_lens[:-1]).cumsum(0).tolist()])
        paged_attention(
            q,
            k_pool,
            v_pool,
            ctx.to_device(table),
            starts,
            ctx.ints(q_lens),
            ctx.ints(c for c, _ in rows),
            shape.dk**-0.5,
            max(q_lens),
            out,
            num_splits=splits,
        )
        assert bool(torch.isfinite(out).all()), "non-finite attention outputs"
        return f"pool {sum(totals)} slots"

    return run


def case_mla_attention(shape: LatentShape, rows: list[tuple[int, int]], splits: int) -> Callable[[Ctx], str]:
    """rows: (cached prefix, new tokens). The latent pool has exactly the rows' context slots, the request table
    exactly the longest context's width with the rows read through `table_rows` (reversed), q and out exactly the
    new tokens; `splits` > 1 splits each context (the split outputs and the combine kernel)."""

    def run(ctx: Ctx) -> str:
        from lightllm.kernels.mla_attention import mla_attention_triton

        torch = ctx.torch
        totals = [c + q for c, q in rows]
        perm = torch.randperm(sum(totals), generator=ctx.cpu_gen)
        table = torch.zeros(len(rows), max(totals), dtype=torch.int64)
        start = 0
        for i, t in enumerate(totals):
            table[len(rows) - 1 - i, :t] = perm[start : start + t]
            start += t
        latent = ctx.randn(sum(totals), shape.rank + shape.rope, dtype=shape.dtype)
        q_lens = [q for _, q in rows]
        q = ctx.randn(sum(q_lens), shape.heads, shape.rank + shape.rope, dtype=shape.dtype)
        out = torch.empty(sum(q_lens), shape.heads, shape.rank, dtype=q.dtype, device=ctx.device)
        starts = ctx.ints([0, *torch.tensor(q_lens[:-1]).cumsum(0).tolist()])
        table_rows = ctx.to_device(torch.arange(len(rows) - 1, -1, -1))
        mla_attention_triton(
            q,
            latent,
            ctx.to_device(table),
            starts,
            ctx.ints(q_lens),
            ctx.ints(c for c, _ in rows),
            (shape.rank + shape.rope) ** -0.5,
            max(q_lens),
            out,
            table_rows=table_rows,
            num_splits=splits,
        )
        assert bool(torch.isfinite(out).all()), "non-finite attention outputs"
        return f"pool {sum(totals)} slots"

    return run


def case_fused_moe(shape: MoEShape, num_tokens: int) -> Callable[[Ctx], str]:
    """Routing, the padded per-expert layout, both grouped GEMMs and the combine (Qwen: with the gated shared
    expert) on exact-size tensors: x, logits and the shared output exactly [T, ...], the stacked experts exactly
    [E, ...]; the worst-case padded layout leaves blocks past the real end that must read and write nothing."""

    def run(ctx: Ctx) -> str:
        from lightllm.kernels.fused_moe import fused_experts, sigmoid_topk, softmax_topk

        e, h, i = shape.experts, shape.hidden, shape.inter
        x = ctx.randn(num_tokens, h, dtype=shape.dtype)
        gate_up = ctx.randn(e, 2 * i, h, dtype=shape.dtype, scale=h**-0.5)
        down = ctx.randn(e, h, i, dtype=shape.dtype, scale=i**-0.5)
        logits = ctx.randn(num_tokens, e)
        if shape.scoring == "sigmoid":
            groups = 4 if e % 4 == 0 else 1
            weights, ids = sigmoid_topk(logits, ctx.randn(e, scale=0.1), shape.top_k, True, 2.5, groups, min(2, groups))
            out = fused_experts(x, gate_up, down, weights, ids, shared=ctx.randn(num_tokens, h, dtype=shape.dtype))
        else:
            weights, ids = softmax_topk(logits, shape.top_k, True)
            shared, gate = ctx.randn(num_tokens, h, dtype=shape.dtype), ctx.randn(num_tokens, 1, dtype=shape.dtype)
            out = fused_experts(x, gate_up, down, weights, ids, shared=shared, shared_gate_logit=gate)
        assert bool(ctx.torch.isfinite(out).all()), "non-finite MoE outputs"
        return f"{int(ids.unique().numel())} of {e} experts used"

    return run


def case_fp8_linear(shape: Fp8Shape) -> Callable[[Ctx], str]:
    """Activation quantization per token per 128 channels and the block-scaled GEMM on exact-size tensors: x
    exactly [M, K], the FP8 weight exactly [N, K] with its [ceil(N / 128), ceil(K / 128)] scales; the last tiles
    of M, N and K are partial and must read and write nothing past them."""

    def run(ctx: Ctx) -> str:
        from lightllm.kernels.fp8 import fp8_block_linear, quantize_weight_blocks

        weight, scale = quantize_weight_blocks(ctx.randn(shape.n, shape.k, scale=shape.k**-0.5))
        out = fp8_block_linear(ctx.randn(shape.m, shape.k, dtype=shape.dtype), weight, scale, backend="triton")
        assert bool(ctx.torch.isfinite(out).all()), "non-finite FP8 outputs"
        return f"scales {list(scale.shape)}"

    return run


def case_token_bitmask(shape: BitmaskShape) -> Callable[[Ctx], str]:
    """Masks applied on exact-size logits [R, V], bitmask [R, W] and output: the last vocabulary tile is partial
    and must read and write nothing past V (nor past the words of a row)."""

    def run(ctx: Ctx) -> str:
        from lightllm.kernels.token_bitmask import apply_token_bitmask_triton

        logits = ctx.randn(shape.rows, shape.vocab, dtype=shape.dtype)
        bits = ctx.torch.randint(-(2**31), 2**31 - 1, (shape.rows, shape.words), generator=ctx.gen, device=ctx.device)
        out = apply_token_bitmask_triton(logits, bits.to(ctx.torch.int32))
        kept = int(ctx.torch.isfinite(out).sum())
        assert 0 < kept < out.numel(), "the masks kept every token or none"
        return f"{kept} of {out.numel()} kept"

    return run


def case_host_flag(ctx: Ctx) -> str:
    """The device waiting on a counter in pinned host memory: one read when it is already at the target, a bounded
    number when it never gets there (the kernel gives up); one int64, read and never written."""
    from lightllm.kernels.host_flag import wait_host_flag_kernel

    flag = ctx.torch.tensor([5], dtype=ctx.torch.int64, pin_memory=ctx.device.type == "cuda")
    wait_host_flag_kernel[(1,)](flag, 5, 1 << 20)
    wait_host_flag_kernel[(1,)](flag, 6, 64)
    assert flag.item() == 5, "the wait wrote its counter"
    return "at target, then below it"


def case_rms_norm(shape: NormShape, mode: int, gate_kind: int, residual: bool, strided: bool) -> Callable[[Ctx], str]:
    """One fused norm on exact-size inputs (a strided input is a view whose last row ends at its allocation):
    the tail of the row tile and the rows past the last one must read and write nothing."""

    def run(ctx: Ctx) -> str:
        from lightllm.kernels.rms_norm import rms_norm_triton

        wide = ctx.randn(shape.rows, shape.dim + (5 if strided else 0), dtype=shape.dtype)
        x = wide[:, : shape.dim] if strided else wide
        gate = ctx.randn(shape.rows, shape.dim, dtype=shape.dtype) if gate_kind else None
        res = ctx.randn(shape.rows, shape.dim, dtype=shape.dtype) if residual else None
        weight = ctx.randn(shape.dim, dtype=shape.dtype)
        out, total = rms_norm_triton(x, weight, 1e-6, mode, gate, gate_kind, res)
        assert bool(ctx.torch.isfinite(out).all()), "non-finite norm outputs"
        return f"stride {x.stride(0)}" + (", residual" if total is not None else "")

    return run


def case_attention_io(shape: AttentionShape, tokens: int) -> Callable[[Ctx], str]:
    """Gated attention's q/k norm + RoPE (a quarter of each head rotated, the query a view of the wider projection
    row) and its output gate (the gate a view too) on exact-size inputs: the head tile's tail, the rotation
    partners and the last token must read and write nothing past their tensors."""

    def run(ctx: Ctx) -> str:
        from lightllm.kernels.qk_norm_rope import qk_norm_rope_triton, rope_cos_sin
        from lightllm.kernels.sigmoid_gate import sigmoid_gate_triton

        torch, d, rd = ctx.torch, shape.dk, 2 * (shape.dk // 8)
        q = ctx.randn(tokens, shape.heads, 2 * d, dtype=shape.dtype)[..., :d]
        k = ctx.randn(tokens, shape.kv_heads, d, dtype=shape.dtype)
        positions = torch.randint(0, 1 << 16, (tokens,), generator=ctx.gen, device=ctx.device)
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rd, 2, dtype=torch.float32, device=ctx.device) / rd))
        cos, sin = rope_cos_sin(positions, inv_freq, 1.0, q.dtype)
        q_out, k_out = qk_norm_rope_triton(q, k, ctx.randn(d, dtype=shape.dtype), ctx.randn(d, dtype=shape.dtype),
                                           1e-6, cos, sin)  # fmt: skip
        o = ctx.randn(tokens, shape.heads, shape.dv, dtype=shape.dtype)
        gate = ctx.randn(tokens, shape.heads, 2 * shape.dv, dtype=shape.dtype)[..., shape.dv :]
        out = sigmoid_gate_triton(o, gate)
        for t in (q_out, k_out, out):
            assert bool(torch.isfinite(t).all()), "non-finite outputs"
        return f"rotary {rd} of {d}"

    return run


def build_model_cases() -> list[Case]:
    cases = []
    for a in ATTENTION_SHAPES:
        # prefill chunks after a prefix and fresh, decode / verify windows of 1, 2 and 4; the longest context last
        # (rows of short contexts leave later splits empty)
        for rows in ([(0, 37), (19, 13), (61, 1), (7, 4), (0, 2), (33, 1), (90, 23)], [(12, 4), (0, 1), (40, 2)]):
            for splits in (1, 3):
                detail = f"N={len(rows)} " + " ".join(f"{c}+{q}" for c, q in rows) + f" splits={splits}"
                kernels = ("paged_attention_kernel",) + (("paged_attention_combine_kernel",) if splits > 1 else ())
                cases.append(
                    Case("paged_attention", a.name, detail, kernels, a.tiny, case_paged_attention(a, rows, splits))
                )
    for a in ATTENTION_SHAPES:
        if a.name.endswith("mla"):
            continue  # MLA has no q/k norm, RoPE or output gate of this form
        for tokens in (1, 37):
            kernels = ("qk_norm_rope_kernel", "sigmoid_gate_kernel")
            cases.append(Case("attention_io", a.name, f"T={tokens}", kernels, a.tiny, case_attention_io(a, tokens)))
    for m in MOE_SHAPES:
        router = "moe_sigmoid_topk_kernel" if m.scoring == "sigmoid" else "moe_softmax_topk_kernel"
        align = ("moe_align_count_kernel", "moe_align_plan_kernel", "moe_align_scatter_kernel")
        kernels = (router, *align, "moe_gate_up_kernel", "moe_down_kernel", "moe_combine_kernel")
        # one token (decode), a batch that leaves experts idle, one that fills several blocks of some experts, and a
        # prefill's count (the heuristic's 128-row blocks and wide tiles; partial blocks at every expert)
        for num_tokens in (1, 37, 320) if m.tiny else (1, 70, 256, 4096):
            cases.append(Case("fused_moe", m.name, f"T={num_tokens}", kernels, m.tiny, case_fused_moe(m, num_tokens)))
    for f in FP8_SHAPES:
        kernels = ("fp8_group_quant_kernel", "fp8_block_gemm_kernel")
        cases.append(Case("fp8", f.name, f"M={f.m} N={f.n} K={f.k}", kernels, f.tiny, case_fp8_linear(f)))
    for b in BITMASK_SHAPES:
        detail = f"R={b.rows} V={b.vocab}"
        cases.append(
            Case("token_bitmask", b.name, detail, ("apply_token_bitmask_kernel",), b.tiny, case_token_bitmask(b))
        )
    cases.append(
        Case("host_flag", "-", "counter at / below its target", ("wait_host_flag_kernel",), True, case_host_flag)
    )
    for n in NORM_SHAPES:
        # each convention once: Qwen's (strided input, residual add), the GDN output norm (silu gate), the KDA one
        for mode, gate_kind, residual, strided in ((0, 0, True, True), (1, 1, False, False), (2, 2, True, False)):
            detail = f"T={n.rows} D={n.dim} mode={mode} gate={gate_kind}"
            run = case_rms_norm(n, mode, gate_kind, residual, strided)
            cases.append(Case("rms_norm", n.name, detail, ("rms_norm_kernel",), n.tiny, run))
    for m in LATENT_SHAPES:
        # decode and verify windows of 1..4 and a short chunk; a row with no query (a HOLD row of a graph bucket)
        for rows in ([(61, 1), (7, 4), (0, 2), (33, 1), (90, 19)], [(12, 4), (5, 0), (40, 2)]):
            for splits in (1, 3):
                detail = f"N={len(rows)} " + " ".join(f"{c}+{q}" for c, q in rows) + f" splits={splits}"
                kernels = ("mla_attention_kernel",) + (("paged_attention_combine_kernel",) if splits > 1 else ())
                cases.append(
                    Case("mla_attention", m.name, detail, kernels, m.tiny, case_mla_attention(m, rows, splits))
                )
    return cases
