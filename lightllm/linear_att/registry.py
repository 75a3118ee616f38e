"""The algorithm descriptors by name and by gate width: one explicit table, no name lookups. The state classes of
each (algorithm, mode) pair are in `states.py`; this table imports no kernels, so the kernel launchers read it."""

from __future__ import annotations

from lightllm.linear_att.algorithm import Algorithm
from lightllm.linear_att.gdn.algorithm import GDN
from lightllm.linear_att.kda.algorithm import KDA

ALGORITHMS: dict[str, Algorithm] = {GDN.name: GDN, KDA.name: KDA}


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
