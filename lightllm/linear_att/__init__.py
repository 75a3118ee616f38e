"""Recurrent state of linear-attention layers (GDN, KDA) in three modes: native, compact, replay."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from lightllm.linear_att.base import Checkpoint, DecodeRows, LayerParams, LinearAttState, PrefillRows
from lightllm.linear_att.registry import algorithm
from lightllm.linear_att.states import state_class

REPLAY_CAPACITIES = (4, 8, 16, 32, 64)


class StateMode(str, enum.Enum):
    NATIVE = "native"
    COMPACT = "compact"
    REPLAY = "replay"


@dataclass(frozen=True)
class LinearAttSpec:
    """Shapes of the linear-attention layers of one model (per tensor-parallel rank)."""

    # the algorithm's name, "gdn" or "kda" (its descriptor: `algorithm`)
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
    def algorithm(self):
        """The `Algorithm` descriptor of `algo` (raises ValueError for an unknown name)."""
        return algorithm(self.algo)

    @property
    def gate_dim(self) -> int:
        return self.algorithm.gate_dim(self.head_k_dim)

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
    # operator backend: None = by device (Triton on CUDA, torch on CPU); "triton" / "torch" force one (tests)
    backend: str | None = None


STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def validate_state_config(spec: LinearAttSpec, config: StateConfig) -> None:
    """Raise ValueError (expected vs actual) for a combination no state class supports."""
    mode = StateMode(config.mode)
    algo = spec.algorithm
    if spec.num_v_heads % spec.num_k_heads:
        raise ValueError(f"num_v_heads ({spec.num_v_heads}) must be a multiple of num_k_heads ({spec.num_k_heads})")
    if spec.conv_kernel_size < 2:
        raise ValueError(f"conv_kernel_size must be >= 2, got {spec.conv_kernel_size}")
    if spec.gate_lower_bound is not None and (not algo.allows_lower_bound or spec.gate_lower_bound >= 0):
        raise ValueError(
            f"gate_lower_bound must be a negative float and only for an algorithm with the bounded gate (kda), "
            f"got {spec.gate_lower_bound} for {algo.name}"
        )
    if config.max_requests < 1 or config.max_width < 1:
        raise ValueError(f"max_requests and max_width must be >= 1, got {config.max_requests}, {config.max_width}")
    if config.state_dtype not in STATE_DTYPES:
        raise ValueError(f"state_dtype must be one of {STATE_DTYPES}, got {config.state_dtype}")
    if mode is StateMode.COMPACT and config.max_width < 2:
        raise ValueError(
            f"ssm_state_mode=compact needs speculative decoding (max_width >= 2), got max_width={config.max_width}"
        )
    if mode is StateMode.REPLAY:
        if config.replay_capacity not in REPLAY_CAPACITIES:
            raise ValueError(f"replay_capacity must be one of {REPLAY_CAPACITIES}, got {config.replay_capacity}")
        if config.replay_capacity < config.max_width:
            raise ValueError(
                f"replay_capacity ({config.replay_capacity}) must be >= max_width ({config.max_width}): "
                "a verify window must fit in the history"
            )
        if config.projection not in ("inline", "precompute"):
            raise ValueError(f"projection must be 'inline' or 'precompute', got {config.projection!r}")
    elif config.projection != "inline":
        raise ValueError(f"projection={config.projection!r} is a replay option; ssm_state_mode is {mode.value}")


def create_state(spec: LinearAttSpec, config: StateConfig) -> LinearAttState:
    """Build the state object for `spec.algo` in `config.mode` (validated here, not by callers)."""
    validate_state_config(spec, config)
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
    "validate_state_config",
]
