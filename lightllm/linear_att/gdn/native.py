"""GDN in native mode: the shared native state (`../modes/native.py`) bound to the GDN descriptor."""

from __future__ import annotations

from lightllm.linear_att.gdn import kernels
from lightllm.linear_att.gdn.algorithm import GDN
from lightllm.linear_att.modes.native import NativeState


class GdnNativeState(NativeState):
    algorithm = GDN
    kernels = kernels
