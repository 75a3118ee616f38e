"""Which state class implements an (algorithm, mode) pair. GDN and KDA share every class (GDN = KDA with GK = 1)."""

from __future__ import annotations

ALGOS = ("gdn", "kda")


def state_class(algo: str, mode):
    """The class for `algo` in `mode` (a StateMode or its string value)."""
    from lightllm.linear_att.compact import CompactState
    from lightllm.linear_att.native import NativeState
    from lightllm.linear_att.replay import ReplayState

    if algo not in ALGOS:
        raise ValueError(f"unknown linear-attention algorithm {algo!r}; expected one of {ALGOS}")
    classes = {"native": NativeState, "compact": CompactState, "replay": ReplayState}
    key = getattr(mode, "value", mode)
    if key not in classes:
        raise ValueError(f"unknown ssm state mode {mode!r}; expected one of {tuple(classes)}")
    return classes[key]
