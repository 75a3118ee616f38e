"""Kimi Delta Attention mixer (Kimi-Linear linear-attention layers).

q/k/v projections with separate short convs (handed to the state as one depthwise conv over `[q|k|v]`),
low-rank forget gate `f_b(f_a(x))` -> `graw [T, HV, K]` (softplus gate with per-channel `dt_bias`, applied in
the state), `beta = sigmoid(b_proj(x))`, output `o_proj(w · norm(o) · sigmoid(g_b(g_a(x))))`.
"""

from __future__ import annotations

import torch
from torch import nn

from lightllm.kernels.split_columns import split_columns
from lightllm.linear_att import LinearAttSpec
from lightllm.linear_att.base import LayerParams
from lightllm.models.context import StepContext
from lightllm.models.layers.linear_state import run_linear_state
from lightllm.models.layers.norms import gated_rms_norm_sigmoid
from lightllm.models.layers.quantized_linear import linear, set_weight
from lightllm.models.loader import Shapes, WeightLoader

WEIGHTS = ("q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d", "f_a_proj", "f_b_proj", "b_proj")
WEIGHTS += ("g_a_proj", "g_b_proj", "o_norm", "o_proj")


class KimiDeltaAttention(nn.Module):
    def __init__(self, spec: LinearAttSpec, eps: float, linear_layer: int, tp_size: int = 1):
        super().__init__()
        self.spec = spec
        self.eps = eps
        self.linear_layer = linear_layer
        self.num_heads = spec.num_v_heads // tp_size
        d = spec.head_k_dim
        # in_proj's output columns: f_a | g_a (the gates' low-rank inputs, whole on every rank) | q k v | b
        self.split_sizes = [d, d, 3 * self.num_heads * d, self.num_heads]

    def checkpoint_shapes(self, prefix: str, hidden: int) -> Shapes:
        s = self.spec
        h, d, width = s.num_v_heads, s.head_k_dim, s.num_v_heads * s.head_k_dim
        shapes = {n: (width, hidden) for n in ("q_proj", "k_proj", "v_proj")}
        shapes.update({f"{n}_conv1d": (width, 1, s.conv_kernel_size) for n in "qkv"})
        # the forget and output gates are low-rank: hidden -> head_dim -> heads x head_dim
        shapes.update(f_a_proj=(d, hidden), f_b_proj=(width, d), b_proj=(h, hidden))
        shapes.update(g_a_proj=(d, hidden), g_b_proj=(width, d), o_norm=(d,), o_proj=(hidden, width))
        p = f"{prefix}self_attn."
        out = {f"{p}{n}.weight": shapes[n] for n in WEIGHTS}
        # A_log keeps the original remote code's broadcast layout [1, 1, heads, 1]
        return out | {f"{p}A_log": (1, 1, h, 1), f"{p}dt_bias": (width,)}

    def load(self, w: WeightLoader, prefix: str) -> None:
        p, h, d = f"{prefix}self_attn.", self.spec.num_v_heads, self.spec.head_k_dim
        # every projection of the input in one GEMM: the replicated low-rank gate inputs first (head_dim rows each,
        # whole weight blocks), then this rank's q, k, v and b heads (b's few rows a partial block of their own)
        down = [f"{p}f_a_proj.weight", f"{p}g_a_proj.weight"]
        qkvb = [f"{p}{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "b_proj")]
        parts = [w.get_linear(n) for n in down] + [w.get_linear(n, 0, h) for n in qkvb]
        set_weight(self, "in_proj", w.linear(torch.cat(parts), *down, *qkvb))
        for attr, n in (("f_up", "f_b_proj"), ("g_up", "g_b_proj")):
            set_weight(self, attr, w.linear(w.get_linear(f"{p}{n}.weight", 0, h), f"{p}{n}.weight"))
        conv = torch.cat([w.get(f"{p}{n}_conv1d.weight", 0, h).squeeze(1) for n in "qkv"])
        self.params = LayerParams(
            conv_weight=conv,
            conv_bias=None,
            A_log=w.get(f"{p}A_log").reshape(h)[self._head_slice(w)].contiguous(),
            dt_bias=w.get(f"{p}dt_bias", 0, h).view(-1, d),
        )
        self.register_buffer("conv_weight", conv)
        self.register_buffer("A_log", self.params.A_log)
        self.register_buffer("dt_bias", self.params.dt_bias)
        self.register_buffer("o_norm", w.get(f"{p}o_norm.weight"))
        set_weight(self, "o_proj", w.linear(w.get_linear(f"{p}o_proj.weight", 1, h), f"{p}o_proj.weight"))

    def _head_slice(self, w: WeightLoader) -> slice:
        start = w.tp.rank * self.num_heads if w.tp.size > 1 else 0
        return slice(start, start + self.num_heads)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        t, h, d = x.shape[0], self.num_heads, self.spec.head_k_dim
        f_low, g_low, mixed_qkv, braw = split_columns(linear(x, self.in_proj), self.split_sizes)
        graw = linear(f_low, self.f_up).view(t, h, d)
        o = run_linear_state(ctx, self.linear_layer, mixed_qkv, graw, braw, self.params, h, d)
        y = gated_rms_norm_sigmoid(o, linear(g_low, self.g_up).view(t, h, d), self.o_norm, self.eps)
        return linear(y.reshape(t, h * d), self.o_proj)
