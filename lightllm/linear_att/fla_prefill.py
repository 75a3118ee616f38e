"""CUDA prefill through fla-core's chunk kernels (the GPU path of `ops.chunk_delta_rule`)."""

from __future__ import annotations

import functools
import inspect

import numpy as np
import torch

# the chunk length of fla's chunked kernels (their default)
FLA_CHUNK_SIZE = 64


def chunk_index(cu_seqlens: np.ndarray, chunk_size: int = FLA_CHUNK_SIZE) -> np.ndarray:
    """fla's varlen chunk index `[chunks, 2]` (row, chunk within the row) for the offsets `cu_seqlens`, built on
    the host: fla derives it from the device offsets with a read-back that waits for the device to drain."""
    lens = np.diff(np.asarray(cu_seqlens, dtype=np.int64))
    counts = -(-lens // chunk_size)
    rows = np.repeat(np.arange(len(lens), dtype=np.int64), counts)
    firsts = np.repeat(np.cumsum(counts) - counts, counts)
    return np.stack([rows, np.arange(len(rows), dtype=np.int64) - firsts], 1)


@functools.cache
def _takes(fn, name: str) -> bool:
    return name in inspect.signature(fn).parameters


def chunk_delta_rule(
    q, k, v, g, beta, initial_state, cu_seqlens, *, algorithm, scale=None, chunk_indices=None, cu_seqlens_cpu=None
):
    """See `lightllm.linear_att.ops.chunk_delta_rule`; `algorithm` picks fla's kernel. fla takes `[1, T, ...]` with
    `cu_seqlens` for varlen, or without them as one sequence; `chunk_indices` (`chunk_index` of the offsets, on
    the device) and `cu_seqlens_cpu` (the offsets on the host) spare it read-backs where its entry point takes
    them (KDA's takes only the second)."""
    init = None if initial_state is None else initial_state.float().contiguous()
    fn = algorithm.fla_chunk_fn()
    common = dict(
        scale=scale,
        initial_state=init,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=None if cu_seqlens is None else cu_seqlens.long(),
    )
    if cu_seqlens is not None:
        for name, value in (("chunk_indices", chunk_indices), ("cu_seqlens_cpu", cu_seqlens_cpu)):
            if value is not None and _takes(fn, name):
                common[name] = value
    q, k, v = (t.contiguous()[None] for t in (q, k, v))
    beta = beta.float().contiguous()[None]
    # g and beta by keyword: fla's positional order differs between its entry points
    gate = algorithm.fla_gate(g).float().contiguous()[None]
    o, final = fn(q, k, v, g=gate, beta=beta, **common)
    if final is None:
        num_rows = 1 if cu_seqlens is None else cu_seqlens.numel() - 1
        final = torch.zeros(num_rows, *v.shape[2:3], q.shape[-1], v.shape[-1], device=v.device)
    return o[0], final
