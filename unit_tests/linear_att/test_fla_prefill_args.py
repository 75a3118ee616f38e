"""What `fla_prefill.chunk_delta_rule` hands fla's entry point: the host-built chunk index and the host offsets go
to an entry point that takes them (each spares fla a read-back of the device offsets), and are left out of one
that does not (fla 0.6's KDA entry point takes the offsets only)."""

from __future__ import annotations

import numpy as np
import torch

from lightllm.linear_att.fla_prefill import chunk_delta_rule, chunk_index


class _Algorithm:
    def __init__(self, fn):
        self._fn = fn

    def fla_chunk_fn(self):
        return self._fn

    def fla_gate(self, g):
        return g


def _inputs(lengths: list[int]):
    gen = torch.Generator().manual_seed(sum(lengths))
    total, heads, dim = sum(lengths), 2, 4
    q, k, v = (torch.randn(total, heads, dim, generator=gen) for _ in range(3))
    g, beta = -torch.rand(total, heads, generator=gen), torch.rand(total, heads, generator=gen)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return (q, k, v, g, beta), offsets


def _recorder(seen: dict, takes_index: bool, takes_host_offsets: bool):
    def output(q, v, cu_seqlens):
        rows = cu_seqlens.numel() - 1
        return torch.randn_like(v), torch.randn(rows, v.shape[2], q.shape[-1], v.shape[-1])

    if takes_index and takes_host_offsets:

        def fn(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None):  # fmt: skip
            seen.update(cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices)
            return output(q, v, cu_seqlens)

    elif takes_host_offsets:

        def fn(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None):  # fmt: skip
            seen.update(cu_seqlens_cpu=cu_seqlens_cpu)
            return output(q, v, cu_seqlens)

    else:

        def fn(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, cu_seqlens=None):  # fmt: skip
            seen.update(called=True)
            return output(q, v, cu_seqlens)

    return fn


def _run(fn, lengths):
    (q, k, v, g, beta), offsets = _inputs(lengths)
    index = torch.from_numpy(chunk_index(offsets))
    return chunk_delta_rule(
        q, k, v, g, beta, None, torch.from_numpy(offsets), algorithm=_Algorithm(fn),
        chunk_indices=index, cu_seqlens_cpu=torch.from_numpy(offsets),
    ), offsets, index  # fmt: skip


def test_host_index_and_offsets_reach_an_entry_point_that_takes_them():
    seen: dict = {}
    _, offsets, index = _run(_recorder(seen, True, True), [70, 0, 5, 129])
    assert seen["cu_seqlens_cpu"].device.type == "cpu" and seen["cu_seqlens_cpu"].tolist() == offsets.tolist()
    assert torch.equal(seen["chunk_indices"], index)


def test_kda_like_entry_point_gets_the_host_offsets_only():
    seen: dict = {}
    _, offsets, _ = _run(_recorder(seen, False, True), [3, 64, 65])
    assert seen["cu_seqlens_cpu"].tolist() == offsets.tolist()
    # twin: an entry point taking neither is called without them (a keyword it lacks would raise)
    seen.clear()
    (o, final), _, _ = _run(_recorder(seen, False, False), [3, 64, 65])
    assert seen == {"called": True} and final.shape[0] == 3 and o.shape[0] == 132
