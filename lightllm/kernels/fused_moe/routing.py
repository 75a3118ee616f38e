"""Router top-k on the device: every output a fixed shape (no host sync, graph-safe).

Qwen (`softmax_topk`): softmax over all experts in fp32, the top-k probabilities, optionally renormalised to sum
to one. Kimi / DeepSeek-V3 (`sigmoid_topk`): sigmoid scores; the choice ranks score + correction bias, restricted
to the best `topk_groups` groups (a group scores the sum of its two best biased scores); the weights are the
unbiased scores of the chosen experts, optionally renormalised, times `routed_scaling_factor`.

A program routes 8 tokens; top-k is k rounds of argmax over its `[BT, BE]` register block (ties go to
the lowest expert id), so each token's logits are read once. The torch references are `route_softmax` / `route_sigmoid` in
`lightllm.models.layers.moe`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_topk(
    b_val,
    b_src,
    o_e,
    o_t,
    m_t,
    weights,
    ids,
    scale,
    TOP_K: tl.constexpr,
    BT: tl.constexpr,
    BKP: tl.constexpr,
    NORM: tl.constexpr,
):
    """k rounds of argmax along the experts of `b_val` ([BT, BE], -inf on lanes that may not be chosen); writes
    the ids and the matching entries of `b_src`, renormalised when NORM, times `scale`, to rows `o_t` of `ids` /
    `weights` ([T, TOP_K])."""
    o_k = tl.arange(0, BKP)
    b_ids = tl.zeros([BT, BKP], dtype=tl.int32)
    b_w = tl.zeros([BT, BKP], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        i_best = tl.argmax(b_val, axis=1, tie_break_left=True)  # [BT]
        m_best = o_e[None, :] == i_best[:, None]  # [BT, BE]
        w = tl.sum(tl.where(m_best, b_src, 0.0), axis=1)
        b_ids = tl.where(o_k[None, :] == j, i_best[:, None], b_ids)
        b_w = tl.where(o_k[None, :] == j, w[:, None], b_w)
        b_val = tl.where(m_best, float("-inf"), b_val)
    if NORM:
        b_w = b_w / (tl.sum(b_w, axis=1)[:, None] + 1e-20)
    b_w = b_w * scale
    o_out = o_t.to(tl.int64)[:, None] * TOP_K + o_k[None, :]
    m_out = m_t[:, None] & (o_k[None, :] < TOP_K)
    tl.store(ids + o_out, b_ids, mask=m_out)
    tl.store(weights + o_out, b_w, mask=m_out)


@triton.jit
def _load_logits(logits, stride_lt, i_b, T, E, BT: tl.constexpr, BE: tl.constexpr):
    """Rows `i_b * BT ..` of the logits as fp32 `[BT, BE]` (0 on rows past T), the lane and row offsets/masks."""
    o_t = i_b * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_e = tl.arange(0, BE)
    m_e = o_e < E
    p_l = logits + o_t.to(tl.int64)[:, None] * stride_lt + o_e[None, :]
    b_l = tl.load(p_l, mask=m_t[:, None] & m_e[None, :], other=0.0).to(tl.float32)
    return b_l, o_t, m_t, o_e, m_e


# the token count varies from launch to launch: specialising on it would compile variants mid-serving
@triton.jit(do_not_specialize=["T"])
def moe_softmax_topk_kernel(
    logits,  # [T, E]
    weights,  # [T, TOP_K] fp32
    ids,  # [T, TOP_K] int32
    stride_lt,
    T,
    E,
    TOP_K: tl.constexpr,
    BT: tl.constexpr,
    BE: tl.constexpr,
    BKP: tl.constexpr,
    NORM: tl.constexpr,
):
    b_l, o_t, m_t, o_e, m_e = _load_logits(logits, stride_lt, tl.program_id(0), T, E, BT, BE)
    b_l = tl.where(m_e[None, :], b_l, float("-inf"))
    b_p = tl.exp(b_l - tl.max(b_l, axis=1)[:, None])
    b_p = b_p / tl.sum(b_p, axis=1)[:, None]
    b_val = tl.where(m_e[None, :], b_p, float("-inf"))
    _store_topk(b_val, b_p, o_e, o_t, m_t, weights, ids, 1.0, TOP_K, BT, BKP, NORM)


@triton.jit(do_not_specialize=["T"])
def moe_sigmoid_topk_kernel(
    logits,  # [T, E]
    bias,  # [E] fp32 correction bias of the choice
    weights,  # [T, TOP_K] fp32
    ids,  # [T, TOP_K] int32
    stride_lt,
    T,
    E,
    scale,
    TOP_K: tl.constexpr,
    BT: tl.constexpr,
    BE: tl.constexpr,
    BKP: tl.constexpr,
    NORM: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    TOPK_GROUPS: tl.constexpr,
    BG: tl.constexpr,
):
    b_l, o_t, m_t, o_e, m_e = _load_logits(logits, stride_lt, tl.program_id(0), T, E, BT, BE)
    b_s = tl.sigmoid(b_l)
    b_bias = tl.load(bias + o_e, mask=m_e, other=0.0).to(tl.float32)
    b_c = tl.where(m_e[None, :], b_s + b_bias[None, :], float("-inf"))  # [BT, BE]
    if NUM_GROUPS > 1:
        g_e = o_e // (E // NUM_GROUPS)
        o_g = tl.arange(0, BG)
        # a group scores the sum of its two best biased scores
        b_gs = tl.full([BT, BG], float("-inf"), dtype=tl.float32)
        for g in tl.static_range(NUM_GROUPS):
            b_in = tl.where((g_e == g)[None, :], b_c, float("-inf"))
            i_first = tl.argmax(b_in, axis=1, tie_break_left=True)
            first = tl.max(b_in, axis=1)
            second = tl.max(tl.where(o_e[None, :] == i_first[:, None], float("-inf"), b_in), axis=1)
            b_gs = tl.where((o_g == g)[None, :], (first + second)[:, None], b_gs)
        b_keep = b_c != b_c  # all False, [BT, BE]
        for _ in tl.static_range(TOPK_GROUPS):
            i_g = tl.argmax(b_gs, axis=1, tie_break_left=True)
            b_keep = b_keep | (g_e[None, :] == i_g[:, None])
            b_gs = tl.where(o_g[None, :] == i_g[:, None], float("-inf"), b_gs)
        b_c = tl.where(b_keep, b_c, float("-inf"))
    _store_topk(b_c, b_s, o_e, o_t, m_t, weights, ids, scale, TOP_K, BT, BKP, NORM)


# tokens per program, fixed: one compiled variant per model whatever the batch
TOKENS_PER_PROGRAM = 8


def _outputs(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_experts = logits.shape
    assert logits.stride(-1) == 1, "router logits need a contiguous expert dim"
    assert 1 <= top_k <= num_experts, f"top_k {top_k} not in 1..{num_experts}"
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    return weights, ids


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`logits [T, E]` (any float dtype) -> (weights `[T, k]` fp32, ids `[T, k]` int32), best first."""
    weights, ids = _outputs(logits, top_k)
    if logits.shape[0] == 0:
        return weights, ids
    num_experts = logits.shape[1]
    num_tokens, bt = logits.shape[0], TOKENS_PER_PROGRAM
    moe_softmax_topk_kernel[(triton.cdiv(num_tokens, bt),)](
        logits,
        weights,
        ids,
        logits.stride(0),
        num_tokens,
        num_experts,
        TOP_K=top_k,
        BT=bt,
        BE=triton.next_power_of_2(num_experts),
        BKP=triton.next_power_of_2(top_k),
        NORM=renormalize,
        num_warps=4 if num_experts >= 256 else 1,
    )
    return weights, ids


