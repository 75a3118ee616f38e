"""Which state class implements an (algorithm, mode) pair: each shared mode (`modes/`) bound to each algorithm's
descriptor and operator entry points, as one explicit table (`GdnNativeState`, ..., `KdaReplayState`)."""

from __future__ import annotations

from lightllm.linear_att.algorithm import Algorithm
from lightllm.linear_att.modes.common import StateCommon
from lightllm.linear_att.modes.compact import CompactState
from lightllm.linear_att.modes.native import NativeState
from lightllm.linear_att.modes.replay import ReplayState
from lightllm.linear_att.registry import ALGORITHMS, algorithm

MODE_CLASSES: dict[str, type[StateCommon]] = {"native": NativeState, "compact": CompactState, "replay": ReplayState}
MODES = tuple(MODE_CLASSES)


def _bind(algo: Algorithm, mode_class: type[StateCommon]) -> type[StateCommon]:
    """`mode_class` bound to `algo`: e.g. `GdnReplayState`, the replay state of GDN layers."""
    name = f"{algo.name.capitalize()}{mode_class.__name__}"
    doc = f"{algo.name.upper()} layers' state in {mode_class.__name__.removesuffix('State').lower()} mode."
    return type(
        name, (mode_class,), {"algorithm": algo, "kernels": algo.kernels, "__doc__": doc, "__module__": __name__}
    )


STATE_CLASSES = {(a.name, mode): _bind(a, cls) for a in ALGORITHMS.values() for mode, cls in MODE_CLASSES.items()}


def state_class(algo: str, mode):
    """The class for `algo` in `mode` (a StateMode or its string value)."""
    algorithm(algo)
    key = getattr(mode, "value", mode)
    if key not in MODES:
        raise ValueError(f"unknown ssm state mode {mode!r}; expected one of {MODES}")
    return STATE_CLASSES[(algo, key)]
