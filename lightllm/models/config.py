"""The model-independent description of one hybrid checkpoint, filled by the per-architecture config mappers.

Everything below `models/` reads only this dataclass, never the raw `config.json`: the mappers in
`qwen3_next/`, `qwen3_5/` and `kimi_linear/` translate each checkpoint's spelling once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightllm.linear_att import LinearAttSpec

LINEAR = "linear_attention"
FULL = "full_attention"
DENSE = "dense"
MOE = "moe"


@dataclass(frozen=True)
class AttentionConfig:
    """Full-attention layers: Qwen's gated GQA (`kind="gated"`) or Kimi's multi-head latent attention (`"mla"`)."""

    kind: str
    num_heads: int
    num_kv_heads: int
    # gated: q/k/v head dim; mla: unused (see the mla_* fields)
    head_dim: int = 0
    # rotated leading dims of each head (0 = no rotary: Kimi's MLA is NoPE)
    rotary_dim: int = 0
    rope_theta: float = 10000.0
    bias: bool = False
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.kind == "mla" else self.head_dim

    @property
    def kv_cache_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Per-token shapes of what one layer caches: (K, V) for GQA, the single latent for MLA."""
        if self.kind == "mla":
            return ((self.kv_lora_rank + self.qk_rope_head_dim,),)
        return ((self.num_kv_heads, self.head_dim), (self.num_kv_heads, self.head_dim))


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts plus optional shared expert(s)."""

    # "softmax" (Qwen: softmax over all experts, then top-k) or "sigmoid" (Kimi: sigmoid scores, biased choice)
    scoring: str
    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool = True
    # 0 = no shared expert
    shared_intermediate_size: int = 0
    # Qwen: the shared expert output is scaled by sigmoid(shared_expert_gate(x))
    shared_expert_gate: bool = False
    routed_scaling_factor: float = 1.0
    num_groups: int = 1
    topk_groups: int = 1
    # Kimi: e_score_correction_bias added to the scores used for the choice only
    score_correction_bias: bool = False


@dataclass(frozen=True)
class ModelConfig:
    """One hybrid checkpoint: layer pattern, mixer and FFN shapes, norm convention, MTP."""

    # "qwen3_next", "qwen3_5" or "kimi_linear": selects weight names and GDN projection layout
    arch: str
    model_type: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    ffn_types: tuple[str, ...]
    intermediate_size: int
    rms_norm_eps: float
    # Qwen: x̂·(1 + w); Kimi: x̂·w
    zero_centered_norm: bool
    tie_word_embeddings: bool
    attention: AttentionConfig
    linear: LinearAttSpec
    moe: MoEConfig | None = None
    num_mtp_layers: int = 0
    torch_dtype: str = "bfloat16"
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def linear_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]

    @property
    def full_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]


def first_present(raw: dict, *names: str, default=None):
    """The value of the first of `names` present in `raw` (checkpoints spell the same field differently)."""
    for name in names:
        if name in raw and raw[name] is not None:
            return raw[name]
    return default


def eos_ids(raw: dict) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
