"""Kimi's multi-head latent attention without positional encoding (NoPE).

Each token caches one latent `[norm(c_kv) (kv_lora_rank) | k_rot (qk_rope_head_dim)]` for all heads (the
`k_rot` part is shared by the heads and, in Kimi-Linear, never rotated). Per head, `kv_b_proj` holds `W_UK`
(`k_nope = W_UK c_kv`) and `W_UV` (`v = W_UV c_kv`); keys are `[k_nope | k_rot]`, scale `(nope + rope)^-1/2`.

Two equal forms, chosen per attention group by its query width and context bound (host values):
- latent (decode, verify windows, short chunks, and every group of a fixed-buffer step, whose context bound is
  the cache's whole row): `W_UK` is absorbed into the query (`q_lat = W_UK^T q_nope`), the heads attend over the
  cached latents themselves (`lightllm.kernels.mla_attention`) and `W_UV` lifts the latent-space output. Nothing
  is expanded and no shape depends on the contexts' lengths.
- expanded (long prefill chunks of eager steps): the gathered latents are decompressed into per-head keys and
  values once and attended by the paged attention path; with many queries per latent this is fewer flops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightllm.kernels.mla_attention import mla_attention
from lightllm.models.config import AttentionConfig
from lightllm.models.context import AttentionGroup, StepContext
from lightllm.models.layers.norms import rms_norm
from lightllm.models.layers.paged_attention import attend
from lightllm.models.layers.quantized_linear import LinearWeight, linear, set_weight
from lightllm.models.loader import Shapes, WeightLoader

# transformers builds kv_a_layernorm with the RMSNorm default eps, not the model's rms_norm_eps
LATENT_NORM_EPS = 1e-6
# widest group query length attended in latent space. Per query token, head and key the latent form costs
# 2 (C + R) + 2 C flops against 2 (nope + rope) + 2 v expanded, and the expanded form pays 2 C (nope + v) per key
# and head once: at Kimi's shapes the latent form does fewer flops below ~170 queries per row, and reads 576
# values per key instead of writing and reading 320 per head
LATENT_MAX_QUERY_LEN = 64


class LatentAttention(nn.Module):
    def __init__(self, cfg: AttentionConfig, kv_layer: int, tp_size: int = 1):
        super().__init__()
        self.cfg = cfg
        self.kv_layer = kv_layer
        self.num_heads = cfg.num_heads // tp_size
        # "torch" | "triton" forces the attention backend (tests); None = by device
        self.attention_backend: str | None = None
        # groups whose query width is at most this attend in latent space (0: always expanded)
        self.latent_max_query_len = LATENT_MAX_QUERY_LEN

    def attention_kernel_shape(self) -> tuple[int, int, int, int, bool]:
        """(query heads, key heads, key dim, value dim, addressed by table row) of this layer's attention launches
        over its expanded latents (`lightllm.kernels.paged_attention.warmup_paged_attention`)."""
        return self.num_heads, self.num_heads, self.cfg.qk_head_dim, self.cfg.v_head_dim, False

    def latent_attention_shape(self) -> tuple[int, int, int]:
        """(query heads, latent rank, rope dims) of this layer's latent-space launches
        (`lightllm.kernels.mla_attention.warmup_mla_attention`)."""
        return self.num_heads, self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim

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
        q_name, a_name, o_name = (f"{p}{n}.weight" for n in ("q_proj", "kv_a_proj_with_mqa", "o_proj"))
        q_kv_a = torch.cat([w.get_linear(q_name, 0, h), w.get_linear(a_name)])
        self._hold(
            q_kv_a=w.linear(q_kv_a, q_name, a_name),
            kv_norm=w.get(f"{p}kv_a_layernorm.weight"),
            # dequantized in an FP8 model too: absorbed into the query and output in latent space
            kv_b=w.get(f"{p}kv_b_proj.weight", 0, h),
            o_proj=w.linear(w.get_linear(o_name, 1, h), o_name),
        )

    def set_weights(
        self, q_proj: torch.Tensor, kv_a: torch.Tensor, kv_norm: torch.Tensor, kv_b: torch.Tensor, o_proj: torch.Tensor
    ) -> None:
        """Hold these weights of this rank (plain tensors shaped as the checkpoint's, the heads' shards)."""
        self._hold(torch.cat([q_proj, kv_a]), kv_norm, kv_b, o_proj)

    def _hold(self, q_kv_a: LinearWeight, kv_norm: torch.Tensor, kv_b: torch.Tensor, o_proj: LinearWeight) -> None:
        # the query heads (sharded) and the latent projection (replicated) read the same input: one GEMM
        set_weight(self, "q_kv_a", q_kv_a)
        self.register_buffer("kv_norm", kv_norm)
        self.register_buffer("kv_b", kv_b)
        set_weight(self, "o_proj", o_proj)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        c, t, h = self.cfg, x.shape[0], self.num_heads
        both = linear(x, self.q_kv_a)
        # views at the fused row stride: the attention kernels and the norm take strided rows
        q, compressed = both[:, : h * c.qk_head_dim].view(t, h, c.qk_head_dim), both[:, h * c.qk_head_dim :]
        latent = rms_norm(compressed[:, : c.kv_lora_rank], self.kv_norm, LATENT_NORM_EPS, zero_centered=False)
        ctx.kv.write(self.kv_layer, ctx.write_slots, torch.cat([latent, compressed[:, c.kv_lora_rank :]], dim=-1))

        def load_kv(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            (cached,) = ctx.kv.gather(self.kv_layer, table)
            n, length = table.shape
            kv = F.linear(cached[..., : c.kv_lora_rank], self.kv_b).view(n, length, h, -1)
            k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
            k_rot = cached[..., None, c.kv_lora_rank :].expand(n, length, h, c.qk_rope_head_dim)
            return torch.cat([k_nope, k_rot], dim=-1), v

        in_latent = [g for g in ctx.groups if self._in_latent(g, ctx)]
        expanded = [g for g in ctx.groups if not self._in_latent(g, ctx)]
        if expanded:
            # the triton backend runs on the expanded gathered KV; other groups' tokens stay zero
            o = attend(q, expanded, load_kv, c.qk_head_dim**-0.5, backend=self.attention_backend)
        else:
            o = q.new_zeros(t, h, c.v_head_dim)
        for g in in_latent:
            self._attend_latent(q, g, ctx, o)
        return linear(o.reshape(t, h * c.v_head_dim), self.o_proj)

    def _in_latent(self, g: AttentionGroup, ctx: StepContext) -> bool:
        """Latent space for narrow groups, and for any group bounded by the cache's whole row (a fixed-buffer
        step: the expanded form would decompress the whole row); 0 forces the expanded form."""
        if self.latent_max_query_len == 0:
            return False
        return g.token_index.shape[1] <= self.latent_max_query_len or g.context_len >= ctx.kv.max_req_len

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [h, nope, C], W_UV [h, v, C]): views of the local heads' kv_b_proj."""
        c = self.cfg
        kv_b = self.kv_b.view(self.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return kv_b[:, : c.qk_nope_head_dim], kv_b[:, c.qk_nope_head_dim :]

    def _attend_latent(self, q: torch.Tensor, g: AttentionGroup, ctx: StepContext, o: torch.Tensor) -> None:
        """Add group `g`'s attention output to its tokens' rows of `o [T, h, v]` (which are zero), in latent space.
        The group's queries are gathered into a dense `[n * Wq]` layout (row i's token j at i * Wq + j); padding
        queries get a zero output, so the scatter-add back through `token_index` (padding repeats a real token)
        leaves every real token its own output exactly."""
        c, h = self.cfg, self.num_heads
        n, wq = g.token_index.shape
        w_uk, w_uv = self._absorbed()
        pool = ctx.kv.buffers[0][self.kv_layer]
        qg = q[g.token_index.reshape(-1)]  # [n * Wq, h, nope + rope]
        q_lat = torch.bmm(qg[..., : c.qk_nope_head_dim].transpose(0, 1), w_uk)  # [h, n * Wq, C]
        q_lat = torch.cat([q_lat.transpose(0, 1), qg[..., c.qk_nope_head_dim :]], dim=-1).to(pool.dtype)
        o_lat = q_lat.new_zeros(n * wq, h, c.kv_lora_rank)
        query_start = torch.arange(0, n * wq, wq, dtype=torch.int32, device=q.device)
        mla_attention(
            q_lat,
            pool,
            g.table,
            query_start,
            g.query_len,
            g.num_cached,
            c.qk_head_dim**-0.5,
            wq,
            o_lat,
            table_rows=g.table_rows,
            max_context_len=g.context_len,
            backend=self.attention_backend,
        )
        og = torch.bmm(o_lat.transpose(0, 1).to(w_uv.dtype), w_uv.transpose(1, 2)).transpose(0, 1)  # [n * Wq, h, v]
        # adding zeros is exact in any order, so the atomic scatter-add is deterministic here (and graph-safe)
        index = g.token_index.reshape(-1, 1).expand(-1, h * c.v_head_dim)
        o.view(o.shape[0], -1).scatter_add_(0, index, og.reshape(n * wq, -1).to(o.dtype))
