"""lightllm.tools.synthetic_vocab: the generated tokenizer folder reads back as a tiktoken checkpoint tokenizer with
the asked size, bytes first and special tokens after, the model's files linked, and grammars compile over it."""

from __future__ import annotations

import json

import pytest

from lightllm.server.grammar_vocab import load_grammar_vocabulary
from lightllm.server.tiktoken_tokenizer import NUM_RESERVED_SPECIAL, TiktokenTokenizer
from lightllm.tools.synthetic_vocab import synthetic_ranks, synthetic_vocab_dir


def test_ranks_are_bytes_then_distinct_pieces():
    ranks = synthetic_ranks(3000, seed=4)
    assert len(ranks) == 3000 and sorted(ranks.values()) == list(range(3000))
    assert all(ranks[bytes([b])] == b for b in range(256))
    pieces = [t for t, r in ranks.items() if r >= 256]
    # word pieces with a leading space, digits and multi-byte characters are all there
    assert any(p.startswith(b" ") for p in pieces) and any(p.isdigit() for p in pieces)
    assert any(len(p.decode()) < len(p) for p in pieces)
    assert synthetic_ranks(3000, seed=4) == ranks and synthetic_ranks(3000, seed=5) != ranks


def test_folder_reads_back_and_compiles_grammars(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 2048}))
    (model / "tokenizer.json").write_text("{}")
    out = synthetic_vocab_dir(str(model), 1500, 2048, str(tmp_path / "out"))
    assert (out / "config.json").is_symlink() and not (out / "tokenizer.json").exists()
    tok = TiktokenTokenizer(str(out))
    assert len(tok) == 1500 + NUM_RESERVED_SPECIAL and tok.eos_token_id == 1501
    assert tok.decode(tok.encode("hello 123 世界")) == "hello 123 世界"
    from llguidance import LLMatcher

    vocabulary = load_grammar_vocabulary(str(out), 2048, (tok.eos_token_id,))
    matcher = LLMatcher(vocabulary, LLMatcher.grammar_from_json_schema({"type": "integer"}), log_level=0)
    assert not matcher.is_error() and matcher.consume_tokens(tok.encode("42"))
    with pytest.raises(ValueError, match="exceed"):
        synthetic_vocab_dir(str(model), 1900, 2048, str(tmp_path / "too_big"))
