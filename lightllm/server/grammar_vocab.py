"""The vocabulary a grammar is matched against: llguidance's tokenizer (every token's bytes, the EOS ids) built
from a checkpoint's tokenizer folder, a Hugging Face `tokenizer.json` or Kimi's `tiktoken.model`; and the start-up
step that builds it before the first constrained request, so that request does not wait for it."""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future
from typing import TYPE_CHECKING

from lightllm.server.tiktoken_tokenizer import TiktokenTokenizer, is_tiktoken_folder
from lightllm.server.tokenizer import checkpoint_tokenizer, eos_token_ids

if TYPE_CHECKING:
    from lightllm.engine.engine import Engine
    from lightllm.server.model_info import ModelInfo

logger = logging.getLogger(__name__)


def load_grammar_vocabulary(tokenizer_dir: str, n_vocab: int, eos_ids: tuple[int, ...], hf=None):
    """llguidance.LLTokenizer of the folder's tokenizer (`hf`: already loaded by `checkpoint_tokenizer`), `n_vocab`
    wide (the model's logits may be wider than the tokenizer). Raises ValueError naming the folder when it has no
    tokenizer a grammar can use."""
    if not eos_ids:
        raise ValueError(f"{tokenizer_dir}: a grammar ends with an EOS token, and none is known for this checkpoint")
    if is_tiktoken_folder(tokenizer_dir):
        import llguidance.tiktoken

        encoding = TiktokenTokenizer(tokenizer_dir).encoding
        return llguidance.tiktoken.lltokenizer_from_encoding(encoding, n_vocab=n_vocab, eos_token=list(eos_ids))
    if not os.path.isfile(os.path.join(tokenizer_dir, "tokenizer.json")):
        raise ValueError(
            f"{tokenizer_dir}: a grammar's vocabulary is read from tokenizer.json or tiktoken.model, and it has neither"
        )
    import llguidance.hf

    hf = hf if hf is not None else checkpoint_tokenizer(tokenizer_dir)
    return llguidance.hf.from_tokenizer(hf, n_vocab=n_vocab, eos_token=list(eos_ids))


def build_grammar_vocabulary(info: ModelInfo) -> tuple[tuple[int, ...], object]:
    """The checkpoint's EOS ids and its grammar vocabulary, `info.vocab_size` wide: host work (importing and loading
    the tokenizer, then llguidance's walk of it, seconds on a fresh machine) that the engine process runs beside the
    runner's start-up."""
    hf = checkpoint_tokenizer(info.model_dir)
    eos = eos_token_ids(info, hf)
    return eos, load_grammar_vocabulary(info.model_dir, info.vocab_size, eos, hf)


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
            eos = eos_token_ids(info, checkpoint_tokenizer(info.model_dir))
        engine.grammars.preload(info.model_dir, list(eos), device)
    except Exception as exc:
        logger.warning("constrained output (response_format, forced tool calls) will fail: %s", exc)
