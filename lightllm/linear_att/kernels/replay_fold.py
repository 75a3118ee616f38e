"""Standalone replay fold, all layers in one launch: S_h = e^{G_h} S0 + K~^T U (for prefill and export).

Every fold -- this one and the ones inside the verify kernels -- is `fold_tile_from_records` (fp32 FMAs over the
records in order, each state element on its own), so a standalone fold and an in-kernel fold of the same history
give the same bytes whatever the tiling. In place (`out=None`) rows with an empty history are left untouched; with `out` every row is
written (an exact copy when h = 0) and `ssm` is only read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightllm.linear_att.bundles import ReplayBuffers
from lightllm.linear_att.kernels.common import (
    BATCH_VARYING_ARGS,
    fold_tile_from_records,
    layer_program_heads,
    tile_offsets,
)
from lightllm.linear_att.kernels.launch import fold_config, state_shape
from lightllm.linear_att.kernels.replay_verify import block_v, check_history


@triton.heuristics({"HAS_OUT": lambda args: args["out"] is not None})
@triton.jit(do_not_specialize=BATCH_VARYING_ARGS)
def replay_fold_kernel(
    state,
    slots,
    out,
    state_strides,
    out_strides,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    GK: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BG: tl.constexpr,
    L: tl.constexpr,
    HAS_OUT: tl.constexpr,
):
    ssm, hist_k, hist_u, hist_g, cursor, parity = state
    (
        stride_ssm_l,
        stride_ssm_s,
        stride_hk_l,
        stride_hk_s,
        stride_hk_b,
        stride_hk_j,
        stride_hu_l,
        stride_hu_s,
        stride_hu_b,
        stride_hu_j,
        stride_hg_l,
        stride_hg_s,
        stride_hg_b,
        stride_hg_j,
    ) = state_strides
    stride_out_l, stride_out_n = out_strides
    i_v, i_n, i_l, i_hv, i_h = layer_program_heads(H, HV)
    slot = tl.load(slots + i_n).to(tl.int64)
    h = tl.minimum(tl.load(cursor + slot), L)
    par = tl.load(parity + slot).to(tl.int64)

    tile = tile_offsets(i_v, K, V, GK, BK, BV, BG)
    o_k, m_k, o_v, m_v, o_g, m_g, m_kv = tile

    p_hk = hist_k + i_l * stride_hk_l + slot * stride_hk_s + par * stride_hk_b + i_h * K
    p_hg = hist_g + i_l * stride_hg_l + slot * stride_hg_s + par * stride_hg_b + i_hv * GK
    p_hu = hist_u + i_l * stride_hu_l + slot * stride_hu_s + par * stride_hu_b + i_hv * V
    history = (p_hk, p_hg, p_hu, stride_hk_j, stride_hg_j, stride_hu_j)
    b_gh = tl.load(p_hg + (h - 1) * stride_hg_j + o_g, mask=m_g & (h > 0), other=0)  # G_h [BG] (0 when h = 0)

    o_kv = i_hv * K * V + o_k[:, None] * V + o_v[None, :]
    p_s = ssm + i_l * stride_ssm_l + slot * stride_ssm_s + o_kv
    if HAS_OUT:
        b_s = tl.load(p_s, mask=m_kv, other=0).to(tl.float32)  # [BK, BV]
        b_s = fold_tile_from_records(b_s, b_gh, history, h, tile)
        p_out = out + i_l * stride_out_l + i_n * stride_out_n + o_kv
        tl.store(p_out, b_s.to(p_out.dtype.element_ty), mask=m_kv)
    else:
        # an empty history leaves the state as it is: skip both the read and the write
        b_s = tl.load(p_s, mask=m_kv & (h > 0), other=0).to(tl.float32)
        b_s = fold_tile_from_records(b_s, b_gh, history, h, tile)
        tl.store(p_s, b_s.to(p_s.dtype.element_ty), mask=m_kv & (h > 0))


def replay_fold_triton(
    state: ReplayBuffers,
    slots: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    config=None,
    algorithm=None,
) -> None:
    """Fold the committed history of `slots` into the canonical state, all layers (see `ops.replay_fold`).

    `state` holds all layers: ssm `[NL, S, HV, K, V]`, fp32 history `[NL, S, 2, L, ...]`, cursor / parity `[S]`
    int32 (read only; the caller clears them); slots `[n]` int32.
    out=None: in place `ssm[:, slot] <- S_h` (rounded once). out `[NL, n, HV, K, V]`: written instead, ssm read only.
    `config` pins the launch configuration, else `algorithm`'s table gives it (no algorithm: the gate width's).
    """

    ssm, hist_k, hist_g = state.ssm, state.hist_k, state.hist_g
    NL, _, HV, K, V = ssm.shape
    H, L, GK = hist_k.shape[4], hist_k.shape[3], hist_g.shape[-1]
    n = slots.shape[0]
    assert ssm.stride(2) == K * V and ssm.stride(3) == V and ssm.stride(4) == 1
    check_history(state, H, HV, K, V, GK, leading=2)
    if out is not None:
        assert out.shape == (NL, n, HV, K, V) and out.stride(2) == K * V and out.stride(4) == 1 and out.stride(3) == V
    if n == 0 or NL == 0:
        return
    cfg = fold_config(config, algorithm, ssm.dtype, H, HV, K, V, GK, L, ssm.device)
    BV = block_v(cfg, V, ssm.device)
    replay_fold_kernel[(triton.cdiv(V, BV), n, NL * HV)](
        state.pointers,
        slots,
        out,
        state.strides,
        tuple(out.stride()[:2]) if out is not None else (0, 0),
        **state_shape(H, HV, K, V, GK, BV),
        L=L,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
