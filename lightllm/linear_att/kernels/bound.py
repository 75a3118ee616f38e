"""An algorithm's operator entry points: the shared ops (`ops.py`: Triton kernel or torch twin) bound to its gate
kind and its launch-configuration table (`bind_kernels` makes `Algorithm.kernels`, which the state classes call)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

from lightllm.linear_att import ops


def bind(algorithm, *names: str):
    """`ops.<name>` for each of `names` with `algorithm=algorithm` (its table gives the launch configuration
    unless the caller passes `config=`), checking that the gate of the first argument (a `TokenInputs` or a buffer
    bundle: `gate_dims()`) has `algorithm`'s gate width for its key head dim."""

    def bound(name):
        op = getattr(ops, name)

        @functools.wraps(op)
        def run(*args, **kwargs):
            gate_dim, head_k_dim = args[0].gate_dims()
            if gate_dim != algorithm.gate_dim(head_k_dim):
                raise ValueError(
                    f"{algorithm.name} {name}: gate width {gate_dim}, expected {algorithm.gate_dim(head_k_dim)}"
                )
            return op(*args, algorithm=algorithm, **kwargs)

        return run

    return tuple(bound(name) for name in names)


# the operators whose inputs carry the gate; the acceptance scalars (cursor, slot index, conv offset) hold none
GATED_OPS = ("native_verify", "compact_verify", "replay_verify", "compact_commit", "replay_fold")


def bind_kernels(algorithm) -> SimpleNamespace:
    """The entry points an algorithm's state classes call: the gated operators bound to `algorithm`, and the
    acceptance operators as they are."""
    return SimpleNamespace(
        **dict(zip(GATED_OPS, bind(algorithm, *GATED_OPS))),
        native_accept=ops.native_accept,
        replay_accept=ops.replay_accept,
    )
