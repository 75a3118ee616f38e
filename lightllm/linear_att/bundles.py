"""Typed argument bundles of the verify, merge and fold operators: one layer's token inputs, and each mode's
state buffers.

Every operator, Triton wrapper and torch twin takes these instead of the flat tensor lists. A buffer bundle is built
once per layer when the state is created (fixed views of the state's tensors: every launch, and every captured CUDA
graph, sees the same addresses) and computes the strides its kernels take once; a `TokenInputs` is built per layer
and step. The kernels take `pointers` and `strides` as tuple arguments (`tokens`, `state`, `token_strides`,
`state_strides`) and unpack them by name, so no kernel signature spells the tensor list out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def _leading_strides(tensors, count: int) -> tuple[int, ...]:
    return tuple(s for t in tensors for s in t.stride()[:count])


@dataclass(frozen=True)
class TokenInputs:
    """One layer's verify inputs (post conv + SiLU): q, k `[N, Wmax, H, K]` raw (l2norm inside), v `[N, Wmax, HV, V]`
    (activation dtype), graw `[N, Wmax, HV, GK]` and braw `[N, Wmax, HV]` raw gate / beta logits, A_log `[HV]` and
    dt_bias `[HV, GK]` fp32; `scale` (default `K ** -0.5`) and KDA's gate `lower_bound` (None: softplus gate)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    graw: torch.Tensor
    braw: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    scale: float | None = None
    lower_bound: float | None = None
    # row and token strides of q (k has the same), v, graw, braw
    strides: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "strides", _leading_strides((self.q, self.v, self.graw, self.braw), 2))

    @property
    def pointers(self) -> tuple[torch.Tensor, ...]:
        return (self.q, self.k, self.v, self.graw, self.braw, self.A_log, self.dt_bias)

    @property
    def kernel_scale(self) -> float:
        return self.q.shape[-1] ** -0.5 if self.scale is None else self.scale

    def gate_dims(self) -> tuple[int, int]:
        """(gate width, key head dim)."""
        return self.graw.shape[-1], self.q.shape[-1]

    def rows(self, index: torch.Tensor) -> TokenInputs:
        """The inputs of the rows `index` (a gather: copies)."""
        t = (self.q, self.k, self.v, self.graw, self.braw)
        return TokenInputs(*(x[index] for x in t), self.A_log, self.dt_bias, self.scale, self.lower_bound)


@dataclass(frozen=True)
class NativeBuffers:
    """Native state of one layer: ssm `[S, Wmax, HV, K, V]` (state dtype), ssm_index `[S]` int32."""

    ssm: torch.Tensor
    ssm_index: torch.Tensor
    strides: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "strides", _leading_strides((self.ssm,), 2))


@dataclass(frozen=True)
class CompactBuffers:
    """Compact state: ssm `[*, S, HV, K, V]`, fp32 records win_k `[*, S, 2, Wmax, H, K]` (k̂), win_u
    `[*, S, 2, Wmax, HV, V]` (u), win_g `[*, S, 2, Wmax, HV, GK]` (g), pending / parity `[S]` int32. `*` is no
    dimension for one layer (verify) or the layers (merge of all layers at once)."""

    ssm: torch.Tensor
    win_k: torch.Tensor
    win_u: torch.Tensor
    win_g: torch.Tensor
    pending: torch.Tensor
    parity: torch.Tensor
    # ssm up to its slot dim, each record buffer up to its token dim
    strides: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        lead = self.ssm.dim() - 3
        strides = _leading_strides((self.ssm,), lead) + _leading_strides(self.windows, lead + 2)
        object.__setattr__(self, "strides", strides)

    @property
    def windows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (self.win_k, self.win_u, self.win_g)

    @property
    def pointers(self) -> tuple[torch.Tensor, ...]:
        return (self.ssm, *self.windows, self.pending, self.parity)

    def gate_dims(self) -> tuple[int, int]:
        return self.win_g.shape[-1], self.win_k.shape[-1]

    def gathered(self, slots: torch.Tensor) -> CompactBuffers:
        """Copies of `slots` (all layers) as slots `0..n-1`: merging into them leaves the state alone."""
        sl = slots.long()
        return CompactBuffers(*(t[:, sl] for t in (self.ssm, *self.windows)), self.pending[sl], self.parity[sl])


@dataclass(frozen=True)
class ReplayBuffers:
    """Replay state: ssm `[*, S, HV, K, V]` (canonical state), fp32 history hist_k `[*, S, 2, L, H, K]` (k̂),
    hist_u `[*, S, 2, L, HV, V]` (u), hist_g `[*, S, 2, L, HV, GK]` (cumulative gate), cursor / parity `[S]` int32.
    `*` is no dimension for one layer (verify) or the layers (fold of all layers at once)."""

    ssm: torch.Tensor
    hist_k: torch.Tensor
    hist_u: torch.Tensor
    hist_g: torch.Tensor
    cursor: torch.Tensor
    parity: torch.Tensor
    # ssm up to its slot dim, each history buffer up to its record dim
    strides: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        lead = self.ssm.dim() - 3
        strides = _leading_strides((self.ssm,), lead) + _leading_strides(self.history, lead + 2)
        object.__setattr__(self, "strides", strides)

    @property
    def history(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (self.hist_k, self.hist_u, self.hist_g)

    @property
    def pointers(self) -> tuple[torch.Tensor, ...]:
        return (self.ssm, *self.history, self.cursor, self.parity)

    @property
    def replay_capacity(self) -> int:
        return self.hist_k.shape[-3]

    def gate_dims(self) -> tuple[int, int]:
        return self.hist_g.shape[-1], self.hist_k.shape[-1]
