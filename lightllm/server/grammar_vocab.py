"""The vocabulary a grammar is matched against: llguidance's tokenizer (every token's bytes, the EOS ids) built
from a checkpoint's tokenizer folder, a Hugging Face `tokenizer.json` or Kimi's `tiktoken.model`; and the start-up
step that builds it before the first constrained request, so that request does not wait for it."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from lightllm.server.tiktoken_tokenizer import TiktokenTokenizer, is_tiktoken_folder
from lightllm.server.tokenizer import checkpoint_tokenizer, eos_token_ids

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
    if not os.path.isfile(os.path.join(tokenizer_dir, "tokenizer.json")):
        raise ValueError(
            f"{tokenizer_dir}: a grammar's vocabulary is read from tokenizer.json or tiktoken.model, and it has neither"
        )
    import llguidance.hf

    return llguidance.hf.from_tokenizer(checkpoint_tokenizer(tokenizer_dir), n_vocab=n_vocab, eos_token=list(eos_ids))


def warm_grammars(engine: Engine, info: ModelInfo, device: str | None = None) -> None:
    """Build the checkpoint's grammar vocabulary, with the EOS ids the front-end sends, and compile one grammar
    over it now (and the masking kernel on a GPU `device`). A checkpoint whose vocabulary cannot be built still
    serves: its constrained requests fail alone with the reason, which is logged here."""
    try:
        eos = eos_token_ids(info, checkpoint_tokenizer(info.model_dir))
        engine.grammars.preload(info.model_dir, list(eos), device)
    except Exception as exc:
        logger.warning("constrained output (response_format, forced tool calls) will fail: %s", exc)
