"""CUDA prefill through fla-core's chunk kernels (the GPU path of `ops.chunk_delta_rule`)."""

from __future__ import annotations

import torch


def chunk_delta_rule(q, k, v, g, beta, initial_state, cu_seqlens, *, algorithm, scale=None):
    """See `lightllm.linear_att.ops.chunk_delta_rule`; `algorithm` picks fla's kernel. fla takes `[1, T, ...]` with
    `cu_seqlens` for varlen, or without them as one sequence."""
    init = None if initial_state is None else initial_state.float().contiguous()
    common = dict(
        scale=scale,
        initial_state=init,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=None if cu_seqlens is None else cu_seqlens.long(),
    )
    q, k, v = (t.contiguous()[None] for t in (q, k, v))
    beta = beta.float().contiguous()[None]
    # g and beta by keyword: fla's positional order differs between its entry points
    gate = algorithm.fla_gate(g).float().contiguous()[None]
    o, final = algorithm.fla_chunk_fn()(q, k, v, g=gate, beta=beta, **common)
    if final is None:
        num_rows = 1 if cu_seqlens is None else cu_seqlens.numel() - 1
        final = torch.zeros(num_rows, *v.shape[2:3], q.shape[-1], v.shape[-1], device=v.device)
    return o[0], final
