"""Qwen MTP head: one extra decoder layer that drafts the token after next from (token, main hidden).

`h' = norm(layer(fc([norm_e(embed(x_{t+1})) ; norm_h(h_t)])))`, logits = the main lm_head on h'. The layer is
full attention with its own KV (layer 0 of the MTP KV cache) and the main model's FFN kind. A chained draft
feeds the head's own output h' back as the hidden of the next step.
"""

from __future__ import annotations

import torch
from torch import nn

from lightllm.models.config import FULL, MOE, ModelConfig
from lightllm.models.context import StepContext
from lightllm.models.layers.decoder import build_layer
from lightllm.models.layers.norms import add_rms_norm, rms_norm
from lightllm.models.layers.quantized_linear import linear, set_weight
from lightllm.models.layers.rotary import Rotary
from lightllm.models.loader import Shapes, WeightLoader
from lightllm.models.tp import TPInfo

NORMS = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")


class MtpHead(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: Rotary | None, tp: TPInfo):
        super().__init__()
        self.cfg = cfg
        self.layer = build_layer(cfg, FULL, MOE if cfg.moe is not None else "dense", 0, rotary, tp)

    def checkpoint_shapes(self, available: set[str] | None = None) -> Shapes:
        hidden = self.cfg.hidden_size
        # fc maps the concatenated (embedding, hidden) pair back to hidden
        shapes = {"mtp.fc.weight": (hidden, 2 * hidden)} | {f"mtp.{n}.weight": (hidden,) for n in NORMS}
        return shapes | self.layer.checkpoint_shapes("mtp.layers.0.", available)

    def load(self, w: WeightLoader) -> None:
        set_weight(self, "fc", w.linear(w.get_linear("mtp.fc.weight"), "mtp.fc.weight"))
        self.register_buffer("norm_embed", w.get("mtp.pre_fc_norm_embedding.weight"))
        self.register_buffer("norm_hidden", w.get("mtp.pre_fc_norm_hidden.weight"))
        self.register_buffer("norm", w.get("mtp.norm.weight"))
        self.layer.load(w, "mtp.layers.0.")

    def forward(self, token_embeds: torch.Tensor, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """`token_embeds, hidden [T, hidden]` (pairs (x_{t+1}, h_t)) -> normed draft hidden `[T, hidden]`."""
        eps, zc = self.cfg.rms_norm_eps, self.cfg.zero_centered_norm
        x = torch.cat(
            [rms_norm(token_embeds, self.norm_embed, eps, zc), rms_norm(hidden, self.norm_hidden, eps, zc)], -1
        )
        h, delta = self.layer(linear(x, self.fc), ctx)
        return add_rms_norm(delta, h, self.norm, eps, zc)[0]
