"""Per-rank state <-> state laid out by global head, so checkpoints move between engines of different `--tp`.

A rank holds whole heads: linear-attention heads `[rank * H/N, (rank + 1) * H/N)` (the conv channels
`[q | k | v]` each split alike), attention KV heads the same way, or, with fewer KV heads than ranks, KV head
`rank // (N / Hkv)` replicated on N/Hkv ranks. MLA's latent KV and hidden states are replicated.
"""

from __future__ import annotations

import torch

from lightllm.linear_att import LinearAttSpec
from lightllm.linear_att.base import Checkpoint
from lightllm.models.tp import TPInfo

# [NL, n, C, Kc - 1] conv windows: channels on dim 2; [NL, n, HV, K, V] SSM: heads on dim 2
CHANNEL_DIM = HEAD_DIM = 2


def conv_channel_sizes(spec: LinearAttSpec) -> list[int]:
    """Channel widths of the conv's q, k and v parts for the heads in `spec`."""
    key = spec.num_k_heads * spec.head_k_dim
    return [key, key, spec.num_v_heads * spec.head_v_dim]


def merge_conv(parts: list[torch.Tensor], local: LinearAttSpec) -> torch.Tensor:
    """Every rank's conv window (rank order) -> the global one: q of all heads, then k, then v."""
    pieces = [p.split(conv_channel_sizes(local), dim=CHANNEL_DIM) for p in parts]
    return torch.cat([torch.cat([pc[i] for pc in pieces], dim=CHANNEL_DIM) for i in range(3)], dim=CHANNEL_DIM)


def split_conv(conv: torch.Tensor, local: LinearAttSpec, tp: TPInfo) -> torch.Tensor:
    sizes = conv_channel_sizes(local)
    parts = conv.split([s * tp.size for s in sizes], dim=CHANNEL_DIM)
    return torch.cat([tp.shard(p, CHANNEL_DIM) for p in parts], dim=CHANNEL_DIM)


def merge_checkpoints(parts: list[Checkpoint], local: LinearAttSpec) -> Checkpoint:
    return Checkpoint(
        conv=merge_conv([p.conv for p in parts], local), ssm=torch.cat([p.ssm for p in parts], dim=HEAD_DIM)
    )


def split_checkpoint(ckpt: Checkpoint, local: LinearAttSpec, tp: TPInfo) -> Checkpoint:
    return Checkpoint(conv=split_conv(ckpt.conv, local, tp), ssm=tp.shard(ckpt.ssm, HEAD_DIM))


def merge_kv(parts: list[torch.Tensor], num_heads: int | None) -> torch.Tensor:
    """`[L, n, heads, dim]` per rank -> global heads; `num_heads=None` (MLA latent): replicated, rank 0's."""
    if num_heads is None:
        return parts[0]
    # with fewer heads than ranks, the first rank of each replica set speaks for its head
    step = max(len(parts) // num_heads, 1)
    return torch.cat(parts[::step], dim=HEAD_DIM)


def split_kv(kv: torch.Tensor, num_heads: int | None, tp: TPInfo) -> torch.Tensor:
    return kv if num_heads is None else tp.shard_heads(kv, HEAD_DIM, num_heads)
