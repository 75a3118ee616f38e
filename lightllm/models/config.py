"""The model-independent description of one hybrid checkpoint, filled by the per-architecture config mappers.

Everything below `models/` reads only this dataclass, never the raw `config.json`: the mappers in
`qwen3_next/`, `qwen3_5/` and `kimi_linear/` translate each checkpoint's spelling once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lightllm.linear_att import LinearAttSpec

LINEAR = "linear_attention"
FULL = "full_attention"
DENSE = "dense"
MOE = "moe"


# rope types whose frequencies do not depend on the sequence (those that do, like "dynamic", would change the
# rotation of cached keys as a request grows)
ROPE_TYPES = ("default", "linear", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """A context-extension rescaling of the rotary frequencies (`rope_scaling` / `rope_parameters` of a config).

    linear: every frequency divided by `factor`. yarn: frequencies of dims that turn fewer than `beta_slow` times
    over `original_max_position_embeddings` are divided by `factor`, those turning more than `beta_fast` times are
    kept, a linear ramp between; cos and sin are multiplied by `attention_factor`.
    """

    rope_type: str
    factor: float
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    # yarn: round the ramp's ends to whole dims
    truncate: bool = True


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
    rope_scaling: RopeScaling | None = None
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


# where a config may spell its rope fields: the transformers 5 dict, the older dict (and Qwen's docs for adding
# YaRN), and flat keys beside them
ROPE_DICTS = ("rope_parameters", "rope_scaling")
FLAT_ROPE_KEYS = ("rope_theta", "partial_rotary_factor")


def rope_parameters(raw: dict) -> dict:
    """The config's rope fields merged from `rope_parameters`, `rope_scaling` and the flat `rope_theta` /
    `partial_rotary_factor`, so that a scaling added in one spelling keeps the theta and rotated share written in
    another. A field the spellings give different values is refused by name, as are two different scaling types."""
    spellings = [(f"{name}.", _rope_fields(raw[name])) for name in ROPE_DICTS if isinstance(raw.get(name), dict)]
    spellings.append(("", {k: raw[k] for k in FLAT_ROPE_KEYS if raw.get(k) is not None}))
    merged: dict = {}
    where: dict[str, str] = {}
    for prefix, fields in spellings:
        for key, value in fields.items():
            if key in merged and not _same_rope_value(key, merged[key], value):
                raise ValueError(
                    f"rope settings disagree: {where[key]} is {merged[key]!r}, {prefix}{key} is {value!r}; "
                    "keep one of them"
                )
            if key not in merged or (key == "rope_type" and merged[key] == "default"):
                merged[key], where[key] = value, prefix + key
    return merged


def _rope_fields(rope: dict) -> dict:
    """A rope dict's set fields, its type under `rope_type` whichever key spells it."""
    fields = {k: v for k, v in rope.items() if v is not None and k not in ("type", "rope_type")}
    fields["rope_type"] = _rope_type(rope)
    return fields


def _same_rope_value(key: str, a, b) -> bool:
    if key == "rope_type":
        # a plain dict beside a scaled one only carries the other fields
        return a == b or "default" in (a, b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b


def _rope_type(rope: dict) -> str:
    return rope.get("rope_type") or rope.get("type") or "default"


def rope_scaling(raw: dict) -> RopeScaling | None:
    """The scaling a config's rope dict asks for; ValueError naming a type the engine does not implement."""
    rope = rope_parameters(raw)
    kind = _rope_type(rope)
    if kind not in ROPE_TYPES:
        raise ValueError(
            f"rope_scaling type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)}); serving it with "
            "plain RoPE would give wrong positions"
        )
    if kind == "default":
        return None
    factor = rope.get("factor")
    if kind == "linear":
        if not isinstance(factor, (int, float)) or factor <= 0:
            raise ValueError(f"rope_scaling linear: expected a positive factor, found {factor!r}")
        return RopeScaling("linear", float(factor))
    original = first_present(
        rope,
        "original_max_position_embeddings",
        default=first_present(raw, "original_max_position_embeddings", "max_position_embeddings"),
    )
    if not isinstance(original, int) or original <= 0:
        raise ValueError(f"rope_scaling yarn: expected original_max_position_embeddings, found {original!r}")
    # transformers requires it too: guessing it from the context lengths gives 1 (no scaling) when they are equal
    if factor is None:
        raise ValueError("rope_scaling yarn: expected a factor (the context extension), found none")
    if not isinstance(factor, (int, float)) or factor <= 0:
        raise ValueError(f"rope_scaling yarn: expected a positive factor, found {factor!r}")
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    return RopeScaling(
        "yarn",
        float(factor),
        original,
        beta_fast=float(rope.get("beta_fast") or 32.0),
        beta_slow=float(rope.get("beta_slow") or 1.0),
        attention_factor=float(attention_factor),
        truncate=bool(rope.get("truncate", True)),
    )


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context `factor` times the original."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def scaled_max_positions(max_positions: int | None, scaling: RopeScaling | None) -> int | None:
    """The context a scaled rope reaches: YaRN's factor times its original context, linear's factor times the
    config's (`max_position_embeddings` is often left at the original length when scaling is added)."""
    if scaling is None or max_positions is None:
        return max_positions
    if scaling.rope_type == "yarn":
        return max(max_positions, int(scaling.original_max_position_embeddings * scaling.factor))
    return int(max_positions * scaling.factor)
