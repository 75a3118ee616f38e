"""KDA in compact mode: the shared compact state (`../modes/compact.py`) bound to the KDA descriptor."""

from __future__ import annotations

from lightllm.linear_att.kda import kernels
from lightllm.linear_att.kda.algorithm import KDA
from lightllm.linear_att.modes.compact import CompactState


class KdaCompactState(CompactState):
    algorithm = KDA
    kernels = kernels
