"""The operator entry points of the linear-attention state (GDN and KDA share every one; GDN is KDA with GK = 1).

Each function runs the Triton kernel on CUDA tensors and the torch twin (`torch_ops/`) on CPU tensors.
`backend="triton"` forces the kernel (CPU interpreter tests), `backend="torch"` forces the twin. Triton kernels
live in `lightllm.linear_att.kernels.<module>` as `<op>_triton` with the same arguments as the op here (minus
`backend`); they are imported lazily so importing this module compiles nothing.

Shared names (see README.md of this package): `N` rows, `Wmax` padded window width, `H`/`HV` key/value heads,
`K`/`V` head dims, `GK` gate width (1 GDN, K KDA), `C = 2·H·K + HV·V` conv channels, `Kc` conv kernel size,
`S` state slots, `L` replay capacity, `NL` layers.

Token inputs of the verify ops (post conv + SiLU, activation dtype unless stated):
  q, k `[N, Wmax, H, K]` (raw: l2norm and the scale are applied inside), v `[N, Wmax, HV, V]`,
  graw `[N, Wmax, HV, GK]` and braw `[N, Wmax, HV]` (raw gate / beta logits, any float dtype),
  A_log `[HV]` fp32, dt_bias `[HV, GK]` fp32, slots `[N]` int32, widths `[N]` int32 in [0, Wmax].
Every verify op returns `o [N, Wmax, HV, V]` in the dtype of `v`; tokens `s >= widths[i]` of a row get zeros.
Rows with `widths[i] == 0` (padding, the HOLD slot) read and write no state.
Gates: `g = -exp(A_log) * softplus(graw + dt_bias)` or, with `lower_bound`, the bounded KDA form
`g = lower_bound * sigmoid(exp(A_log) * (graw + dt_bias))`; `beta = sigmoid(braw)`; both fp32.
`scale` defaults to `K ** -0.5`.

Rounding: native and compact compute in fp32 and round the running state to the storage dtype after every token
(outputs are taken from the fp32 state before that rounding); replay keeps records fp32 and rounds the state only
when it folds it into `ssm`.
"""

from __future__ import annotations

import importlib

import torch


def _use_triton(backend: str | None, like: torch.Tensor) -> bool:
    if backend is None:
        return like.is_cuda
    if backend not in ("triton", "torch"):
        raise ValueError(f"backend must be 'triton', 'torch' or None, got {backend!r}")
    return backend == "triton"


def _triton_impl(module: str, name: str):
    """The Triton host wrapper `lightllm.linear_att.kernels.<module>.<name>`, or NotImplementedError if absent."""
    full = f"lightllm.linear_att.kernels.{module}"
    try:
        mod = importlib.import_module(full)
    except ModuleNotFoundError as err:
        if err.name != full:
            raise
        raise NotImplementedError(f"no Triton kernel module {full}") from err
    fn = getattr(mod, name, None)
    if fn is None:
        raise NotImplementedError(f"{full} has no {name}")
    return fn


def _impl(backend: str | None, like: torch.Tensor, triton_module: str, torch_module: str, name: str):
    """`kernels.<triton_module>.<name>_triton` or `torch_ops.<torch_module>.<name>`, by backend / device of `like`."""
    if _use_triton(backend, like):
        return _triton_impl(triton_module, f"{name}_triton")
    return getattr(importlib.import_module(f"lightllm.linear_att.torch_ops.{torch_module}"), name)


