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

Fold, decided per row on the device: if `h + W > L`, each program rebuilds S_h = e^{G_h} S0 + K~^T U on its own
columns (`common.fold_if_full`), stores it rounded once and continues from it with an empty history; the
window's records go to positions 0..W-1 of buffer `1 - p`, otherwise to h..h+W-1 of buffer `p`. Readers in a
launch only read buffer `p` at positions < h, so no program overwrites a record another program (another V
tile, another value head of the key group) still reads. The cursor kernel applies the same predicate after
the step (`kernels/cursor.py`).
"""

from __future__ import annotations

from functools import partial

import torch
import triton

from lightllm.linear_att.kernels.replay_decode import replay_decode_triton
from lightllm.linear_att.kernels.replay_window import replay_window_triton


def replay_verify_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    graw: torch.Tensor,
    braw: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm: torch.Tensor,
    hist_k: torch.Tensor,
    hist_u: torch.Tensor,
    hist_g: torch.Tensor,
    cursor: torch.Tensor,
    parity: torch.Tensor,
    slots: torch.Tensor,
    widths: torch.Tensor,
    *,
    projection: str = "inline",
    scale: float | None = None,
    lower_bound: float | None = None,
    config=None,
) -> torch.Tensor:
    """Replay verify of one layer (see `ops.replay_verify`), one launch, fold decided on the device.

    ssm `[S, HV, K, V]` (state dtype; in place only for rows that fold: `ssm[slot] <- S_h`); hist_k `[S, 2, L, H, K]`,
    hist_u `[S, 2, L, HV, V]`, hist_g `[S, 2, L, HV, GK]` fp32 (in place: the window's records, positions h..h+W-1
    of buffer p, or 0..W-1 of buffer 1-p on a fold); cursor / parity `[S]` int32 (read only); slots / widths `[N]`
    int32. Returns o `[N, Wmax, HV, V]` (dtype of v, zeros for s >= W). `config`: a `KernelConfig` (V tile, warps)
    or None for the tuned / default one of this shape, width and projection.
    """
    from lightllm.linear_att.kernels.launch import check_verify_inputs, replay_config

    N, WMAX, H, K = q.shape
    HV, V, GK = v.shape[2], v.shape[3], graw.shape[-1]
    L = hist_k.shape[2]
    check_verify_inputs(q, k, v, graw, braw, A_log, dt_bias, slots, widths)
    if projection not in ("inline", "precompute"):
        raise ValueError(f"projection must be 'inline' or 'precompute', got {projection!r}")
    assert L >= WMAX, f"replay capacity {L} must cover the verify width {WMAX}"
    assert ssm.dim() == 4 and ssm.shape[1:] == (HV, K, V) and ssm.stride(1) == K * V and ssm.stride(3) == 1
    _check_history(hist_k, hist_u, hist_g, H, HV, K, V, GK, leading=1)
    cfg = config or replay_config(ssm.dtype, v.dtype, H, HV, K, V, GK, WMAX, L, projection, ssm.device)
    BV = block_v(cfg, V, ssm.device)
    scale = K**-0.5 if scale is None else scale
    kernel = replay_decode_triton if WMAX == 1 else partial(replay_window_triton, projection=projection)
    return kernel(
        q,
        k,
        v,
        graw,
        braw,
        A_log,
        dt_bias,
        ssm,
        hist_k,
        hist_u,
        hist_g,
        cursor,
        parity,
        slots,
        widths,
        scale=scale,
        lower_bound=lower_bound,
        block_v=BV,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def block_v(cfg, V: int, device: torch.device) -> int:
    """V tile of the replay kernels (at most V, at least 16 columns on the GPU)."""
    bv = min(cfg.block_v, triton.next_power_of_2(V))
    return max(bv, 16) if device.type == "cuda" else bv


def _check_history(hist_k, hist_u, hist_g, H, HV, K, V, GK, leading):
    lead = tuple(hist_k.shape[:leading])
    L = hist_k.shape[leading + 1]
    assert hist_k.shape == (*lead, 2, L, H, K), f"hist_k {tuple(hist_k.shape)}"
    wl = hist_k.shape[: leading + 2]
    assert hist_u.shape == (*wl, HV, V) and hist_g.shape == (*wl, HV, GK), (
        f"hist_u {tuple(hist_u.shape)} / hist_g {tuple(hist_g.shape)} do not match hist_k {tuple(hist_k.shape)}"
    )
    for t in (hist_k, hist_u, hist_g):
        assert t.dtype == torch.float32, "replay history records are fp32"
        assert t.stride(-1) == 1 and t.stride(-2) == t.shape[-1], "history heads must be contiguous"
