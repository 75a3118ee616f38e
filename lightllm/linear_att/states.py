"""Which state class implements an (algorithm, mode) pair: one explicit table."""

from __future__ import annotations

from lightllm.linear_att.gdn.algorithm import GDN
from lightllm.linear_att.gdn.compact import GdnCompactState
from lightllm.linear_att.gdn.native import GdnNativeState
from lightllm.linear_att.gdn.replay import GdnReplayState
from lightllm.linear_att.kda.algorithm import KDA
from lightllm.linear_att.kda.compact import KdaCompactState
from lightllm.linear_att.kda.native import KdaNativeState
from lightllm.linear_att.kda.replay import KdaReplayState
from lightllm.linear_att.registry import algorithm

STATE_CLASSES = {
    (GDN.name, "native"): GdnNativeState,
    (GDN.name, "compact"): GdnCompactState,
    (GDN.name, "replay"): GdnReplayState,
    (KDA.name, "native"): KdaNativeState,
    (KDA.name, "compact"): KdaCompactState,
    (KDA.name, "replay"): KdaReplayState,
}
MODES = ("native", "compact", "replay")


def state_class(algo: str, mode):
    """The class for `algo` in `mode` (a StateMode or its string value)."""
    algorithm(algo)
    key = getattr(mode, "value", mode)
    if key not in MODES:
        raise ValueError(f"unknown ssm state mode {mode!r}; expected one of {MODES}")
    return STATE_CLASSES[(algo, key)]
