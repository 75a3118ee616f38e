"""Offline byte-level BPE tokenizer for tiny checkpoints, with each family's special tokens at the real positions.

The real vocabularies put the BPE ranks first and the special tokens after them, so here the BPE part fills
ids [0, vocab_size - num_specials) and the special tokens the tail (Kimi's `[PAD]` is the very last id, as in the real
163840-entry vocabulary). Model vocab size == tokenizer size, so every id the model can emit decodes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from .chat_templates import TEMPLATES
from .corpus import training_corpus

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


def _pre_tokenizer(pattern: str):
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _train_bpe(arch: str, num_bpe_tokens: int) -> Tokenizer:
    spec = SPECS[arch]
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer(spec.pattern)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=num_bpe_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(), trainer)
    return tok


def build_tokenizer(arch: str, vocab_size: int) -> Tokenizer:
    """Train the byte-level BPE and append the family's special tokens so that ids match `special_token_ids`."""
    spec = SPECS[arch]
    ids = special_token_ids(arch, vocab_size)
    num_bpe = min(ids.values())
    tok = _train_bpe(arch, num_bpe)
    # A small corpus may run out of merges before the target size; reserved tokens keep the special ids fixed.
    fill = [
        AddedToken(f"<|reserved_{i}|>", special=True, normalized=False) for i in range(num_bpe - tok.get_vocab_size())
    ]
    if fill:
        tok.add_tokens(fill)
    added = [AddedToken(t, special=s, normalized=False) for t, s in spec.specials]
    if spec.trailing_pad:
        added.append(AddedToken(spec.trailing_pad, special=True, normalized=False))
    tok.add_tokens(added)
    for name, token_id in ids.items():
        assert tok.token_to_id(name) == token_id, (name, tok.token_to_id(name), token_id)
    assert tok.get_vocab_size() == vocab_size
    return tok


def _tokenizer_config(arch: str, ids: dict[str, int], model_max_length: int) -> dict:
    spec = SPECS[arch]
    flags = dict(spec.specials)
    decoder = {}
    for content, token_id in sorted(ids.items(), key=lambda item: item[1]):
        decoder[str(token_id)] = {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": flags.get(content, True),
        }
    cfg = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "bos_token": spec.bos_token,
        "clean_up_tokenization_spaces": False,
        "eos_token": spec.eos_token,
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": spec.pad_token,
        "split_special_tokens": False,
        "tokenizer_class": spec.tokenizer_class,
        "unk_token": None,
    }
    if not spec.template_in_own_file:
        cfg["chat_template"] = TEMPLATES[arch]
    return cfg


def write_tokenizer(
    arch: str, vocab_size: int, model_max_length: int, out_dir: Path, real_vocab: bool = False
) -> dict[str, int]:
    """Write tokenizer.json, tokenizer_config.json (and chat_template.jinja where the real checkpoint has one).

    With `real_vocab` the released Qwen vocabulary is used instead of the tiny BPE (see `real_vocab.py`).
    Returns the special token ids (token -> id).
    """
    if real_vocab:
        from .real_vocab import build_real_tokenizer

        tok, ids = build_real_tokenizer(arch)
    else:
        tok, ids = build_tokenizer(arch, vocab_size), special_token_ids(arch, vocab_size)
    (out_dir / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    cfg = _tokenizer_config(arch, ids, model_max_length)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", "utf-8")
    if SPECS[arch].template_in_own_file:
        (out_dir / "chat_template.jinja").write_text(TEMPLATES[arch], encoding="utf-8")
    return ids
