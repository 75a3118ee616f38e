"""Causal attention of new query tokens over their rows' KV in the token-granular cache.

Two backends with one contract: `torch` (SDPA over KV gathered through each row's slot table; the CPU path and
the reference) and `triton` (`lightllm.kernels.paged_attention`, reading the pool through the slot table inside
the kernel; the CUDA path). Rows of width W (verify windows) attend causally to each other and to their cached
prefix in one call; the new tokens' KV must already be written to the cache.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from lightllm.kernels.paged_attention import paged_attention
from lightllm.models.context import AttentionGroup

# slot table [n, L] -> keys [n, L, Hk, Dk], values [n, L, Hk, Dv]
KVLoader = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
BACKENDS = ("torch", "triton")


def attend(
    q: torch.Tensor,
    groups: list[AttentionGroup],
    load_kv: KVLoader,
    scale: float,
    kv_pool: tuple[torch.Tensor, torch.Tensor] | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """`q [T, H, Dk]` (all rows' new tokens, flat) -> `o [T, H, Dv]`; query heads group over the key heads.

    `kv_pool`: one layer's `(keys [S, Hk, Dk], values [S, Hk, Dv])` addressed by slot, when the cache holds them
    directly (GQA); without it the triton backend runs on `load_kv`'s gathered KV (MLA expands its latents there).
    `backend`: "torch" | "triton"; None picks triton for CUDA tensors and torch otherwise.
    """
    backend = backend or ("triton" if q.is_cuda else "torch")
    if backend == "torch":
        return _attend_sdpa(q, groups, load_kv, scale)
    if backend == "triton":
        return _attend_triton(q, groups, load_kv, scale, kv_pool)
    raise ValueError(f"attention backend {backend!r} not in {BACKENDS}")


def _attend_sdpa(q: torch.Tensor, groups: list[AttentionGroup], load_kv: KVLoader, scale: float) -> torch.Tensor:
    out = None
    for g in groups:
        k, v = load_kv(g.slot_table)
        # keys no query of the row sees take no part even when not finite (a masked key's weight is 0, but
        # 0 * NaN is not): a verify launched before its predecessor's counts were read holds KV slots past its
        # context for the worst case, which keep whatever their last owner left there
        unseen = ~g.mask.any(dim=2).squeeze(1)[:, :, None, None]  # [n, L, 1, 1]
        k, v = k.masked_fill(unseen, 0), v.masked_fill(unseen, 0)
        if k.shape[2] != q.shape[1]:
            # explicit head expansion: every SDPA backend accepts it (enable_gqa is not honoured by all with masks)
            group = q.shape[1] // k.shape[2]
            k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        qg = q[g.token_index].transpose(1, 2)  # [n, H, Wq, Dk]
        o = F.scaled_dot_product_attention(
            qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=g.mask, scale=scale
        ).transpose(1, 2)  # [n, Wq, H, Dv]
        if out is None:
            out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
        out[g.token_index[g.valid]] = o[g.valid]
    return out


def _attend_triton(
    q: torch.Tensor,
    groups: list[AttentionGroup],
    load_kv: KVLoader,
    scale: float,
    kv_pool: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    out = None
    for g in groups:
        if kv_pool is not None:
            keys, values, table, rows = kv_pool[0], kv_pool[1], g.table, g.table_rows
        else:
            # gathered KV [n, L, Hk, D] is its own pool: row i's position p sits at slot i * L + p
            k, v = load_kv(g.slot_table)
            n, length = g.slot_table.shape
            keys, values = k.reshape(n * length, *k.shape[2:]), v.reshape(n * length, *v.shape[2:])
            table, rows = torch.arange(n * length, device=q.device).view(n, length), None
        if out is None:
            # zeros: decode padding tokens get no attention output but must stay finite downstream
            out = q.new_zeros(q.shape[0], q.shape[1], values.shape[-1])
        # Wq (a host shape) bounds every row's query length without a device sync
        paged_attention(
            q,
            keys,
            values,
            table,
            g.query_start,
            g.query_len,
            g.num_cached,
            scale,
            g.token_index.shape[1],
            out,
            table_rows=rows,
            max_context_len=g.context_len,
        )
    return out
