"""Qwen3-Next's grouped GDN input projections, un-interleaved into flat `q | k | v | z` and `b | a` parts.

The checkpoint stores `in_proj_qkvz` per key-head group `g` as `[q_g (dk) | k_g (dk) | v_g (r·dv) | z_g (r·dv)]`
with `r = HV / H`, and `in_proj_ba` per group as `[b_g (r) | a_g (r)]`. Value head `g·r + j` is the j-th value
head of group g, so after regrouping every part is head-major like Qwen3.5's split projections.
"""

from __future__ import annotations

import torch

from lightllm.linear_att import LinearAttSpec

QKVZ = "linear_attn.in_proj_qkvz.weight"
BA = "linear_attn.in_proj_ba.weight"


def split_qkvz(w: torch.Tensor, spec: LinearAttSpec) -> tuple[torch.Tensor, ...]:
    """`[H·(2dk + 2r·dv), hidden]` -> q, k `[H·dk, hidden]`, v, z `[HV·dv, hidden]`."""
    h, dk, dv = spec.num_k_heads, spec.head_k_dim, spec.head_v_dim
    r = spec.num_v_heads // h
    parts = w.view(h, 2 * dk + 2 * r * dv, w.shape[-1]).split([dk, dk, r * dv, r * dv], dim=1)
    return tuple(p.reshape(-1, w.shape[-1]) for p in parts)


def split_ba(w: torch.Tensor, spec: LinearAttSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """`[2·HV, hidden]` -> b, a `[HV, hidden]`."""
    h = spec.num_k_heads
    r = spec.num_v_heads // h
    b, a = w.view(h, 2 * r, w.shape[-1]).split([r, r], dim=1)
    return b.reshape(-1, w.shape[-1]), a.reshape(-1, w.shape[-1])
