"""Which descriptor and state class implement an (algorithm, mode) pair: one explicit table, no name lookups."""

from __future__ import annotations

from lightllm.linear_att.algorithm import Algorithm
from lightllm.linear_att.gdn.algorithm import GDN
from lightllm.linear_att.gdn.compact import GdnCompactState
from lightllm.linear_att.gdn.native import GdnNativeState
from lightllm.linear_att.gdn.replay import GdnReplayState
from lightllm.linear_att.kda.algorithm import KDA
from lightllm.linear_att.kda.compact import KdaCompactState
from lightllm.linear_att.kda.native import KdaNativeState
from lightllm.linear_att.kda.replay import KdaReplayState

ALGORITHMS: dict[str, Algorithm] = {GDN.name: GDN, KDA.name: KDA}
STATE_CLASSES = {
    (GDN.name, "native"): GdnNativeState,
    (GDN.name, "compact"): GdnCompactState,
    (GDN.name, "replay"): GdnReplayState,
    (KDA.name, "native"): KdaNativeState,
    (KDA.name, "compact"): KdaCompactState,
    (KDA.name, "replay"): KdaReplayState,
}
MODES = ("native", "compact", "replay")


def algorithm(name: str) -> Algorithm:
    if name not in ALGORITHMS:
        raise ValueError(f"unknown linear-attention algorithm {name!r}; expected one of {tuple(ALGORITHMS)}")
    return ALGORITHMS[name]


def algorithm_of_gate(gate_dim: int, head_k_dim: int) -> Algorithm:
    """The algorithm whose gate is `gate_dim` channels wide at key head dim `head_k_dim` (GDN when K = 1 makes
    both one channel wide): the table a kernel launched without an algorithm looks its configuration up in. The
    tune key holds the gate width, so no entry of the other algorithm's table could match anyway."""
    for algo in ALGORITHMS.values():
        if algo.gate_dim(head_k_dim) == gate_dim:
            return algo
    raise ValueError(f"no algorithm has a gate of width {gate_dim} at key head dim {head_k_dim}")


def state_class(algo: str, mode):
    """The class for `algo` in `mode` (a StateMode or its string value)."""
    algorithm(algo)
    key = getattr(mode, "value", mode)
    if key not in MODES:
        raise ValueError(f"unknown ssm state mode {mode!r}; expected one of {MODES}")
    return STATE_CLASSES[(algo, key)]
