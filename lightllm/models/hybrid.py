"""A hybrid model: embedding, decoder layers built from the checkpoint's layer types, final norm, lm_head.

`forward` runs one step described by a StepContext and returns the final-normed hidden states of every new
token; `logits` projects selected rows. The MTP head (Qwen) is a separate module sharing embedding and lm_head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightllm.models.config import ModelConfig
from lightllm.models.context import StepContext
from lightllm.models.layers.decoder import build_layer
from lightllm.models.layers.mla import LatentAttention
from lightllm.models.layers.norms import add_rms_norm
from lightllm.models.layers.rotary import Rotary
from lightllm.models.loader import Shapes, WeightLoader
from lightllm.models.mtp import MtpHead
from lightllm.models.tp import TPInfo


class HybridModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPInfo | None = None, device: torch.device | str = "cpu"):
        super().__init__()
        self.cfg = cfg
        self.tp = tp or TPInfo()
        a = cfg.attention
        self.rotary = Rotary(a.rotary_dim, a.rope_theta, device, a.rope_scaling) if a.kind == "gated" else None
        counters = {"linear_attention": 0, "full_attention": 0}
        layers = []
        for layer_type, ffn_type in zip(cfg.layer_types, cfg.ffn_types):
            layers.append(build_layer(cfg, layer_type, ffn_type, counters[layer_type], self.rotary, self.tp))
            counters[layer_type] += 1
        self.layers = nn.ModuleList(layers)
        self.mtp = MtpHead(cfg, self.rotary, self.tp) if cfg.num_mtp_layers > 0 else None

    # loading ---------------------------------------------------------------------------------------------
    def skips(self, name: str) -> bool:
        """Checkpoint tensors this model ignores: MTP weights when the config declares no MTP layer, and a
        stored lm_head of a tied model."""
        if name.startswith("mtp.") and self.mtp is None:
            return True
        return name == "lm_head.weight" and self.cfg.tie_word_embeddings

    def checkpoint_shapes(self, available: set[str] | None = None) -> Shapes:
        """Every checkpoint tensor this model loads (canonical names, see `loader.normalize_name`) with the full
        shape its config implies; `available` (the checkpoint's names) picks between alternative layouts.

        The model holds no weights until `load`: a freshly built one answers this without allocating any."""
        vocab, hidden = self.cfg.vocab_size, self.cfg.hidden_size
        shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
        if not self.cfg.tie_word_embeddings:
            shapes["lm_head.weight"] = (vocab, hidden)
        for i, layer in enumerate(self.layers):
            shapes.update(layer.checkpoint_shapes(f"model.layers.{i}.", available))
        if self.mtp is not None:
            shapes.update(self.mtp.checkpoint_shapes(available))
        return shapes

    def checkpoint_names(self, available: set[str] | None = None) -> list[str]:
        return list(self.checkpoint_shapes(available))

    def load(self, w: WeightLoader) -> None:
        # vocab-parallel embedding and head: each rank holds and scores its slice of the vocabulary
        self.register_buffer("embed", w.get("model.embed_tokens.weight", 0))
        self.register_buffer("norm", w.get("model.norm.weight"))
        self.register_buffer("lm_head", self.embed if self.cfg.tie_word_embeddings else w.get("lm_head.weight", 0))
        for i, layer in enumerate(self.layers):
            layer.load(w, f"model.layers.{i}.")
        if self.mtp is not None:
            self.mtp.load(w)

    # forward ---------------------------------------------------------------------------------------------
    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.embed)
        # rows of other ranks' vocabulary come out zero here; the sum over ranks completes every row
        num_local = self.embed.shape[0]
        local = input_ids - self.tp.rank * num_local
        mine = (local >= 0) & (local < num_local)
        h = F.embedding(local.clamp(0, num_local - 1), self.embed) * mine[:, None].to(self.embed.dtype)
        return self.tp.all_reduce(h)

    def fixed_buffer_prefill_tokens(self) -> int | None:
        """The longest prefill chunk a row may run through fixed buffers (a graph) without a slower form of some
        layer, or None for no bound. There every MLA layer attends in latent space (the context bound is the
        cache's whole row), which costs ~3.4x the expanded form's flops per query and key and recomputes each
        query token's whole context in its own program: past `latent_max_query_len` tokens an eager step, whose
        long chunks decompress their actual contexts once, is the faster one."""
        limits = [m.latent_max_query_len for m in self.modules() if isinstance(m, LatentAttention)]
        return min(limits) if limits else None

    def forward(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """`input_ids [T]` -> final-normed hidden `[T, hidden]` (the lm_head input and the MTP head's input)."""
        h, pending = self.embed_tokens(input_ids), None
        for layer in self.layers:
            h, pending = layer(h, ctx, pending)
        return add_rms_norm(pending, h, self.norm, self.cfg.rms_norm_eps, self.cfg.zero_centered_norm)[0]

    def logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """`hidden [n, hidden]` -> `[n, vocab]`, fp32 (or the LM head's dtype)."""
        out = self.tp.all_gather_last(F.linear(hidden, self.lm_head))
        return out.float() if fp32 else out