def sigmoid_topk(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scaling: float,
    num_groups: int = 1,
    topk_groups: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`logits [T, E]`, `bias [E]` -> (weights `[T, k]` fp32, ids `[T, k]` int32), best (biased) first.
    `num_groups` must divide E; with one group the choice is a plain top-k of score + bias."""
    weights, ids = _outputs(logits, top_k)
    num_experts = logits.shape[1]
    assert bias.shape == (num_experts,) and bias.stride(0) == 1, f"bias {tuple(bias.shape)} for {num_experts} experts"
    assert num_experts % num_groups == 0 and 1 <= topk_groups <= num_groups, (
        f"{num_experts} experts in {num_groups} groups, top {topk_groups} groups"
    )
    if logits.shape[0] == 0:
        return weights, ids
    num_tokens, bt = logits.shape[0], TOKENS_PER_PROGRAM
    moe_sigmoid_topk_kernel[(triton.cdiv(num_tokens, bt),)](
        logits,
        bias,
        weights,
        ids,
        logits.stride(0),
        num_tokens,
        num_experts,
        float(scaling),
        TOP_K=top_k,
        BT=bt,
        BE=triton.next_power_of_2(num_experts),
        BKP=triton.next_power_of_2(top_k),
        NORM=renormalize,
        NUM_GROUPS=num_groups,
        TOPK_GROUPS=topk_groups,
        BG=triton.next_power_of_2(num_groups),
        num_warps=4 if num_experts >= 256 else 1,
    )
    return weights, ids
