"""The operator entry points of the linear-attention state (GDN and KDA share every one; GDN is KDA with GK = 1).

Each function runs the Triton kernel on CUDA tensors and the torch twin (`torch_ops/`) on CPU tensors.
`backend="triton"` forces the kernel (CPU interpreter tests), `backend="torch"` forces the twin. `IMPLEMENTATIONS`
is the table of both per op: the Triton host wrappers (`kernels/<family>.py`, `<op>_triton`) and the twins take
the same arguments as the op here (minus `backend`, and minus `config` / `algorithm` for the twins). Kernels
compile on their first launch, not on import.

The tuned ops (verify, commit, fold) take `config` (a `KernelConfig` to launch with) and `algorithm` (the
`Algorithm` whose table gives the configuration when `config` is None; None: the one of the gate width). Both
only reach the Triton kernel; an algorithm's entry points (`Algorithm.kernels`) pass it.

Shared names (see README.md of this package): `N` rows, `Wmax` padded window width, `H`/`HV` key/value heads,
`K`/`V` head dims, `GK` gate width (1 GDN, K KDA), `C = 2·H·K + HV·V` conv channels, `Kc` conv kernel size,
`S` state slots, `L` replay replay_capacity, `NL` layers.

The verify ops take a `TokenInputs` (one layer's token inputs, post conv + SiLU: q, k `[N, Wmax, H, K]` raw,
l2norm and the scale applied inside; v `[N, Wmax, HV, V]`; graw `[N, Wmax, HV, GK]` and braw `[N, Wmax, HV]` raw
gate / beta logits; A_log `[HV]` and dt_bias `[HV, GK]` fp32; `scale`, `lower_bound`) and their mode's buffer
bundle (`bundles.py`), plus slots `[N]` int32 and widths `[N]` int32 in [0, Wmax].
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

import functools

import torch

from lightllm.linear_att import fla_prefill
from lightllm.linear_att.bundles import CompactBuffers, NativeBuffers, ReplayBuffers, TokenInputs
from lightllm.linear_att.kernels import conv as conv_kernels
from lightllm.linear_att.kernels import cursor as cursor_kernels
from lightllm.linear_att.kernels import replay_fold as fold_kernels
from lightllm.linear_att.kernels import replay_verify as replay_kernels
from lightllm.linear_att.kernels import serial as serial_kernels
from lightllm.linear_att.torch_ops import conv as conv_twins
from lightllm.linear_att.torch_ops import prefill as prefill_twin
from lightllm.linear_att.torch_ops import prep
from lightllm.linear_att.torch_ops import replay as replay_twins
from lightllm.linear_att.torch_ops import verify as verify_twins

# op -> (Triton host wrapper, torch twin); both take the op's arguments minus `backend`
IMPLEMENTATIONS = {
    "causal_conv_prefill": (conv_kernels.causal_conv_prefill_triton, conv_twins.causal_conv_prefill),
    "causal_conv_decode": (conv_kernels.causal_conv_decode_triton, conv_twins.causal_conv_decode),
    "native_verify": (serial_kernels.native_verify_triton, verify_twins.native_verify),
    "compact_verify": (serial_kernels.compact_verify_triton, verify_twins.compact_verify),
    "compact_commit": (serial_kernels.compact_commit_triton, verify_twins.compact_commit),
    "replay_verify": (replay_kernels.replay_verify_triton, replay_twins.replay_verify),
    "native_accept": (cursor_kernels.native_accept_triton, verify_twins.native_accept),
    "replay_accept": (cursor_kernels.replay_accept_triton, replay_twins.replay_accept),
    "replay_fold": (fold_kernels.replay_fold_triton, replay_twins.replay_fold),
}


def _use_triton(backend: str | None, like: torch.Tensor) -> bool:
    if backend is None:
        return like.is_cuda
    if backend not in ("triton", "torch"):
        raise ValueError(f"backend must be 'triton', 'torch' or None, got {backend!r}")
    return backend == "triton"


def _impl(op: str, backend: str | None, like: torch.Tensor):
    """The Triton wrapper or the torch twin of `op`, by backend / device of `like`."""
    triton_fn, torch_fn = IMPLEMENTATIONS[op]
    return triton_fn if _use_triton(backend, like) else torch_fn


def _tuned_impl(op: str, backend: str | None, like: torch.Tensor, config, algorithm):
    """`_impl` of an op with a launch configuration: the Triton wrapper gets `config` and `algorithm`."""
    triton_fn, torch_fn = IMPLEMENTATIONS[op]
    if _use_triton(backend, like):
        return functools.partial(triton_fn, config=config, algorithm=algorithm)
    return torch_fn


# gate and beta activations in fp32 (torch; see `torch_ops/prep.py`): the torch twins and prefill call this one
# function, so every torch path sees bitwise identical gates
activate_gates = prep.activate_gates


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
    no tokens write nothing). Returns `y [T, C]` in the dtype of `x`; tokens past `cu_seqlens[-1]` are in no row
    and their `y` is unspecified.
    """
    fn = _impl("causal_conv_prefill", backend, x)
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
    fn = _impl("causal_conv_decode", backend, x)
    return fn(x, conv, conv_offset, slots, widths, weight, bias)


