"""KDA in native mode: the shared native state (`../modes/native.py`) bound to the KDA descriptor."""

from __future__ import annotations

from lightllm.linear_att.kda import kernels
from lightllm.linear_att.kda.algorithm import KDA
from lightllm.linear_att.modes.native import NativeState


class KdaNativeState(NativeState):
    algorithm = KDA
    kernels = kernels
