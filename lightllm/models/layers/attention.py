"""Qwen gated full attention: per-head output gate, zero-centred q/k RMSNorm, partial RoPE, GQA.

`q_proj` rows are per head `[q_h | gate_h]`; the output is `o_proj(attn · sigmoid(gate))`.
"""

from __future__ import annotations

import torch
from torch import nn

from lightllm.kernels.qk_norm_rope import qk_norm_rope
from lightllm.kernels.sigmoid_gate import sigmoid_gate
from lightllm.models.config import AttentionConfig
from lightllm.models.context import StepContext
from lightllm.models.layers.paged_attention import attend
from lightllm.models.layers.quantized_linear import linear, set_weight
from lightllm.models.layers.rotary import Rotary
from lightllm.models.loader import Shapes, WeightLoader


class GatedAttention(nn.Module):
    """Weights (local shards): `qkv_proj [2·Hq·D + 2·Hkv·D, H]`, the checkpoint's `q_proj` (per-head interleaved
    query and gate), `k_proj` and `v_proj` stacked so one GEMM reads the input once; `o_proj [H, Hq·D]`,
    `q_norm, k_norm [D]`. Output is a TP partial sum."""

    def __init__(self, cfg: AttentionConfig, eps: float, kv_layer: int, rotary: Rotary, tp_size: int = 1):
        super().__init__()
        self.cfg = cfg
        self.eps = eps
        self.kv_layer = kv_layer
        self.rotary = rotary
        self.num_heads = max(cfg.num_heads // tp_size, 1)
        self.num_kv_heads = max(cfg.num_kv_heads // tp_size, 1)
        # "torch" | "triton" forces the attention backend (tests); None = by device
        self.attention_backend: str | None = None

    def attention_kernel_shape(self) -> tuple[int, int, int, int, bool]:
        """(query heads, key heads, key dim, value dim, addressed by table row) of this layer's attention launches
        (`lightllm.kernels.paged_attention.warmup_paged_attention`)."""
        return self.num_heads, self.num_kv_heads, self.cfg.head_dim, self.cfg.head_dim, True

    def checkpoint_shapes(self, prefix: str, hidden: int) -> Shapes:
        c, prefix = self.cfg, f"{prefix}self_attn."
        # q_proj rows hold each head's query and its output gate
        rows = {"q_proj": 2 * c.num_heads * c.head_dim, "k_proj": c.num_kv_heads * c.head_dim}
        rows.update(v_proj=rows["k_proj"], o_proj=hidden)
        columns = {"q_proj": hidden, "k_proj": hidden, "v_proj": hidden, "o_proj": c.num_heads * c.head_dim}
        shapes = {f"{prefix}{n}.weight": (rows[n], columns[n]) for n in rows}
        shapes.update({f"{prefix}{n}.weight": (c.head_dim,) for n in ("q_norm", "k_norm")})
        if c.bias:
            shapes.update({f"{prefix}{n}.bias": (rows[n],) for n in rows})
        return shapes

    def load(self, w: WeightLoader, prefix: str) -> None:
        c, prefix = self.cfg, f"{prefix}self_attn."
        # q/k/v column-parallel (output rows by head), each shard stacked on this rank; o row-parallel (input
        # columns by head)
        heads = {"q": c.num_heads, "k": c.num_kv_heads, "v": c.num_kv_heads}
        names = [f"{prefix}{n}_proj.weight" for n in heads]
        qkv = torch.cat([w.get_linear(name, 0, h) for name, h in zip(names, heads.values())])
        set_weight(self, "qkv_proj", w.linear(qkv, *names))
        o_name = f"{prefix}o_proj.weight"
        set_weight(self, "o_proj", w.linear(w.get_linear(o_name, 1, c.num_heads), o_name))
        self.register_buffer("q_norm", w.get(f"{prefix}q_norm.weight"))
        self.register_buffer("k_norm", w.get(f"{prefix}k_norm.weight"))
        bias = [w.get(f"{prefix}{n}_proj.bias", 0, h) for n, h in heads.items()] if c.bias else None
        self.register_buffer("qkv_bias", torch.cat(bias) if bias else None)
        # row-parallel bias: added once, on rank 0
        self.register_buffer("o_bias", w.get(f"{prefix}o_proj.bias") if c.bias and w.tp.rank == 0 else None)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        t, d = x.shape[0], self.cfg.head_dim
        qkv = linear(x, self.qkv_proj, self.qkv_bias)
        # views: the norm + RoPE kernel, the output gate and the KV write read rows at qkv's stride
        q_gate, k, v = qkv.split([2 * self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q, gate = q_gate.view(t, self.num_heads, 2 * d).chunk(2, dim=-1)
        k, v = k.view(t, self.num_kv_heads, d), v.view(t, self.num_kv_heads, d)
        cos, sin = ctx.shared(("rope", x.dtype), lambda: self.rotary.cos_sin(ctx.positions, x.dtype))
        q, k = qk_norm_rope(q, k, self.q_norm, self.k_norm, self.eps, cos, sin)
        ctx.kv.write(self.kv_layer, ctx.write_slots, k, v)

        def load_kv(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            keys, values = ctx.kv.gather(self.kv_layer, table)
            return keys, values

        pool = (ctx.kv.buffers[0][self.kv_layer], ctx.kv.buffers[1][self.kv_layer])
        o = attend(q, ctx.groups, load_kv, d**-0.5, kv_pool=pool, backend=self.attention_backend)
        return linear(sigmoid_gate(o.reshape(t, self.num_heads, d), gate), self.o_proj, self.o_bias)