def activate_gates(
    graw: torch.Tensor,
    braw: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate and beta activations in fp32 (torch): `graw [..., HV, GK]`, `braw [..., HV]` -> `(g, beta)` same shapes.

    The torch twins and prefill call this one function, so every torch path sees bitwise identical gates.
    """
    from lightllm.linear_att.torch_ops import prep

    return prep.activate_gates(graw, braw, A_log, dt_bias, lower_bound)


def causal_conv_prefill(
    x: torch.Tensor,
    conv: torch.Tensor,
    conv_offset: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    has_initial_state: torch.Tensor,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Causal depthwise conv + SiLU over the packed prefill tokens of `N` rows.

    x `[T, C]` pre-conv activations; conv `[S, C, Kc - 1 + Wmax - 1]` one layer's window buffer (activation dtype);
    conv_offset `[S]` int32; slots `[N]` int32; cu_seqlens `[N + 1]` int32/int64; weight `[C, Kc]`; bias `[C]` or
    None; has_initial_state `[N]` bool (False: the history is zeros).
    Row i's history is `conv[slots[i], :, off : off + Kc - 1]` (`off = conv_offset[slots[i]]`).
    In place: writes the last `Kc - 1` inputs of each row's `[history | x]` back at the same columns (rows with
    no tokens write nothing). Returns `y [T, C]` in the dtype of `x`.
    """
    fn = _impl(backend, x, "conv", "conv", "causal_conv_prefill")
    return fn(x, conv, conv_offset, slots, cu_seqlens, weight, bias, has_initial_state)


def causal_conv_decode(
    x: torch.Tensor,
    conv: torch.Tensor,
    conv_offset: torch.Tensor,
    slots: torch.Tensor,
    widths: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Causal depthwise conv + SiLU over verify windows: x `[N, Wmax, C]` -> y `[N, Wmax, C]` (dtype of x).

    Token s of row i sees its history `conv[slot, :, off : off + Kc - 1]` and inputs `0..s`.
    In place: rewrites `conv[slot, :, 0 : Kc - 2 + W]` as `[history[1:] | x_0 .. x_{W-1}]` (W = widths[i]);
    `accept(a)` later sets `conv_offset[slot] = a - 1`. Rows with width 0 write nothing and get zeros.
    """
    fn = _impl(backend, x, "conv", "conv", "causal_conv_decode")
    return fn(x, conv, conv_offset, slots, widths, weight, bias)


def native_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    graw: torch.Tensor,
    braw: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm: torch.Tensor,
    ssm_index: torch.Tensor,
    slots: torch.Tensor,
    widths: torch.Tensor,
    *,
    scale: float | None = None,
    lower_bound: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Native decode/verify of one layer. ssm `[S, Wmax, HV, K, V]` (state dtype), ssm_index `[S]` int32.

    Reads `ssm[slot, ssm_index[slot]]`; in place: writes the state after window token s into `ssm[slot, s]` for
    s < W (rounded to the state dtype after every token). Returns o `[N, Wmax, HV, V]`.
    """
    fn = _impl(backend, q, "native_verify", "verify", "native_verify")
    return fn(q, k, v, graw, braw, A_log, dt_bias, ssm, ssm_index, slots, widths, scale=scale, lower_bound=lower_bound)


def compact_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    graw: torch.Tensor,
    braw: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm: torch.Tensor,
    win_k: torch.Tensor,
    win_v: torch.Tensor,
    win_g: torch.Tensor,
    win_beta: torch.Tensor,
    pending: torch.Tensor,
    parity: torch.Tensor,
    slots: torch.Tensor,
    widths: torch.Tensor,
    *,
    scale: float | None = None,
    lower_bound: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Compact verify of one layer: merge the previous window's accepted tokens, then verify like `native_verify`.

    ssm `[S, HV, K, V]`; win_k `[S, 2, Wmax, H, K]` and win_v `[S, 2, Wmax, HV, V]` (activation dtype, raw k / v),
    win_g `[S, 2, Wmax, HV, GK]` and win_beta `[S, 2, Wmax, HV]` (fp32 activated gate and beta): two window buffers
    per slot; pending / parity `[S]` int32 (read only): the slot's accepted tokens not yet in `ssm` and the buffer
    holding them. For each row with W > 0, in place:
      1. `ssm[slot]` <- the state after the first `pending[slot]` tokens of buffer `parity[slot]`, with native's op
         order and per-token rounding (written only when pending > 0; one read and at most one write of the state);
      2. tokens s < W of the row go to buffer `1 - parity[slot]` (the buffer `accept` makes current next).
    Rows with W = 0 touch nothing (their pending tokens stay pending). Returns o `[N, Wmax, HV, V]`, bitwise equal to
    `native_verify`'s from the same (merged) state.
    """
    fn = _impl(backend, q, "compact", "verify", "compact_verify")
    return fn(
        q,
        k,
        v,
        graw,
        braw,
        A_log,
        dt_bias,
        ssm,
        win_k,
        win_v,
        win_g,
        win_beta,
        pending,
        parity,
        slots,
        widths,
        scale=scale,
        lower_bound=lower_bound,
    )


def compact_commit(
    ssm: torch.Tensor,
    win_k: torch.Tensor,
    win_v: torch.Tensor,
    win_g: torch.Tensor,
    win_beta: torch.Tensor,
    pending: torch.Tensor,
    parity: torch.Tensor,
    slots: torch.Tensor,
    *,
    backend: str | None = None,
) -> None:
    """Merge the pending tokens of the slots of `slots [N]` into the state, all layers in one call.

    ssm `[NL, S, HV, K, V]`, win_* `[NL, S, 2, Wmax, ...]` (any leading layer count: pass `[l : l + 1]` views for one
    layer), pending / parity `[S]` int32. In place: `ssm[:, slot]` <- the state after the first `pending[slot]`
    tokens of window buffer `parity[slot]`, replayed with native's op order and per-token rounding (the merge step of
    `compact_verify`, so compact == native bitwise); slots with pending 0 are untouched. `pending` is not cleared
    (the caller clears it once the merge is no longer needed). Pass gathered copies (slots `0..n-1`) to merge into
    copies and leave the state alone (checkpoint export).
    """
    fn = _impl(backend, ssm, "compact", "verify", "compact_commit")
    return fn(ssm, win_k, win_v, win_g, win_beta, pending, parity, slots)


def replay_verify(
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
    backend: str | None = None,
) -> torch.Tensor:
    """Replay decode/verify of one layer from the canonical state plus the committed history.

    ssm `[S, HV, K, V]` (state dtype); hist_k `[S, 2, L, H, K]`, hist_u `[S, 2, L, HV, V]`,
    hist_g `[S, 2, L, HV, GK]` (fp32; `hist_g` holds the cumulative gate G_j since `ssm`); cursor, parity `[S]`
    int32 (read only). With `h = cursor[slot]`, `p = parity[slot]`:
      h + W > L (fold): in place `ssm[slot] <- S_h` (fp32 math, rounded once), records of the window go to
      buffer `1 - p` at positions 0..W-1 (G restarting from 0);
      otherwise records go to buffer `p` at positions h..h+W-1.
    projection: "inline" or "precompute", the order of the Triton window kernel for W > 1 (same math, one launch,
    `kernels/replay_window.py`): S0 and the history contracted per token inside the window loop, or for every
    token of the window before it; plain decode (W = 1) has one path.
    Returns o `[N, Wmax, HV, V]`.
    """
    if projection not in ("inline", "precompute"):
        raise ValueError(f"projection must be 'inline' or 'precompute', got {projection!r}")
    fn = _impl(backend, q, "replay_verify", "replay", "replay_verify")
    return fn(
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
        projection=projection,
        scale=scale,
        lower_bound=lower_bound,
    )


def replay_accept(
    cursor: torch.Tensor,
    parity: torch.Tensor,
    conv_offset: torch.Tensor,
    slots: torch.Tensor,
    widths: torch.Tensor,
    accepted: torch.Tensor,
    capacity: int,
    *,
    backend: str | None = None,
) -> None:
    """Advance the per-slot scalars once per step after the last layer (device side, no host sync).

    cursor, parity, conv_offset `[S]` int32, in place; slots, widths, accepted `[N]` int32. For rows with W > 0:
    fold (`h + W > capacity`) -> `cursor = a`, `parity ^= 1`; else `cursor = h + a`; and `conv_offset = a - 1`.
    """
    fn = _impl(backend, cursor, "cursor", "replay", "replay_accept")
    return fn(cursor, parity, conv_offset, slots, widths, accepted, capacity)


def replay_fold(
    ssm: torch.Tensor,
    hist_k: torch.Tensor,
    hist_u: torch.Tensor,
    hist_g: torch.Tensor,
    cursor: torch.Tensor,
    parity: torch.Tensor,
    slots: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    backend: str | None = None,
) -> None:
    """Fold the committed history of `slots` into the canonical state, all layers in one call.

    ssm `[NL, S, HV, K, V]`, hist_* `[NL, S, 2, L, ...]` (any leading layer count). With `out=None`, in place:
    `ssm[:, slot] <- S_h` (fp32 math, rounded once to the state dtype); cursor/parity are NOT changed (the
    caller clears them once for all layers). With `out [NL, n, HV, K, V]` (n = len(slots)), writes the folded
    states there and leaves `ssm` untouched (checkpoint export).
    """
    fn = _impl(backend, ssm, "replay_fold", "replay", "replay_fold")
    return fn(ssm, hist_k, hist_u, hist_g, cursor, parity, slots, out=out)


def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    *,
    scale: float | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked prefill over packed varlen rows (GDN if `g.shape[-1] == 1`, else KDA).

    q, k `[T, H, K]` raw (l2norm inside), v `[T, HV, V]`, g `[T, HV, GK]` fp32 activated log decay (<= 0),
    beta `[T, HV]` fp32 activated, initial_state `[N, HV, K, V]` or None (zeros), cu_seqlens `[N + 1]`.
    Returns `(o [T, HV, V] dtype of v, final_state [N, HV, K, V] fp32)`. Pure: writes no state.
    CUDA runs fla-core's `chunk_gated_delta_rule` / `chunk_kda`; CPU the torch chunked form.
    """
    if _use_triton(backend, q):
        from lightllm.linear_att import fla_prefill

        return fla_prefill.chunk_delta_rule(q, k, v, g, beta, initial_state, cu_seqlens, scale=scale)
    from lightllm.linear_att.torch_ops import prefill as impl

    return impl.chunk_delta_rule(q, k, v, g, beta, initial_state, cu_seqlens, scale=scale)
