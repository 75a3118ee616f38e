"""vLLM's `bad_words` as the engine applies them: token sequences. A word can appear in the output on its own or
after a space, and most tokenizers spell the two differently (`"word"` against `" word"`), so each word gives both
spellings (once when they are the same)."""

from __future__ import annotations

import msgspec

from lightllm.engine.sampling_params import MAX_BAD_WORD_TOKENS, SamplingParams, SamplingParamsError


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each word's token sequences (without the tokenizer's added markers), in order, without repeats.
    SamplingParamsError naming bad_words for a word longer than `MAX_BAD_WORD_TOKENS` tokens."""
    sequences: list[list[int]] = []
    for i, word in enumerate(words):
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode_rendered(text)
            if len(ids) > MAX_BAD_WORD_TOKENS:
                raise SamplingParamsError(
                    "bad_words", f"bad_words[{i}] is {len(ids)} tokens long; at most {MAX_BAD_WORD_TOKENS}"
                )
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences


def with_bad_words(params: SamplingParams, tokenizer) -> SamplingParams:
    """`params` with their bad words' sequences added to `bad_words_token_ids` (which the engine reads)."""
    if not params.bad_words:
        return params
    have = params.bad_words_token_ids
    added = [seq for seq in bad_words_token_ids(tokenizer, params.bad_words) if seq not in have]
    # checked again on replace: the sequences' count and ids
    return msgspec.structs.replace(params, bad_words_token_ids=have + added)
