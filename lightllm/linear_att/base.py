"""The state protocol every (algorithm, mode) pair implements; see README.md in this package for layouts.

The engine and the model layers talk to linear-attention state only through this protocol: they never branch on
the state mode. One object owns the conv and SSM storage of all linear-attention layers of a model.

Call order within one model step:
  1. for each linear layer `l`: `prefill(l, ...)` for the prefill rows and/or `decode(l, ...)` for decode rows
     (every layer sees the same pre-step per-slot scalars: cursor, conv offset, native slot index);
  2. after the last layer: `accept(rows, num_accepted)` for decode rows and `finish_prefill(slots)` for prefill rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import torch


@dataclass(frozen=True)
class LayerParams:
    """Per-layer parameters the state operators need (owned by the model's mixer)."""

    # [C, Kc] depthwise causal conv over the [q | k | v] channels; bias [C] or None
    conv_weight: torch.Tensor
    conv_bias: torch.Tensor | None
    # [HV] fp32
    A_log: torch.Tensor
    # [HV, GK] fp32 (GK = 1 for GDN, K for KDA)
    dt_bias: torch.Tensor


@dataclass(frozen=True)
class DecodeRows:
    """The decode/verify rows of one step, as device tensors (fixed addresses: CUDA-graph safe)."""

    # [N] int32 state slot of each row (the HOLD slot for padding rows)
    slots: torch.Tensor
    # [N] int32 verify width of each row: 1 = plain decode, 0 = padding (writes nothing)
    widths: torch.Tensor
    # the padded width of the token tensors, >= widths.max()
    max_width: int
    # what every layer of the step derives alike from the rows (the live widths), by key
    derived: dict = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class PrefillRows:
    """The prefill rows of one step (varlen chunk of each request's prompt)."""

    # [N] int32 state slot of each row
    slots: torch.Tensor
    # [N + 1] int32 FlashAttention-style offsets of each row's tokens
    cu_seqlens: torch.Tensor
    # [N] bool: start from the slot's state (a later chunk, or a prefix-cache hit) instead of zeros
    has_initial_state: torch.Tensor
    # [T] bool, only for one row padded to a fixed token count (a prefill replayed as a CUDA graph): its real
    # tokens come first, `cu_seqlens` ends at their count, and the padding tokens after them change no state
    padded_valid: torch.Tensor | None = None
    # [chunks, 2] int64 `fla_prefill.chunk_index(cu_seqlens)`, built on the host (None: the kernels derive it)
    chunk_indices: torch.Tensor | None = None
    # [N + 1] int64 `cu_seqlens` on the host, for fla's entry points that take it instead of the index (KDA's)
    cu_seqlens_cpu: torch.Tensor | None = None

    @cached_property
    def chunk_cu_seqlens(self) -> torch.Tensor:
        """`cu_seqlens` as int64, one tensor for every layer of the step: fla caches what it derives from the
        offsets (its chunk indices, built with a host sync) by tensor identity, so only the first layer builds them."""
        return self.cu_seqlens.long()


@dataclass(frozen=True)
class Checkpoint:
    """Canonical, mode-independent state of some requests (prefix cache, PD and DP transfer)."""

    # [NL, n, C, Kc - 1] activation dtype: the accepted conv window
    conv: torch.Tensor
    # [NL, n, HV, K, V] state dtype: pending accepted history folded in
    ssm: torch.Tensor


class LinearAttState(Protocol):
    """Conv + SSM storage of all linear-attention layers, for one algorithm in one state mode."""

    num_slots: int
    hold_slot: int

    def alloc(self) -> int:
        """Take a free slot (cleared: zero state, empty history, offsets 0); raise RuntimeError when none is free."""

    def free(self, slot: int) -> None:
        """Return a slot to the pool (its contents become garbage; the next `alloc` clears them)."""

    def num_free_slots(self) -> int: ...

    def reset(self, slots: torch.Tensor) -> None:
        """Zero conv and SSM state of `slots` and clear their history, cursor, parity and offsets."""

    def prefill(
        self,
        layer: int,
        rows: PrefillRows,
        mixed_qkv: torch.Tensor,
        graw: torch.Tensor,
        braw: torch.Tensor,
        params: LayerParams,
    ) -> torch.Tensor:
        """Run conv + chunked recurrence over `mixed_qkv [T, C]` (pre-conv), `graw [T, HV, GK]`, `braw [T, HV]`;
        write each row's final state as its canonical state (replay folds pending history first).
        Returns `o [T, HV, V]` in the activation dtype."""

    def decode(
        self,
        layer: int,
        rows: DecodeRows,
        mixed_qkv: torch.Tensor,
        graw: torch.Tensor,
        braw: torch.Tensor,
        params: LayerParams,
    ) -> torch.Tensor:
        """Verify windows `mixed_qkv [N, Wmax, C]`, `graw [N, Wmax, HV, GK]`, `braw [N, Wmax, HV]`.
        Token s of a row sees the state after tokens 0..s-1 of its window. Returns `o [N, Wmax, HV, V]`."""

    def accept(self, rows: DecodeRows, num_accepted: torch.Tensor) -> None:
        """Once per step after the last layer: keep the first `num_accepted[i]` in [1, widths[i]] tokens of
        each row's window (padding rows ignored). Device-side; no host sync."""

    def finish_prefill(self, slots: torch.Tensor) -> None:
        """Once per step after the last layer, for the rows that ran `prefill` in this step."""

    def export_checkpoint(self, slots: torch.Tensor) -> Checkpoint:
        """Canonical state + accepted conv window of `slots`; never mutates the live state."""

    def import_checkpoint(self, slots: torch.Tensor, checkpoint: Checkpoint) -> None:
        """Overwrite `slots` with a checkpoint and clear their history / offsets."""

    def bytes_per_request(self) -> int:
        """Device bytes one request slot costs in this mode (all layers, conv + SSM + history/scratch)."""

    def counters(self) -> dict[str, torch.Tensor]:
        """The mode's device counters by name (replay: `num_folds`, rows folded so far); empty for a mode that
        keeps none. Reading one syncs the device."""
