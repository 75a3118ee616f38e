"""Offline byte-level BPE tokenizer for tiny checkpoints, with each family's special tokens at the real positions.

The real vocabularies put the BPE ranks first and the special tokens after them, so here the BPE part fills
ids [0, vocab_size - num_specials) and the special tokens the tail (Kimi's `[PAD]` is the very last id, as in the real
163840-entry vocabulary). Model vocab size == tokenizer size, so every id the model can emit decodes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from .chat_templates import TEMPLATES
from .corpus import training_corpus
from .real_vocab import build_real_tokenizer
from .token_specs import SPECS, pre_tokenizer, special_token_ids


def _train_bpe(arch: str, num_bpe_tokens: int, corpus: Iterable[str] | None) -> Tokenizer:
    spec = SPECS[arch]
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizer(spec.pattern)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=num_bpe_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus() if corpus is None else corpus, trainer)
    return tok


def build_tokenizer(arch: str, vocab_size: int, corpus: Iterable[str] | None = None) -> Tokenizer:
    """Train the byte-level BPE (on `corpus`, default the built-in text) and append the family's special tokens so
    that ids match `special_token_ids`."""
    spec = SPECS[arch]
    ids = special_token_ids(arch, vocab_size)
    num_bpe = min(ids.values())
    tok = _train_bpe(arch, num_bpe, corpus)
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
    arch: str,
    vocab_size: int,
    model_max_length: int,
    out_dir: Path,
    real_vocab: bool = False,
    corpus: Iterable[str] | None = None,
) -> dict[str, int]:
    """Write tokenizer.json, tokenizer_config.json (and chat_template.jinja where the real checkpoint has one).

    With `real_vocab` the released Qwen vocabulary is used instead of the tiny BPE (see `real_vocab.py`); `corpus`
    replaces the built-in training text of the BPE.
    Returns the special token ids (token -> id).
    """
    if real_vocab:
        tok, ids = build_real_tokenizer(arch)
    else:
        tok, ids = build_tokenizer(arch, vocab_size, corpus), special_token_ids(arch, vocab_size)
    (out_dir / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    cfg = _tokenizer_config(arch, ids, model_max_length)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", "utf-8")
    if SPECS[arch].template_in_own_file:
        (out_dir / "chat_template.jinja").write_text(TEMPLATES[arch], encoding="utf-8")
    return ids
