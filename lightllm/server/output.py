"""Front-end side of one generated sequence: engine tokens in, text deltas out (detokenizer + stop strings)."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from lightllm.engine.messages import Finished, TokenChunk
from lightllm.engine.sampling_params import SamplingParams
from lightllm.server.detokenizer import IncrementalDetokenizer, StopMatcher


def prompt_problem(
    ids: list[int], params: SamplingParams, vocab_size: int, max_req_total_len: int
) -> tuple[str, str] | None:
    """(reason, field) when a prompt cannot be served with these params, else None."""
    if not ids:
        return "the prompt is empty", "prompt"
    if min(ids) < 0 or max(ids) >= vocab_size:
        return f"token ids must be in [0, {vocab_size})", "prompt"
    if len(ids) >= max_req_total_len:
        return f"the prompt has {len(ids)} tokens; max_req_total_len is {max_req_total_len}", "prompt"
    for name in ("max_tokens", "min_tokens"):
        # min_tokens too: an output cut by the context's end could not honour it
        value = getattr(params, name)
        if value is not None and len(ids) + value > max_req_total_len:
            return (
                f"prompt ({len(ids)} tokens) + {name} ({value}) exceeds max_req_total_len ({max_req_total_len})",
                name,
            )
    return params.vocab_problem(vocab_size)


def default_length(
    ids: list[int], params: SamplingParams, default: int | None, max_req_total_len: int
) -> SamplingParams:
    """`params` with the model's answer length (`--generation_config`'s max_new_tokens) where they set no
    max_tokens: clipped to the room the prompt leaves (a default never makes a prompt too long), and never below the
    request's own min_tokens."""
    if params.max_tokens is not None or default is None:
        return params
    room = max_req_total_len - len(ids)
    return msgspec.structs.replace(params, max_tokens=max(min(default, room), params.min_tokens, 1))


def truncated(
    ids: list[int], keep: int | None, max_tokens: int | None, max_req_total_len: int, side: str = "left"
) -> list[int]:
    """The prompt's last `keep` tokens, or its first with `side` "right" (vLLM's truncate_prompt_tokens and
    truncation_side; -1: as many as leave room for `max_tokens`, the request's or the model's default, which the
    caller checked is set); the prompt as it is without `keep`."""
    if keep is None:
        return ids
    if keep == -1:
        keep = max(1, max_req_total_len - max_tokens)
    return ids[:keep] if side == "right" else ids[-keep:]


# per prompt token: (logprob, [(alt_id, logprob), ...]) given the tokens before it; None for the first token
PromptLogprobs = list[tuple[float, list[tuple[int, float]]] | None]


@dataclass
class Delta:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    # per token id: (logprob, [(alt_id, logprob), ...]) when logprobs were requested
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    finish_reason: str | None = None


class SequenceOutput:
    """Accumulates one sequence. `stop_string_hit` tells the caller to abort the engine request."""

    def __init__(self, tokenizer, params: SamplingParams, eos_token_ids: tuple[int, ...]):
        self.params = params
        # ids that end the sequence are reported in token_ids but not rendered as text, unless the client asked for
        # what stopped the output in its text (vLLM renders the stop token then, as it keeps a stop string)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.hidden_ids = set() if params.include_stop_str_in_output else stop_ids
        self.detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.stops = StopMatcher(params.stop, params.include_stop_str_in_output)
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[tuple[float, list[tuple[int, float]]]] = []
        # set by the first chunk when params.prompt_logprobs was asked for
        self.prompt_logprobs: PromptLogprobs | None = None
        # and each prompt token's rank among the vocabulary given the tokens before it (None for the first)
        self.prompt_ranks: list[int | None] | None = None
        self.finish_reason: str | None = None
        self.num_prompt_tokens = 0
        # prompt tokens the engine resumed from its prefix cache (from the first chunk)
        self.num_cached_tokens = 0
        self.error: str | None = None
        self.error_status: int | None = None

    @property
    def stop_string_hit(self) -> bool:
        return self.stops.matched is not None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def on_tokens(self, chunk: TokenChunk) -> Delta:
        if chunk.num_cached_tokens is not None:
            self.num_cached_tokens = chunk.num_cached_tokens
        if chunk.prompt_logprobs is not None:
            tops = chunk.prompt_top_logprobs or [None] * len(chunk.prompt_logprobs)
            self.prompt_logprobs = [
                None if lp is None else (lp, top or []) for lp, top in zip(chunk.prompt_logprobs, tops)
            ]
            self.prompt_ranks = chunk.prompt_ranks or [None] * len(chunk.prompt_logprobs)
        if self.finished:
            return Delta()
        delta = Delta()
        for i, token in enumerate(chunk.token_ids):
            delta.token_ids.append(token)
            if chunk.logprobs is not None:
                delta.logprobs.append((chunk.logprobs[i], chunk.top_logprobs[i] if chunk.top_logprobs else []))
            if token not in self.hidden_ids:
                # like a stop token (banned at the first min_tokens positions), a stop string ends the output only
                # when a token after the min_tokens-th completes it (vLLM's rule)
                early = len(self.token_ids) + len(delta.token_ids) <= self.params.min_tokens
                delta.text += self.stops.feed(self.detok.push([token]), match=not early)
            if self.stop_string_hit:
                delta.finish_reason = "stop"
                break
        return self._apply(delta)

    def on_finished(self, msg: Finished) -> Delta:
        if self.finished:
            return Delta()
        self.num_prompt_tokens = msg.num_prompt_tokens
        self.error = msg.error
        self.error_status = msg.error_status
        delta = Delta(finish_reason=msg.reason)
        if msg.reason != "error":
            delta.text = self.stops.feed(self.detok.flush())
            delta.text += self.stops.flush()
        if self.stop_string_hit:
            delta.finish_reason = "stop"
        return self._apply(delta)

    def _apply(self, delta: Delta) -> Delta:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        self.finish_reason = delta.finish_reason
        return delta
