"""The vocabulary a grammar is matched against: llguidance's tokenizer (every token's bytes, the EOS ids) built
from a checkpoint's tokenizer folder, a Hugging Face `tokenizer.json` or Kimi's `tiktoken.model`; and the start-up
step that builds it before the first constrained request, so that request does not wait for it."""

from __future__ import annotations

import json
import logging
import os
from concurrent.futures import Future
from typing import TYPE_CHECKING

from lightllm.server.tiktoken_tokenizer import TiktokenTokenizer, is_tiktoken_folder
from lightllm.server.tokenizer import eos_token_ids

if TYPE_CHECKING:
    from lightllm.engine.engine import Engine
    from lightllm.server.model_info import ModelInfo

logger = logging.getLogger(__name__)


def load_grammar_vocabulary(tokenizer_dir: str, n_vocab: int, eos_ids: tuple[int, ...]):
    """llguidance.LLTokenizer of the folder's tokenizer, `n_vocab` wide (the model's logits may be wider than the
    tokenizer). Raises ValueError naming the folder when it has no tokenizer a grammar can use."""
    if not eos_ids:
        raise ValueError(f"{tokenizer_dir}: a grammar ends with an EOS token, and none is known for this checkpoint")
    if is_tiktoken_folder(tokenizer_dir):
        import llguidance.tiktoken

        encoding = TiktokenTokenizer(tokenizer_dir).encoding
        return llguidance.tiktoken.lltokenizer_from_encoding(encoding, n_vocab=n_vocab, eos_token=list(eos_ids))
    from llguidance import LLTokenizer

    backend = _hf_backend(tokenizer_dir)
    backend.no_padding()
    backend.no_truncation()
    return LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=list(eos_ids))


def _hf_backend(tokenizer_dir: str):
    """The folder's `tokenizer.json` as transformers' fast tokenizer holds it (the added tokens that only
    `tokenizer_config.json` lists are added, at the ids it gives them), read with the tokenizers library alone: the
    engine process never imports transformers (seconds of Python beside its start-up). ValueError when the folder
    has no tokenizer.json, or its added tokens cannot take their ids."""
    path = os.path.join(tokenizer_dir, "tokenizer.json")
    if not os.path.isfile(path):
        raise ValueError(
            f"{tokenizer_dir}: a grammar's vocabulary is read from tokenizer.json or tiktoken.model, and it has neither"
        )
    from tokenizers import AddedToken, Tokenizer

    backend = Tokenizer.from_file(path)
    added = _json_file(tokenizer_dir, "tokenizer_config.json").get("added_tokens_decoder") or {}
    for token_id, spec in sorted(added.items(), key=lambda item: int(item[0])):
        if backend.token_to_id(spec["content"]) is not None:
            continue
        flags = {k: spec[k] for k in ("single_word", "lstrip", "rstrip", "normalized") if k in spec}
        token = AddedToken(spec["content"], special=bool(spec.get("special")), **flags)
        (backend.add_special_tokens if spec.get("special") else backend.add_tokens)([token])
        if backend.token_to_id(spec["content"]) != int(token_id):
            raise ValueError(
                f"{tokenizer_dir}: added token {spec['content']!r} is id {token_id} in tokenizer_config.json but "
                f"{backend.token_to_id(spec['content'])} once added to tokenizer.json"
            )
    return backend


def _json_file(folder: str, name: str) -> dict:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def tokenizer_eos_id(tokenizer_dir: str) -> int | None:
    """The tokenizer's own EOS id (`eos_token` of tokenizer_config.json, else of special_tokens_map.json, looked up
    in its vocabulary), as transformers' `eos_token_id` gives it, without transformers."""
    if is_tiktoken_folder(tokenizer_dir):
        return TiktokenTokenizer(tokenizer_dir).eos_token_id
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        token = _json_file(tokenizer_dir, name).get("eos_token")
        if isinstance(token, dict):
            token = token.get("content")
        if token:
            return _hf_backend(tokenizer_dir).token_to_id(token)
    return None


def build_grammar_vocabulary(info: ModelInfo) -> tuple[tuple[int, ...], object]:
    """The checkpoint's EOS ids and its grammar vocabulary, `info.vocab_size` wide: host work (reading the
    tokenizer, then llguidance's walk of it, a second or more for a large vocabulary) that the engine process runs
    beside the runner's start-up."""
    eos = eos_token_ids(info, tokenizer_eos_id(info.model_dir))
    return eos, load_grammar_vocabulary(info.model_dir, info.vocab_size, eos)


def warm_grammars(engine: Engine, info: ModelInfo, device: str | None = None, vocabulary: Future | None = None) -> None:
    """Build the checkpoint's grammar vocabulary, with the EOS ids the front-end sends, and compile one grammar
    over it now (and the masking kernel on a GPU `device`). `vocabulary`: `build_grammar_vocabulary`'s result,
    computed meanwhile (one that failed is built again here, where the backend records why). A checkpoint whose
    vocabulary cannot be built still serves: its constrained requests fail alone with the reason, which is logged
    here."""
    try:
        built = None
        if vocabulary is not None and vocabulary.exception() is None:
            built = vocabulary.result()
        if built is not None and engine.grammars.vocab_size == info.vocab_size:
            eos = built[0]
            engine.grammars.add_vocabulary(info.model_dir, eos, built[1])
        else:
            eos = eos_token_ids(info, tokenizer_eos_id(info.model_dir))
        engine.grammars.preload(info.model_dir, list(eos), device)
    except Exception as exc:
        logger.warning("constrained output (response_format, forced tool calls) will fail: %s", exc)
