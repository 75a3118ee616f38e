"""GDN in compact mode: the shared compact state (`../modes/compact.py`) bound to the GDN descriptor."""

from __future__ import annotations

from lightllm.linear_att.gdn import kernels
from lightllm.linear_att.gdn.algorithm import GDN
from lightllm.linear_att.modes.compact import CompactState


class GdnCompactState(CompactState):
    algorithm = GDN
    kernels = kernels