def native_verify(
    tokens: TokenInputs,
    state: NativeBuffers,
    slots: torch.Tensor,
    widths: torch.Tensor,
    *,
    config=None,
    algorithm=None,
    backend: str | None = None,
) -> torch.Tensor:
    """Native decode/verify of one layer. state: ssm `[S, Wmax, HV, K, V]` (state dtype), ssm_index `[S]` int32.

    Reads `ssm[slot, ssm_index[slot]]`; in place: writes the state after window token s into `ssm[slot, s]` for
    s < W (rounded to the state dtype after every token). Returns o `[N, Wmax, HV, V]`.
    """
    return _tuned_impl("native_verify", backend, tokens.q, config, algorithm)(tokens, state, slots, widths)


def compact_verify(
    tokens: TokenInputs,
    state: CompactBuffers,
    slots: torch.Tensor,
    widths: torch.Tensor,
    *,
    config=None,
    algorithm=None,
    backend: str | None = None,
) -> torch.Tensor:
    """Compact verify of one layer: merge the previous window's accepted tokens, then verify like `native_verify`.

    state: ssm `[S, HV, K, V]`; two fp32 record buffers per slot of what the verify computed for each window token:
    win_k `[S, 2, Wmax, H, K]` the normalised key k̂, win_u `[S, 2, Wmax, HV, V]` the corrected value
    `u = β (v − Sᵀ k̂)`, win_g `[S, 2, Wmax, HV, GK]` the log decay g; pending / parity `[S]` int32 (read only): the
    slot's accepted tokens not yet in `ssm` and the buffer holding their records. For each row with W > 0, in place:
      1. `ssm[slot]` <- the state after the first `pending[slot]` records of buffer `parity[slot]`
         (`S <- diag(e^g) S + k̂ uᵀ`, rounded per token: native's states bit for bit; written only when
         pending > 0; one read and at most one write of the state);
      2. the records of tokens s < W go to buffer `1 - parity[slot]` (the buffer `accept` makes current next).
    Rows with W = 0 touch nothing (their pending tokens stay pending). Returns o `[N, Wmax, HV, V]`, bitwise equal to
    `native_verify`'s from the same (merged) state.
    """
    return _tuned_impl("compact_verify", backend, tokens.q, config, algorithm)(tokens, state, slots, widths)


def compact_commit(
    state: CompactBuffers, slots: torch.Tensor, *, config=None, algorithm=None, backend: str | None = None
) -> None:
    """Merge the pending tokens of the slots of `slots [N]` into the state, all layers in one call.

    state: ssm `[NL, S, HV, K, V]`, win_* `[NL, S, 2, Wmax, ...]` (any leading layer count: pass `[l : l + 1]` views
    for one layer), pending / parity `[S]` int32. In place: `ssm[:, slot]` <- the state after the first
    `pending[slot]` records of window buffer `parity[slot]`, applied with native's update and per-token rounding
    (the merge step of `compact_verify`, so compact == native bitwise); slots with pending 0 are untouched.
    `pending` is not cleared (the caller clears it once the merge is no longer needed). Pass gathered copies
    (`CompactBuffers.gathered`, slots `0..n-1`) to merge into copies and leave the state alone (checkpoint export).
    """
    return _tuned_impl("compact_commit", backend, state.ssm, config, algorithm)(state, slots)


