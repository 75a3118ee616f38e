"""Size knobs of tiny checkpoints and the architectures they can mimic."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "kimi_linear")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class TinySizes:
    """Every dimension a tiny checkpoint shrinks; fields that an architecture does not use are ignored.

    GDN (Qwen) uses `linear_num_key_heads` key heads and `linear_num_value_heads` value heads (grouped value heads,
    HV/H > 1 by default); KDA (Kimi) uses `linear_num_value_heads` heads of `linear_key_head_dim` for q, k and v.
    """

    hidden_size: int = 64
    num_layers: int = 4
    vocab_size: int = 512
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    conv_kernel_size: int = 4
    intermediate_size: int = 128
    moe_intermediate_size: int = 32
    shared_expert_intermediate_size: int = 32
    num_experts: int = 8
    num_experts_per_tok: int = 2
    full_attention_interval: int = 4
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    first_k_dense_replace: int = 1
    num_mtp_layers: int = 1

    def __post_init__(self) -> None:
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError("num_experts_per_tok must not exceed num_experts")
        if self.num_layers < 1 or self.vocab_size < 320:
            raise ValueError("need num_layers >= 1 and vocab_size >= 320 (256 bytes + special tokens)")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


def qwen_layer_types(num_layers: int, interval: int) -> list[str]:
    """Qwen3-Next / Qwen3.5 pattern: every `interval`-th layer (1-based) is full attention, the rest GDN."""
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]


def kimi_full_attn_layers(num_layers: int, interval: int) -> list[int]:
    """Kimi-Linear pattern (1-based ids): every `interval`-th layer and the last layer are MLA, the rest KDA."""
    full = [i for i in range(1, num_layers + 1) if i % interval == 0]
    if num_layers not in full:
        full.append(num_layers)
    return full
