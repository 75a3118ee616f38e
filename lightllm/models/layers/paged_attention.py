"""Causal attention of new query tokens over their rows' gathered KV (torch SDPA; runs on CPU and CUDA).

The KV of every context token is gathered from the token-granular cache through the row's slot table, so
rows of width W (verify windows) attend causally to each other and to their cached prefix in one call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from lightllm.models.context import AttentionGroup

# slot table [n, L] -> keys [n, L, Hk, Dk], values [n, L, Hk, Dv]
KVLoader = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def attend(q: torch.Tensor, groups: list[AttentionGroup], load_kv: KVLoader, scale: float) -> torch.Tensor:
    """`q [T, H, Dk]` (all rows' new tokens, flat) -> `o [T, H, Dv]`; query heads group over the key heads."""
    out = None
    for g in groups:
        k, v = load_kv(g.slot_table)
        if k.shape[2] != q.shape[1]:
            # explicit head expansion: every SDPA backend accepts it (enable_gqa is not honoured by all with masks)
            group = q.shape[1] // k.shape[2]
            k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        qg = q[g.token_index].transpose(1, 2)  # [n, H, Wq, Dk]
        o = F.scaled_dot_product_attention(
            qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=g.mask, scale=scale
        ).transpose(1, 2)  # [n, Wq, H, Dv]
        if out is None:
            out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        out[g.token_index[g.valid]] = o[g.valid]
    return out
