"""Kimi's multi-head latent attention without positional encoding (NoPE).

Each token caches one latent `[norm(c_kv) (kv_lora_rank) | k_rot (qk_rope_head_dim)]` for all heads (the
`k_rot` part is shared by the heads and, in Kimi-Linear, never rotated). Attention decompresses the gathered
latents with `kv_b_proj` into per-head `k_nope | v`, keys are `[k_nope | k_rot]`, scale `(nope + rope)^-1/2`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightllm.models.config import AttentionConfig
from lightllm.models.context import StepContext
from lightllm.models.layers.norms import rms_norm
from lightllm.models.layers.paged_attention import attend
from lightllm.models.loader import Shapes, WeightLoader

# transformers builds kv_a_layernorm with the RMSNorm default eps, not the model's rms_norm_eps
LATENT_NORM_EPS = 1e-6


class LatentAttention(nn.Module):
    def __init__(self, cfg: AttentionConfig, kv_layer: int, tp_size: int = 1):
        super().__init__()
        self.cfg = cfg
        self.kv_layer = kv_layer
        self.num_heads = cfg.num_heads // tp_size
        # "torch" | "triton" forces the attention backend (tests); None = by device
        self.attention_backend: str | None = None

    def attention_kernel_shape(self) -> tuple[int, int, int, int, bool]:
        """(query heads, key heads, key dim, value dim, addressed by table row) of this layer's attention launches
        over its expanded latents (`lightllm.kernels.paged_attention.warmup_paged_attention`)."""
        return self.num_heads, self.num_heads, self.cfg.qk_head_dim, self.cfg.v_head_dim, False

    def checkpoint_shapes(self, prefix: str, hidden: int) -> Shapes:
        c, h = self.cfg, self.cfg.num_heads
        shapes = {
            "q_proj": (h * c.qk_head_dim, hidden),
            "kv_a_proj_with_mqa": (c.kv_lora_rank + c.qk_rope_head_dim, hidden),
            "kv_a_layernorm": (c.kv_lora_rank,),
            "kv_b_proj": (h * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
            "o_proj": (hidden, h * c.v_head_dim),
        }
        return {f"{prefix}self_attn.{n}.weight": s for n, s in shapes.items()}

    def load(self, w: WeightLoader, prefix: str) -> None:
        p, h = f"{prefix}self_attn.", self.cfg.num_heads
        self.register_buffer("q_proj", w.get(f"{p}q_proj.weight", 0, h))
        self.register_buffer("kv_a", w.get(f"{p}kv_a_proj_with_mqa.weight"))
        self.register_buffer("kv_norm", w.get(f"{p}kv_a_layernorm.weight"))
        self.register_buffer("kv_b", w.get(f"{p}kv_b_proj.weight", 0, h))
        self.register_buffer("o_proj", w.get(f"{p}o_proj.weight", 1, h))

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        c, t, h = self.cfg, x.shape[0], self.num_heads
        q = F.linear(x, self.q_proj).view(t, h, c.qk_head_dim)
        compressed = F.linear(x, self.kv_a)
        latent = rms_norm(compressed[:, : c.kv_lora_rank], self.kv_norm, LATENT_NORM_EPS, zero_centered=False)
        ctx.kv.write(self.kv_layer, ctx.write_slots, torch.cat([latent, compressed[:, c.kv_lora_rank :]], dim=-1))

        def load_kv(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            (cached,) = ctx.kv.gather(self.kv_layer, table)
            n, length = table.shape
            kv = F.linear(cached[..., : c.kv_lora_rank], self.kv_b).view(n, length, h, -1)
            k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
            k_rot = cached[..., None, c.kv_lora_rank :].expand(n, length, h, c.qk_rope_head_dim)
            return torch.cat([k_nope, k_rot], dim=-1), v

        # the triton backend also runs on the expanded gathered KV (latent absorption is a later optimisation)
        o = attend(q, ctx.groups, load_kv, c.qk_head_dim**-0.5, backend=self.attention_backend)
        return F.linear(o.reshape(t, h * c.v_head_dim), self.o_proj)
