"""One decoder layer: pre-norm mixer (linear or full attention) + pre-norm FFN (dense or MoE), residuals."""

from __future__ import annotations

import torch
from torch import nn

from lightllm.models.config import FULL, MOE, ModelConfig
from lightllm.models.context import StepContext
from lightllm.models.layers.attention import GatedAttention
from lightllm.models.layers.gdn import GatedDeltaNet
from lightllm.models.layers.kda import KimiDeltaAttention
from lightllm.models.layers.mla import LatentAttention
from lightllm.models.layers.mlp import SwiGLU
from lightllm.models.layers.moe import MoE
from lightllm.models.layers.norms import add_rms_norm, rms_norm
from lightllm.models.layers.rotary import Rotary
from lightllm.models.loader import Shapes, WeightLoader
from lightllm.models.tp import TPInfo


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, mixer: nn.Module, ffn: nn.Module, tp: TPInfo):
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.hidden = cfg.hidden_size
        self.zero_centered = cfg.zero_centered_norm
        self.mixer = mixer
        self.ffn = ffn
        self.tp = tp

    def checkpoint_shapes(self, prefix: str, available: set[str] | None = None) -> Shapes:
        shapes = {f"{prefix}{n}.weight": (self.hidden,) for n in ("input_layernorm", "post_attention_layernorm")}
        shapes.update(self.mixer.checkpoint_shapes(prefix, self.hidden))
        if isinstance(self.ffn, MoE):
            return shapes | self.ffn.checkpoint_shapes(f"{prefix}mlp.", self.hidden, available)
        return shapes | self.ffn.checkpoint_shapes(f"{prefix}mlp.", self.hidden)

    def load(self, w: WeightLoader, prefix: str) -> None:
        self.register_buffer("input_norm", w.get(f"{prefix}input_layernorm.weight"))
        self.register_buffer("post_norm", w.get(f"{prefix}post_attention_layernorm.weight"))
        self.mixer.load(w, prefix)
        self.ffn.load(w, f"{prefix}mlp.")

    def forward(
        self, h: torch.Tensor, ctx: StepContext, pending: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(residual stream, its pending delta)`: the FFN's output is returned unadded, so that the add and the
        next norm (the next layer's, or the model's final one) run as one pass; `pending` is the previous layer's.
        The stream after this layer is `h + delta` of the pair returned."""
        if pending is None:
            x = rms_norm(h, self.input_norm, self.eps, self.zero_centered)
        else:
            x, h = add_rms_norm(pending, h, self.input_norm, self.eps, self.zero_centered)
        x, h = add_rms_norm(self.tp.all_reduce(self.mixer(x, ctx)), h, self.post_norm, self.eps, self.zero_centered)
        return h, self.tp.all_reduce(self.ffn(x))


def build_layer(
    cfg: ModelConfig, layer_type: str, ffn_type: str, index: int, rotary: Rotary | None, tp: TPInfo
) -> DecoderLayer:
    """`index` is the layer's position among layers of its kind: its KV layer for full attention, its state
    layer for linear attention (the state and the KV cache number only their own layers)."""
    if layer_type == FULL:
        if cfg.attention.kind == "mla":
            mixer = LatentAttention(cfg.attention, index, tp.size)
        else:
            mixer = GatedAttention(cfg.attention, cfg.rms_norm_eps, index, rotary, tp.size)
    elif cfg.linear.algo == "kda":
        mixer = KimiDeltaAttention(cfg.linear, cfg.rms_norm_eps, index, tp.size)
    else:
        mixer = GatedDeltaNet(cfg.linear, cfg.arch == "qwen3_next", cfg.rms_norm_eps, index, tp.size)
    if ffn_type == MOE:
        ffn = MoE(cfg.moe, kimi_names=cfg.arch == "kimi_linear")
    else:
        ffn = SwiGLU(cfg.intermediate_size)
    return DecoderLayer(cfg, mixer, ffn, tp)
