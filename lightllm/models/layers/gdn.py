"""Gated DeltaNet mixer (Qwen3-Next / Qwen3.5 linear-attention layers).

`x -> [q|k|v | z | b | a]` by one local GEMM (checkpoint projections regrouped at load), conv + recurrence
through the state (`graw = a`, `braw = b`, gates activated inside the state operators), then the gated RMSNorm
`w · norm(o) · silu(z)` per value head and `out_proj` (row-parallel: the output is a TP partial sum).
"""

from __future__ import annotations

import torch
from torch import nn

from lightllm.kernels.split_columns import split_columns
from lightllm.linear_att import LinearAttSpec
from lightllm.linear_att.base import LayerParams
from lightllm.models.context import StepContext
from lightllm.models.layers.linear_state import run_linear_state
from lightllm.models.layers.norms import gated_rms_norm_silu
from lightllm.models.layers.quantized_linear import linear, set_weight
from lightllm.models.loader import Shapes, WeightLoader
from lightllm.models.qwen3_5 import weights as q35
from lightllm.models.qwen3_next import weights as q3n


class GatedDeltaNet(nn.Module):
    def __init__(self, spec: LinearAttSpec, grouped_in_proj: bool, eps: float, linear_layer: int, tp_size: int = 1):
        super().__init__()
        self.spec = spec
        self.grouped = grouped_in_proj
        self.eps = eps
        self.linear_layer = linear_layer
        self.num_k_heads = spec.num_k_heads // tp_size
        self.num_v_heads = spec.num_v_heads // tp_size
        key_dim, value_dim = self.num_k_heads * spec.head_k_dim, self.num_v_heads * spec.head_v_dim
        self.split_sizes = [2 * key_dim + value_dim, value_dim, self.num_v_heads, self.num_v_heads]

    def checkpoint_shapes(self, prefix: str, hidden: int) -> Shapes:
        s = self.spec
        key_dim, value_dim, hv = s.num_k_heads * s.head_k_dim, s.num_v_heads * s.head_v_dim, s.num_v_heads
        if self.grouped:
            proj = {q3n.QKVZ: (2 * key_dim + 2 * value_dim, hidden), q3n.BA: (2 * hv, hidden)}
        else:
            proj = {q35.QKV: (2 * key_dim + value_dim, hidden), q35.Z: (value_dim, hidden)}
            proj.update({q35.B: (hv, hidden), q35.A: (hv, hidden)})
        rest = {
            # depthwise conv over q|k|v
            "conv1d.weight": (2 * key_dim + value_dim, 1, s.conv_kernel_size),
            "A_log": (hv,),
            "dt_bias": (hv,),
            "norm.weight": (s.head_v_dim,),
            "out_proj.weight": (hidden, value_dim),
        }
        shapes = {prefix + p: shape for p, shape in proj.items()}
        return shapes | {f"{prefix}linear_attn.{n}": shape for n, shape in rest.items()}

    def _projections(self, w: WeightLoader, prefix: str) -> tuple[list[torch.Tensor], list[str]]:
        """Full (unsharded) q, k, v, z, b, a projection weights, head-major, and the checkpoint names they
        come from."""
        if self.grouped:
            names = [prefix + q3n.QKVZ, prefix + q3n.BA]
            q, k, v, z = q3n.split_qkvz(w.get_linear(names[0]), self.spec)
            b, a = q3n.split_ba(w.get_linear(names[1]), self.spec)
        else:
            names = [prefix + n for n in (q35.QKV, q35.Z, q35.B, q35.A)]
            q, k, v = q35.split_qkv(w.get_linear(names[0]), self.spec)
            z, b, a = (w.get_linear(n) for n in names[1:])
        return [q, k, v, z, b, a], names

    def load(self, w: WeightLoader, prefix: str) -> None:
        s, tp = self.spec, w.tp
        heads = [s.num_k_heads, s.num_k_heads, s.num_v_heads, s.num_v_heads, s.num_v_heads, s.num_v_heads]
        parts, names = self._projections(w, prefix)
        local = [tp.shard_heads(p, 0, n) for p, n in zip(parts, heads)]
        # names of the q|k|v|z parts' tensors, then of the b|a parts'
        qkvz_names, ba_names = (names[:1], names[1:]) if self.grouped else (names[:2], names[2:])
        if w.quantizes(*qkvz_names) == w.quantizes(*ba_names):
            set_weight(self, "in_proj", w.linear(torch.cat(local), *names))
            self.register_buffer("ba_proj", None)
        else:
            # Qwen's FP8 releases leave in_proj_ba unquantized: q|k|v|z stays FP8 in its own GEMM
            set_weight(self, "in_proj", w.linear(torch.cat(local[:4]), *qkvz_names))
            set_weight(self, "ba_proj", w.linear(torch.cat(local[4:]), *ba_names))
        conv = w.get(f"{prefix}linear_attn.conv1d.weight").squeeze(1)
        key_dim = s.num_k_heads * s.head_k_dim
        conv_parts = conv.split([key_dim, key_dim, s.num_v_heads * s.head_v_dim])
        conv = torch.cat([tp.shard_heads(p, 0, n) for p, n in zip(conv_parts, heads[:3])])
        self.params = LayerParams(
            conv_weight=conv,
            conv_bias=None,
            A_log=w.get(f"{prefix}linear_attn.A_log", 0),
            dt_bias=w.get(f"{prefix}linear_attn.dt_bias", 0)[:, None],
        )
        self.register_buffer("conv_weight", self.params.conv_weight)
        self.register_buffer("A_log", self.params.A_log)
        self.register_buffer("dt_bias", self.params.dt_bias)
        self.register_buffer("norm", w.get(f"{prefix}linear_attn.norm.weight"))
        out_name = f"{prefix}linear_attn.out_proj.weight"
        set_weight(self, "out_proj", w.linear(w.get_linear(out_name, 1), out_name))

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        t, hv, dv = x.shape[0], self.num_v_heads, self.spec.head_v_dim
        if self.ba_proj is None:
            mixed_qkv, z, b, a = split_columns(linear(x, self.in_proj), self.split_sizes)
        else:
            mixed_qkv, z = split_columns(linear(x, self.in_proj), self.split_sizes[:2])
            b, a = split_columns(linear(x, self.ba_proj), self.split_sizes[2:])
        o = run_linear_state(ctx, self.linear_layer, mixed_qkv, a[:, :, None], b, self.params, hv, dv)
        y = gated_rms_norm_silu(o, z.reshape(t, hv, dv), self.norm, self.eps)
        return linear(y.reshape(t, hv * dv), self.out_proj)
