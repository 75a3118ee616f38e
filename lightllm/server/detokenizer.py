"""Incremental detokenization that never emits half a UTF-8 character, and stop-string matching on the stream.

Decoding a growing id list token by token breaks multi-byte characters (a CJK character or an emoji is often
several byte-level tokens). `IncrementalDetokenizer` decodes a short window of recent ids and only releases text
once the window no longer ends in an incomplete sequence (U+FFFD). `StopMatcher` holds back the tail that could
still grow into a stop string, so streamed text never contains a stop string or a prefix of one that then matches.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT = "\ufffd"
# text waits while the window ends mid-character; past this many pending tokens the model is emitting invalid
# bytes, and they are released as replacement characters rather than held until the end
MAX_PENDING_TOKENS = 32


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        # ids[prefix_start:read_start] is already emitted context; ids[read_start:] is pending
        self.prefix_start = 0
        self.read_start = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; returns the newly completed text (possibly empty)."""
        self.ids += token_ids
        return self._release(force=False)

    def flush(self) -> str:
        """Release whatever is pending, with replacement characters for bytes that never completed."""
        return self._release(force=True)

    def _release(self, force: bool) -> str:
        if self.read_start == len(self.ids):
            return ""
        prefix = self._decode(self.ids[self.prefix_start : self.read_start])
        full = self._decode(self.ids[self.prefix_start :])
        pending = len(self.ids) - self.read_start
        if full.endswith(REPLACEMENT) and not force and pending < MAX_PENDING_TOKENS:
            return ""
        # the context window is re-decoded so tokenizers that change a token's leading space by position agree
        delta = full[len(prefix) :]
        self.prefix_start, self.read_start = self.read_start, len(self.ids)
        return delta


class StopMatcher:
    """Finds the first stop string in the text stream; `feed` returns only text that is safe to emit."""

    def __init__(self, stops: list[str], include_stop: bool = False):
        self.stops = [s for s in stops if s]
        # the matched stop string ends the emitted text (else the text ends before it)
        self.include_stop = include_stop
        self.pending = ""
        # the pending text's first `early` characters came with match=False: no stop string may end inside them
        # (one held back there as the start of a longer stop string would otherwise match once matching is on)
        self.early = 0
        self.matched: str | None = None

    def feed(self, text: str, match: bool = True) -> str:
        """`match=False`: no stop string may end in this text (min_tokens); its tail that could begin one is still
        held back, so a stop string it begins and later text completes matches."""
        if self.matched is not None:
            return ""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out
        if not match:
            self.early = len(self.pending)
        hits = [(self.pending.find(s, max(0, self.early - len(s) + 1)), s) for s in self.stops] if match else []
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            index, self.matched = min(hits)
            end = index + len(self.matched) if self.include_stop else index
            out, self.pending = self.pending[:end], ""
            return out
        cut = len(self.pending) - self._partial_len()
        out, self.pending = self.pending[:cut], self.pending[cut:]
        self.early = max(0, self.early - cut)
        return out

    def _partial_len(self) -> int:
        """Length of the longest tail of the pending text that is the start of some stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.pending)), longest, -1):
                if self.pending.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def flush(self) -> str:
        out, self.pending = ("" if self.matched else self.pending), ""
        return out
