"""GDN in replay mode: the shared replay state (`../modes/replay.py`) bound to the GDN descriptor."""

from __future__ import annotations

from lightllm.linear_att.gdn import kernels
from lightllm.linear_att.gdn.algorithm import GDN
from lightllm.linear_att.modes.replay import ReplayState


class GdnReplayState(ReplayState):
    algorithm = GDN
    kernels = kernels
