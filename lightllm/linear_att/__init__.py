"""Recurrent state of linear-attention layers (GDN, KDA) in three modes: native, compact, replay."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from lightllm.linear_att.base import Checkpoint, DecodeRows, LayerParams, LinearAttState, PrefillRows

REPLAY_CAPACITIES = (4, 8, 16, 32, 64)


class StateMode(str, enum.Enum):
    NATIVE = "native"
    COMPACT = "compact"
    REPLAY = "replay"


@dataclass(frozen=True)
class LinearAttSpec:
    """Shapes of the linear-attention layers of one model (per tensor-parallel rank)."""

    # "gdn" or "kda"
    algo: str
    num_layers: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel_size: int
    # KDA's bounded gate `lower_bound * sigmoid(...)`; None = the softplus gate
    gate_lower_bound: float | None = None

    @property
    def gate_dim(self) -> int:
        return 1 if self.algo == "gdn" else self.head_k_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim


@dataclass(frozen=True)
class StateConfig:
    """How the state is kept: chosen once at start-up from ServerArgs."""

    mode: StateMode
    # number of request slots (the HOLD slot comes on top)
    max_requests: int
    # largest verify width of any step (mtp_step + 1, spec_ngram + 1, or 1)
    max_width: int = 1
    state_dtype: torch.dtype = torch.float32
    act_dtype: torch.dtype = torch.float32
    # replay only
    replay_capacity: int = 8
    projection: str = "inline"
    device: torch.device | str = "cpu"


def create_state(spec: LinearAttSpec, config: StateConfig) -> LinearAttState:
    """Build the state object for `spec.algo` in `config.mode` (validated here, not by callers)."""
    from lightllm.linear_att.registry import state_class

    return state_class(spec.algo, config.mode)(spec, config)


__all__ = [
    "REPLAY_CAPACITIES",
    "Checkpoint",
    "DecodeRows",
    "LayerParams",
    "LinearAttSpec",
    "LinearAttState",
    "PrefillRows",
    "StateConfig",
    "StateMode",
    "create_state",
]
