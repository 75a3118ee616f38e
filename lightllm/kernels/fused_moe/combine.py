"""The deterministic combine: each token's top_k expert rows summed in a fixed order, plus the shared expert.

`out[t] = sum_{j=0..k-1} pair_out[t, j] (+ sigmoid(gate_logit[t]) * shared[t])`, fp32 sums, one store in the
output dtype. Program `(i_t, i_n)` owns a `[BT, BN]` tile of tokens x hidden: no atomics, the same bits every run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.heuristics(
    {"HAS_SHARED": lambda args: args["shared"] is not None, "HAS_GATE": lambda args: args["gate_logit"] is not None}
)
@triton.jit(do_not_specialize=["T"])
def moe_combine_kernel(
    pair_out,  # [T, TOP_K, H] fp32
    shared,  # [T, H] or None
    gate_logit,  # [T] (stride stride_gt) or None
    out,  # [T, H]
    T,
    H,
    stride_pt,
    stride_st,
    stride_gt,
    stride_ot,
    TOP_K: tl.constexpr,
    BT: tl.constexpr,
    BN: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    HAS_GATE: tl.constexpr,
):
    i_t, i_n = tl.program_id(0), tl.program_id(1)
    o_t = (i_t * BT + tl.arange(0, BT)).to(tl.int64)
    o_n = i_n * BN + tl.arange(0, BN)
    m_t = o_t < T
    m = m_t[:, None] & (o_n < H)[None, :]
    b_o = tl.zeros([BT, BN], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        b_o += tl.load(pair_out + o_t[:, None] * stride_pt + j * H + o_n[None, :], mask=m, other=0.0)
    if HAS_SHARED:
        b_s = tl.load(shared + o_t[:, None] * stride_st + o_n[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_GATE:
            b_g = tl.load(gate_logit + o_t * stride_gt, mask=m_t, other=0.0).to(tl.float32)
            b_s = b_s * tl.sigmoid(b_g)[:, None]
        b_o += b_s
    tl.store(out + o_t[:, None] * stride_ot + o_n[None, :], b_o.to(out.dtype.element_ty), mask=m)


def combine(
    pair_out: torch.Tensor,
    out: torch.Tensor,
    shared: torch.Tensor | None = None,
    gate_logit: torch.Tensor | None = None,
) -> torch.Tensor:
    """`pair_out [T, k, H]` fp32 (contiguous) -> `out [T, H]` (written in place and returned); `shared [T, H]`
    is added, scaled by `sigmoid(gate_logit [T] or [T, 1])` when given."""
    num_tokens, top_k, hidden = pair_out.shape
    assert pair_out.is_contiguous() and out.shape == (num_tokens, hidden) and out.stride(-1) == 1
    assert gate_logit is None or shared is not None, "a shared-expert gate needs the shared expert"
    if shared is not None:
        assert shared.shape == (num_tokens, hidden) and shared.stride(-1) == 1, f"shared {tuple(shared.shape)}"
    if gate_logit is not None:
        assert gate_logit.numel() == num_tokens, f"gate_logit {tuple(gate_logit.shape)} for {num_tokens} tokens"
        gate_logit = gate_logit.reshape(num_tokens)
    if num_tokens == 0:
        return out
    # [BT, BN] tiles of 2048 elements whatever the token count (one compiled variant per model)
    bn = min(512, triton.next_power_of_2(hidden))
    bt = 2048 // bn
    moe_combine_kernel[(triton.cdiv(num_tokens, bt), triton.cdiv(hidden, bn))](
        pair_out,
        shared,
        gate_logit,
        out,
        num_tokens,
        hidden,
        pair_out.stride(0),
        0 if shared is None else shared.stride(0),
        0 if gate_logit is None else gate_logit.stride(0),
        out.stride(0),
        TOP_K=top_k,
        BT=bt,
        BN=bn,
        num_warps=4,
    )
    return out
