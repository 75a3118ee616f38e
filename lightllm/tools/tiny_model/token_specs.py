"""What each family's tokenizer looks like, for the tiny BPE (`tokenizer.py`) and the released vocabularies
(`real_vocab.py`) alike: split patterns, special tokens in their real order and roles, and the ids they take at the
end of a vocabulary."""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Regex, pre_tokenizers

# Pre-tokenizer split patterns of Qwen2/3/Next and of Qwen3.5 (which adds combining marks \p{M} to words).
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN3_5_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# (content, special) in the real relative order; tokens marked False are plain added tokens in the real files.
_QWEN3_SPECIALS = (
    [(t, True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>")]
    + [(t, True) for t in ("<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>")]
    + [(t, True) for t in ("<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")]
    + [("<tool_call>", False), ("</tool_call>", False)]
    + [(t, False) for t in ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>")]
    + [("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False)]
    + [("<think>", False), ("</think>", False)]
)
_QWEN3_5_SPECIALS = _QWEN3_SPECIALS + [
    (t, True)
    for t in ("<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>")
    + ("<tts_text_bos_single>", "<|audio_pad|>")
]
_KIMI_SPECIALS = [
    (t, True)
    for t in ("[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>")
] + [
    (t, False)
    for t in ("<think>", "</think>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
    + ("<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")
]


@dataclass(frozen=True)
class TokenizerSpec:
    """What a family's tokenizer looks like: specials, named roles, split pattern and file layout."""

    specials: list[tuple[str, bool]]
    bos_token: str | None
    eos_token: str
    pad_token: str
    pattern: str
    template_in_own_file: bool
    tokenizer_class: str
    trailing_pad: str | None = None


SPECS = {
    "qwen3_next": TokenizerSpec(
        _QWEN3_SPECIALS, None, "<|im_end|>", "<|endoftext|>", QWEN_PATTERN, False, "Qwen2Tokenizer"
    ),
    "qwen3_5": TokenizerSpec(
        _QWEN3_5_SPECIALS, None, "<|im_end|>", "<|endoftext|>", QWEN3_5_PATTERN, True, "Qwen2Tokenizer"
    ),
    "kimi_linear": TokenizerSpec(
        _KIMI_SPECIALS, "[BOS]", "<|im_end|>", "[PAD]", QWEN_PATTERN, True, "PreTrainedTokenizerFast", "[PAD]"
    ),
}
SPECS["qwen3_5_moe"] = SPECS["qwen3_5"]


def special_token_ids(arch: str, vocab_size: int) -> dict[str, int]:
    """Id of every special (and family added) token for a tokenizer of `vocab_size` entries."""
    spec = SPECS[arch]
    names = [t for t, _ in spec.specials] + ([spec.trailing_pad] if spec.trailing_pad else [])
    first = vocab_size - len(names)
    ids = {name: first + i for i, name in enumerate(names)}
    if spec.trailing_pad:
        ids[spec.trailing_pad] = vocab_size - 1
    return ids


def pre_tokenizer(pattern: str):
    """The family's split pattern, then byte-level mapping (the released tokenizers' pre-tokenizer)."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
