"""KDA in replay mode: the shared replay state (`../modes/replay.py`) bound to the KDA descriptor."""

from __future__ import annotations

from lightllm.linear_att.kda import kernels
from lightllm.linear_att.kda.algorithm import KDA
from lightllm.linear_att.modes.replay import ReplayState


class KdaReplayState(ReplayState):
    algorithm = KDA
    kernels = kernels
