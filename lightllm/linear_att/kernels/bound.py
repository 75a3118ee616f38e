"""An algorithm's operator entry points: the shared ops (`ops.py`: Triton kernel or torch twin) bound to its gate
kind and its launch-configuration table. The algorithm packages' `kernels/` modules are made of these; the state
classes call them."""

from __future__ import annotations

import functools

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
