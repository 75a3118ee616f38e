"""Request fields the engine reads as token ids, filled by the front-end (HTTP, `LLM`) from the tokenizer.

vLLM's `bad_words` become token sequences. A word can appear in the output on its own or after a space, and most
tokenizers spell the two differently (`"word"` against `" word"`), so each word gives both spellings (once when they
are the same). A `thinking_token_budget` needs the reasoning block's open and end tokens (`<think>`, `</think>`)."""

from __future__ import annotations

import msgspec

from lightllm.engine.sampling_params import MAX_BAD_WORD_TOKENS, SamplingParams, SamplingParamsError
from lightllm.server.http.structured import THINK_CLOSE, THINK_OPEN, single_token


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


def with_token_fields(params: SamplingParams, tokenizer) -> SamplingParams:
    """`params` with their bad words' sequences added to `bad_words_token_ids`, and with a thinking budget's
    reasoning tokens, as the engine reads them. SamplingParamsError naming the field when they cannot be had."""
    changes: dict = {}
    if params.bad_words:
        have = params.bad_words_token_ids
        added = [seq for seq in bad_words_token_ids(tokenizer, params.bad_words) if seq not in have]
        changes["bad_words_token_ids"] = have + added
    if params.thinking_token_budget is not None and params.think_end_token is None:
        end = single_token(tokenizer, THINK_CLOSE)
        if end is None:
            raise SamplingParamsError(
                "thinking_token_budget", f"thinking_token_budget: this model writes no one-token {THINK_CLOSE}"
            )
        changes |= {"think_end_token": end, "think_open_token": single_token(tokenizer, THINK_OPEN)}
    # checked again on replace: the sequences' count and ids
    return msgspec.structs.replace(params, **changes) if changes else params