def replay_verify(
    tokens: TokenInputs,
    state: ReplayBuffers,
    slots: torch.Tensor,
    widths: torch.Tensor,
    *,
    projection: str = "inline",
    config=None,
    algorithm=None,
    backend: str | None = None,
) -> torch.Tensor:
    """Replay decode/verify of one layer from the canonical state plus the committed history.

    state: ssm `[S, HV, K, V]` (state dtype); hist_k `[S, 2, L, H, K]`, hist_u `[S, 2, L, HV, V]`,
    hist_g `[S, 2, L, HV, GK]` (fp32; `hist_g` holds the cumulative gate G_j since `ssm`); cursor, parity `[S]`
    int32 (read only). With `h = cursor[slot]`, `p = parity[slot]`:
      a fold (`replay_folds`): in place `ssm[slot] <- S_h` (fp32 math, rounded once), records of the window go to
      buffer `1 - p` at positions 0..W-1 (G restarting from 0);
      otherwise records go to buffer `p` at positions h..h+W-1.
    projection: "inline" or "precompute", the order of the Triton window kernel for W > 1 (same math, one launch,
    `kernels/replay_window.py`): S0 and the history contracted per token inside the window loop, or for every
    token of the window before it; plain decode (W = 1) has one path.
    Returns o `[N, Wmax, HV, V]`.
    """
    if projection not in ("inline", "precompute"):
        raise ValueError(f"projection must be 'inline' or 'precompute', got {projection!r}")
    fn = _tuned_impl("replay_verify", backend, tokens.q, config, algorithm)
    return fn(tokens, state, slots, widths, projection=projection)


def native_accept(
    ssm_index: torch.Tensor,
    conv_offset: torch.Tensor,
    slots: torch.Tensor,
    widths: torch.Tensor,
    accepted: torch.Tensor,
    *,
    backend: str | None = None,
) -> None:
    """Native's per-slot scalars once per step after the last layer (device side, no host sync): for rows with
    W > 0, in place `ssm_index[slot] = conv_offset[slot] = a - 1` (the window slot holding the state after the last
    accepted token becomes current; no state is copied). ssm_index, conv_offset `[S]` int32; slots, widths,
    accepted `[N]`."""
    fn = _impl("native_accept", backend, ssm_index)
    return fn(ssm_index, conv_offset, slots, widths, accepted)


def replay_accept(
    cursor: torch.Tensor,
    parity: torch.Tensor,
    conv_offset: torch.Tensor,
    slots: torch.Tensor,
    widths: torch.Tensor,
    accepted: torch.Tensor,
    replay_capacity: int,
    *,
    backend: str | None = None,
) -> None:
    """Advance the per-slot scalars once per step after the last layer (device side, no host sync).

    cursor, parity, conv_offset `[S]` int32, in place; slots, widths, accepted `[N]` int32. For rows with W > 0:
    a fold (`replay_folds`) -> `cursor = a`, `parity ^= 1`; else `cursor = h + a`; and `conv_offset = a - 1`.
    """
    fn = _impl("replay_accept", backend, cursor)
    return fn(cursor, parity, conv_offset, slots, widths, accepted, replay_capacity)


def replay_fold(
    state: ReplayBuffers,
    slots: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    config=None,
    algorithm=None,
    backend: str | None = None,
) -> None:
    """Fold the committed history of `slots` into the canonical state, all layers in one call.

    state: ssm `[NL, S, HV, K, V]`, hist_* `[NL, S, 2, L, ...]` (any leading layer count). With `out=None`, in
    place: `ssm[:, slot] <- S_h` (fp32 math, rounded once to the state dtype); cursor/parity are NOT changed (the
    caller clears them once for all layers). With `out [NL, n, HV, K, V]` (n = len(slots)), writes the folded
    states there and leaves `ssm` untouched (checkpoint export).
    """
    return _tuned_impl("replay_fold", backend, state.ssm, config, algorithm)(state, slots, out=out)


def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    *,
    scale: float | None = None,
    algorithm=None,
    backend: str | None = None,
    chunk_indices: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked prefill over packed varlen rows of one `Algorithm` (required on CUDA: it picks fla's kernel).

    q, k `[T, H, K]` raw (l2norm inside), v `[T, HV, V]`, g `[T, HV, GK]` fp32 activated log decay (<= 0),
    beta `[T, HV]` fp32 activated, initial_state `[N, HV, K, V]` or None (zeros), cu_seqlens `[N + 1]`, or None for
    one row of all T tokens (no offsets to read: fla's varlen path reads them on the host, which a CUDA graph
    cannot).
    `chunk_indices`: `fla_prefill.chunk_index(cu_seqlens)` on the device, `cu_seqlens_cpu`: the offsets as an
    int64 host tensor, if the caller has them (fla then reads no offsets back). Returns `(o [T, HV, V] dtype of v, final_state [N, HV, K, V] fp32)`. Pure: writes no state.
    CUDA runs fla-core's `chunk_gated_delta_rule` / `chunk_kda`; CPU the torch chunked form.
    """
    if _use_triton(backend, q):
        return fla_prefill.chunk_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            initial_state,
            cu_seqlens,
            scale=scale,
            algorithm=algorithm,
            chunk_indices=chunk_indices,
            cu_seqlens_cpu=cu_seqlens_cpu,
        )
    return prefill_twin.chunk_delta_rule(q, k, v, g, beta, initial_state, cu_seqlens, scale=scale)
