"""Replay decode/verify entry point: read the canonical state S0 and the committed history, never write S0 except
on a fold.

With `h = cursor[slot]` committed records in buffer `p = parity[slot]` (k_hat_j per key head, u_j per value head,
cumulative gate G_j since S0, all fp32) and the window's cumulative gates G_s (through token s), token s needs

    S_{h+s}^T (e^{g_s} x) = S0^T (e^{G_s} x) + sum_j u_j ((e^{G_s - G_j} k_hat_j) . x),  x in {k_hat_s, q_hat_s}

where j runs over the committed records and the window tokens r < s (key side) / r <= s (query side). Every
weight is a forward decay e^{<= 0}.

Both cases are one launch, one program per (V tile, row, value head): plain decode (W = 1) is
`kernels/replay_decode.py`, a window (W > 1) is `kernels/replay_window.py` under either projection ("inline":
S0 contracted token by token inside the window loop; "precompute": for every window token before it). Every
contraction is fp32 FMAs on registers.

Fold, decided per row on the device (`common.replay_folds`): each program rebuilds S_h = e^{G_h} S0 + K~^T U on its own
columns (`common.fold_if_full`), stores it rounded once and continues from it with an empty history; the
window's records go to positions 0..W-1 of buffer `1 - p`, otherwise to h..h+W-1 of buffer `p`. Readers in a
launch only read buffer `p` at positions < h, so no program overwrites a record another program (another V
tile, another value head of the key group) still reads. The cursor kernel applies the same predicate after
the step (`kernels/cursor.py`).
"""

from __future__ import annotations

import torch
import triton

from lightllm.linear_att.bundles import ReplayBuffers, TokenInputs
from lightllm.linear_att.kernels.launch import check_verify_inputs, filled_block_v, replay_config, sm_count
from lightllm.linear_att.kernels.replay_decode import replay_decode_triton
from lightllm.linear_att.kernels.replay_window import replay_window_triton


def replay_verify_triton(
    tokens: TokenInputs,
    state: ReplayBuffers,
    slots,
    widths,
    *,
    projection: str = "inline",
    config=None,
    algorithm=None,
) -> torch.Tensor:
    """Replay verify of one layer (see `ops.replay_verify`), one launch, fold decided on the device.

    `state`: ssm `[S, HV, K, V]` (state dtype; in place only for rows that fold: `ssm[slot] <- S_h`), fp32 history
    `[S, 2, L, ...]` (in place: the window's records, positions h..h+W-1 of buffer p, or 0..W-1 of buffer 1-p on a
    fold), cursor / parity `[S]` int32 (read only); slots / widths `[N]` int32. Returns o `[N, Wmax, HV, V]` (dtype
    of v, zeros for s >= W). `config`: a `KernelConfig` (V tile, warps) to launch with, or None for the one
    `algorithm`'s table holds for this shape, width and projection (no algorithm: the one of the gate width).
    """

    N, WMAX, H, K = tokens.q.shape
    HV, V = tokens.v.shape[2:]
    GK, L, ssm = tokens.graw.shape[-1], state.replay_capacity, state.ssm
    check_verify_inputs(tokens, slots, widths)
    if projection not in ("inline", "precompute"):
        raise ValueError(f"projection must be 'inline' or 'precompute', got {projection!r}")
    assert L >= WMAX, f"replay replay_capacity {L} must cover the verify width {WMAX}"
    assert ssm.dim() == 4 and ssm.shape[1:] == (HV, K, V) and ssm.stride(1) == K * V and ssm.stride(3) == 1
    check_history(state, H, HV, K, V, GK, leading=1)
    cfg = replay_config(
        config,
        algorithm,
        ssm.dtype,
        tokens.v.dtype,
        H,
        HV,
        K,
        V,
        GK,
        WMAX,
        L,
        projection,
        ssm.device,
        tokens.lower_bound,
    )
    # a pinned configuration is launched as given; a looked-up one is narrowed for a batch too small to fill the GPU
    bv = block_v(cfg, V, ssm.device)
    if config is None:
        bv = filled_block_v(bv, V, N * HV, sm_count(ssm.device))
    launch = dict(block_v=bv, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if WMAX == 1:
        return replay_decode_triton(tokens, state, slots, widths, **launch)
    return replay_window_triton(tokens, state, slots, widths, projection=projection, **launch)


def block_v(cfg, V: int, device: torch.device) -> int:
    """V tile of the replay kernels (at most V, at least 16 columns on the GPU)."""
    bv = min(cfg.block_v, triton.next_power_of_2(V))
    return max(bv, 16) if device.type == "cuda" else bv


def check_history(state: ReplayBuffers, H, HV, K, V, GK, leading):
    """History buffers `[*lead, S, 2, L, ...]` fp32, `leading` dims up to and including the slot dim."""
    hist_k, hist_u, hist_g = state.history
    lead = tuple(hist_k.shape[:leading])
    L = hist_k.shape[leading + 1]
    assert hist_k.shape == (*lead, 2, L, H, K), f"hist_k {tuple(hist_k.shape)}"
    wl = hist_k.shape[: leading + 2]
    assert hist_u.shape == (*wl, HV, V) and hist_g.shape == (*wl, HV, GK), (
        f"hist_u {tuple(hist_u.shape)} / hist_g {tuple(hist_g.shape)} do not match hist_k {tuple(hist_k.shape)}"
    )
    for t in state.history:
        assert t.dtype == torch.float32, "replay history records are fp32"
        assert t.stride(-1) == 1 and t.stride(-2) == t.shape[-1], "history heads must be contiguous"
