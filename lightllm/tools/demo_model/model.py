"""The demo model for training: transformers' Qwen3.5 text model plus its MTP head, in the released layout.

The head is transformers' `MtpModel` (the class the parity tests check lightllm's MTP against), trained jointly:
row t pairs the main model's final-normed hidden state h_t with the embedding of token t+1 and predicts token t+2,
exactly as `lightllm.models.mtp.MtpHead` drafts at inference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightllm.tools.tiny_model.configs import model_config
from lightllm.tools.tiny_model.sizes import TinySizes

ARCH = "qwen3_5"
# 8 layers (GDN, GDN, GDN, attention) x 2, MTP depth 1; ~7.5M parameters, ~15 MB in bf16.
DEFAULT_SIZES = {
    "hidden_size": 256,
    "num_layers": 8,
    "vocab_size": 3072,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "intermediate_size": 512,
    "full_attention_interval": 4,
    "num_mtp_layers": 1,
}


def demo_config(sizes: TinySizes, dtype: str, special_ids: dict[str, int]) -> dict:
    """config.json of the demo checkpoint (the released Qwen3.5 VLM layout, text model under `text_config`)."""
    if sizes.num_mtp_layers != 1:
        raise ValueError("the demo model has exactly one MTP layer")
    return model_config(ARCH, sizes, dtype, special_ids)


class DemoModel(nn.Module):
    """Main causal LM and MTP head; `loss(ids)` is the joint training objective."""

    def __init__(self, config: dict):
        super().__init__()
        import transformers
        from transformers.modeling_layers import MtpModel

        text = transformers.AutoConfig.for_model(**config).get_text_config()
        text.num_mtp_layers = 1
        text.mtp_layer_types = ["full_attention"]
        self.lm = transformers.Qwen3_5ForCausalLM(text)
        self.mtp = MtpModel(self.lm, 1)

    def init_weights(self, seed: int) -> None:
        """Seeded initialisation of every trainable tensor (transformers' scheme; Qwen norms start at zero)."""
        torch.manual_seed(seed)
        self.lm.apply(self.lm._init_weights)
        self.mtp.apply(self.mtp._init_weights)

    def mtp_logits(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """`hidden [B, T, H]` (final-normed), `ids [B, T]` -> draft logits `[B, T-1, V]`; row t predicts t+2."""
        next_ids = ids[:, 1:]
        positions = torch.arange(next_ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1)
        embeds = self.mtp.embed_tokens(next_ids)
        masks = self.mtp.create_masks_for_mtp_layer(0, embeds, None, positions)
        rope_positions = positions
        if "mrope_section" in (getattr(self.mtp.config, "rope_parameters", None) or {}):
            # text-only M-RoPE: the three position streams are equal; transformers 5.17's rotary wants them spelled out
            rope_positions = positions[None].expand(3, -1, -1)
        rope = self.mtp.rotary_emb(embeds, position_ids=rope_positions)
        out = self.mtp.layers[0](embeds, hidden[:, :-1], rope, masks.get("attention_mask"), positions, None)
        return self.mtp.shared_head(out)

    def loss(
        self, ids: torch.Tensor, mtp_weight: float, distill_weight: float = 0.0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`ids [B, T]` -> (total, next-token loss, token-after-next loss of the MTP head).

        `distill_weight` adds the MTP head's cross-entropy against the main model's own (detached) distribution
        for the same token: a draft is accepted when it equals the main model's prediction, not the text's, so the
        head is also taught to predict the model."""
        out = self.lm.model(input_ids=ids)
        hidden = out.last_hidden_state
        logits = self.lm.lm_head(hidden)
        vocab = logits.shape[-1]
        main = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        draft = self.mtp_logits(hidden, ids)[:, :-1].reshape(-1, vocab).float()
        mtp = F.cross_entropy(draft, ids[:, 2:].flatten())
        total = main + mtp_weight * mtp
        if distill_weight:
            teacher = logits[:, 1:-1].reshape(-1, vocab).float().detach().softmax(-1)
            total = total + distill_weight * F.cross_entropy(draft, teacher)
        return total, main, mtp
