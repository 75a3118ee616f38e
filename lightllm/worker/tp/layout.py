"""Per-rank state <-> state laid out by global head, so checkpoints move between engines of different `--tp`.

A rank holds whole heads: linear-attention heads `[rank * H/N, (rank + 1) * H/N)` (the conv channels
`[q | k | v]` each split alike), attention KV heads the same way, or, with fewer KV heads than ranks, KV head
`rank // (N / Hkv)` replicated on N/Hkv ranks. MLA's latent KV and hidden states are replicated.

Used for linear-state checkpoints and for whole requests (prefill/decode disaggregation's `RequestState`).
"""

from __future__ import annotations

import torch

from lightllm.cache.payload import RequestState, TensorBlob
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


def kv_heads(runner) -> int | None:
    """Global KV heads of a runner's attention cache; None for MLA's replicated latent."""
    a = runner.model_config.attention
    return None if a.kind == "mla" else a.num_kv_heads


def merge_request_states(parts: list[RequestState], runner) -> RequestState:
    """Every rank's exported request (rank order, host blobs) -> one laid out by global head."""
    heads, local = kv_heads(runner), runner.linear_spec

    def kv(component: int, attr: str) -> TensorBlob:
        return TensorBlob.of(merge_kv([getattr(p, attr)[component].tensor() for p in parts], heads))

    first = parts[0]
    return RequestState(
        num_tokens=first.num_tokens,
        kv=[kv(i, "kv") for i in range(len(first.kv))],
        conv=TensorBlob.of(merge_conv([p.conv.tensor() for p in parts], local)),
        ssm=TensorBlob.of(torch.cat([p.ssm.tensor() for p in parts], dim=HEAD_DIM)),
        mtp_kv=[kv(i, "mtp_kv") for i in range(len(first.mtp_kv))],
        mtp_len=first.mtp_len,
        # the hidden state after the all-reduce is the same on every rank
        mtp_hidden=first.mtp_hidden,
    )


def split_request_state(state: RequestState, runner) -> RequestState:
    """This rank's heads of a request laid out by global head (host blobs)."""
    heads, local, tp = kv_heads(runner), runner.linear_spec, runner.model.tp

    def kv(blob: TensorBlob) -> TensorBlob:
        return TensorBlob.of(split_kv(blob.tensor(), heads, tp))

    return RequestState(
        num_tokens=state.num_tokens,
        kv=[kv(b) for b in state.kv],
        conv=TensorBlob.of(split_conv(state.conv.tensor(), local, tp)),
        ssm=TensorBlob.of(tp.shard(state.ssm.tensor(), HEAD_DIM)),
        mtp_kv=[kv(b) for b in state.mtp_kv],
        mtp_len=state.mtp_len,
        mtp_hidden=state.mtp_hidden,
    )
