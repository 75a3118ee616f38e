"""Qwen3.5's GDN input projections: already flat and head-major (`in_proj_qkv` = q|k|v, then z, b, a)."""

from __future__ import annotations

import torch

from lightllm.linear_att import LinearAttSpec

QKV = "linear_attn.in_proj_qkv.weight"
Z = "linear_attn.in_proj_z.weight"
B = "linear_attn.in_proj_b.weight"
A = "linear_attn.in_proj_a.weight"


def split_qkv(w: torch.Tensor, spec: LinearAttSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    key_dim = spec.num_k_heads * spec.head_k_dim
    q, k, v = w.split([key_dim, key_dim, spec.num_v_heads * spec.head_v_dim], dim=0)
    return q, k, v
