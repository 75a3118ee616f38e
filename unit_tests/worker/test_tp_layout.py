"""worker.tp.layout: per-rank slices of checkpoints and KV by global head, and back, against hand-built layouts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightllm.linear_att import LinearAttSpec
from lightllm.linear_att.base import Checkpoint
from lightllm.models.tp import TPInfo
from lightllm.worker.tp.layout import merge_checkpoints, merge_kv, split_checkpoint, split_kv

# GDN-like: 2 key heads of dim 3, 4 value heads of dim 5 (global)
GLOBAL = LinearAttSpec(
    "gdn", num_layers=2, num_k_heads=2, num_v_heads=4, head_k_dim=3, head_v_dim=5, conv_kernel_size=4
)


def _local(size: int) -> LinearAttSpec:
    return dataclasses.replace(GLOBAL, num_k_heads=GLOBAL.num_k_heads // size, num_v_heads=GLOBAL.num_v_heads // size)


def _checkpoint(gen: torch.Generator) -> Checkpoint:
    conv = torch.randn(2, 3, GLOBAL.conv_dim, 3, generator=gen)
    ssm = torch.randn(2, 3, GLOBAL.num_v_heads, 3, 5, generator=gen)
    return Checkpoint(conv=conv, ssm=ssm)


def test_rank_slices_hold_their_heads_of_q_k_and_v():
    ckpt = _checkpoint(torch.Generator().manual_seed(0))
    q, k, v = ckpt.conv.split([6, 6, 20], dim=2)
    rank1 = split_checkpoint(ckpt, _local(2), TPInfo(1, 2))
    # rank 1 of 2: key head 1 of q and of k, value heads 2-3
    expected = torch.cat([q[:, :, 3:6], k[:, :, 3:6], v[:, :, 10:20]], dim=2)
    assert torch.equal(rank1.conv, expected)
    assert torch.equal(rank1.ssm, ckpt.ssm[:, :, 2:4])


@pytest.mark.parametrize("size", [1, 2])
def test_split_then_merge_gives_the_checkpoint_back(size):
    ckpt = _checkpoint(torch.Generator().manual_seed(size))
    parts = [split_checkpoint(ckpt, _local(size), TPInfo(r, size)) for r in range(size)]
    merged = merge_checkpoints(parts, _local(size))
    assert torch.equal(merged.conv, ckpt.conv) and torch.equal(merged.ssm, ckpt.ssm)
    if size > 1:
        # teeth: ranks in the wrong order give another tensor
        wrong = merge_checkpoints(parts[::-1], _local(size))
        assert not torch.equal(wrong.conv, ckpt.conv) and not torch.equal(wrong.ssm, ckpt.ssm)


@pytest.mark.parametrize(
    "num_heads, size", [(4, 2), (2, 4), (1, 2), (None, 2)], ids=["split", "replicated-2", "replicated-1", "mla"]
)
def test_kv_by_global_head(num_heads, size):
    kv = torch.randn(3, 7, num_heads or 1, 8) if num_heads else torch.randn(3, 7, 24)
    parts = [split_kv(kv, num_heads, TPInfo(r, size)) for r in range(size)]
    if num_heads is not None and num_heads < size:
        per_head = size // num_heads
        # each KV head lives whole on size / num_heads consecutive ranks
        for r, part in enumerate(parts):
            assert torch.equal(part, kv[:, :, r // per_head : r // per_head + 1])
    assert torch.equal(merge_kv(parts, num_heads), kv)
