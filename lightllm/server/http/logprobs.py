"""OpenAI `logprobs` objects from engine log-probabilities.

A token's text is its exact bytes decoded, or `bytes:\\xNN...` when they are part of a multi-byte character, and
`bytes` are the token's own bytes (never those of U+FFFD), so every token of a fragmented character is told apart.
"""

from __future__ import annotations

import codecs

from lightllm.server.output import PromptLogprobs
from lightllm.server.tokenizer import Tokenizer

# the least log-probability a response carries (JSON has no -inf)
MIN_LOGPROB = -9999.0
# per token: (logprob, [(alt_id, logprob), ...])
Entries = list[tuple[float, list[tuple[int, float]]]]


class TokenIdNames:
    """The tokenizer as the logprobs objects read it, each token named `token_id:{id}` (vLLM's
    `return_tokens_as_token_ids`: ids survive where a token's text does not identify it); its bytes, and the text
    offsets they give, stay the token's own."""

    def __init__(self, tok: Tokenizer):
        self._tok = tok

    def token_text(self, token_id: int) -> str:
        return f"token_id:{token_id}"

    def token_bytes(self, token_id: int) -> bytes:
        return self._tok.token_bytes(token_id)


def token_names(tok: Tokenizer, as_ids: bool) -> Tokenizer | TokenIdNames:
    return TokenIdNames(tok) if as_ids else tok


def chat_logprobs(tok: Tokenizer, token_ids: list[int], entries: Entries) -> dict | None:
    if not entries:
        return None

    def item(token_id: int, logprob: float) -> dict:
        return {"token": tok.token_text(token_id), "logprob": logprob, "bytes": list(tok.token_bytes(token_id))}

    return {
        "content": [
            {**item(t, lp), "top_logprobs": [item(a, alp) for a, alp in top]}
            for t, (lp, top) in zip(token_ids, entries)
        ]
    }


class TextOffsets:
    """Character offset of each token in the returned text: where the character holding its first byte begins."""

    def __init__(self, start: int = 0):
        self.chars = start
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, tok: Tokenizer, token_ids: list[int]) -> list[int]:
        offsets = []
        for t in token_ids:
            offsets.append(self.chars)
            self.chars += len(self._utf8.decode(tok.token_bytes(t)))
        return offsets


def completion_logprobs(tok: Tokenizer, token_ids: list[int], entries: Entries, offsets: TextOffsets) -> dict | None:
    if not entries:
        return None
    return {
        "tokens": [tok.token_text(t) for t in token_ids],
        "token_logprobs": [lp for lp, _ in entries],
        # keyed by token text: distinct tokens have distinct texts (fragments are spelled as bytes)
        "top_logprobs": [{tok.token_text(a): alp for a, alp in top} for _, top in entries],
        "text_offset": offsets.advance(tok, token_ids),
    }


def echoed_prompt_logprobs(
    tok: Tokenizer, prompt_ids: list[int], prompt_chars: int, entries: PromptLogprobs | None, num_top: int
) -> dict:
    """Entries for an echoed prompt: each token's log-probability given the tokens before it and its `num_top` most
    likely alternatives (keyed like a completion's); null for the first token, which has nothing before it, and for
    every token when the engine sent no scores (`entries` None).

    Offsets follow the prompt's tokens and never pass the echoed text's length (a tokenizer may add a BOS token that
    the echoed text does not hold)."""
    offsets = [min(o, prompt_chars) for o in TextOffsets().advance(tok, prompt_ids)]
    entries = entries or [None] * len(prompt_ids)
    return {
        "tokens": [tok.token_text(t) for t in prompt_ids],
        "token_logprobs": [None if e is None else e[0] for e in entries],
        "top_logprobs": [None if e is None else {tok.token_text(a): alp for a, alp in e[1][:num_top]} for e in entries],
        "text_offset": offsets,
    }


def ranked_prompt_logprobs(
    tok: Tokenizer, prompt_ids: list[int], entries: PromptLogprobs, ranks: list[int | None], num_top: int
) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token null (the first, which has nothing before it) or, keyed by token
    id, `{logprob, rank, decoded_token}` for the token itself and the `num_top` most likely tokens there (ranks
    1..num_top; the token keeps its place first when it is one of them)."""

    def scored(token_id: int, logprob: float, rank: int) -> dict:
        # JSON has no -inf; vLLM's floor
        return {"logprob": max(logprob, MIN_LOGPROB), "rank": rank, "decoded_token": tok.token_text(token_id)}

    out: list[dict | None] = []
    for token, entry, rank in zip(prompt_ids, entries, ranks):
        if entry is None:
            out.append(None)
            continue
        logprob, top = entry
        item = {str(token): scored(token, logprob, rank)}
        item.update((str(alt), scored(alt, alt_logprob, r)) for r, (alt, alt_logprob) in enumerate(top[:num_top], 1))
        out.append(item)
    return out


def join_logprobs(first: dict | None, second: dict | None) -> dict | None:
    if first is None or second is None:
        return first or second
    return {k: first[k] + second[k] for k in first}
