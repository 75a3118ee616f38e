"""Typed messages between a front-end (HTTP process or offline `LLM`) and the engine.

Front-end → engine: `NewRequest`, `Abort`. Engine → front-end: `TokenChunk`, `Finished` (per request) and
`EngineStats` (periodic). All are msgspec structs so they cross zmq as msgpack without pickle.
"""

from __future__ import annotations

import msgspec

from lightllm.engine.sampling_params import SamplingParams

# a request's priority, as an int32
MIN_PRIORITY, MAX_PRIORITY = -(2**31), 2**31 - 1


class NewRequest(msgspec.Struct, tag=True):
    req_id: str
    prompt_ids: list[int]
    params: SamplingParams
    # token ids that end the request unless params.ignore_eos (the model's end-of-sequence ids)
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    # prompt positions where a prefix-cache checkpoint is worth taking (a chat's earlier messages end there:
    # the next turn shares them, while the opened assistant turn after them is rendered differently)
    checkpoint_hints: list[int] = msgspec.field(default_factory=list)
    # with params.grammar: the tokenizer folder whose vocabulary the grammar is matched against
    tokenizer_dir: str = ""
    # the HTTP front-end process that submitted it (`--http_workers`): its outputs go back to that process only
    frontend: int = 0
    # lower runs first (`--scheduling_policy priority`; the front-ends refuse non-zero values otherwise)
    priority: int = 0
    # vLLM's cache_salt: only requests with the same salt share cached prefixes (`lightllm.cache.prefix.namespace`)
    cache_salt: str | None = None


class Abort(msgspec.Struct, tag=True):
    req_id: str


class TokenChunk(msgspec.Struct, tag=True):
    """Tokens a request produced in one engine step (one, or several when drafts were accepted)."""

    req_id: str
    token_ids: list[int]
    # per token: log-probability of the chosen token (only when params.logprobs is not None)
    logprobs: list[float] | None = None
    # per token: [(token_id, logprob), ...] most likely alternatives, most likely first
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # on a request's first chunk only, with params.prompt_logprobs: per prompt token its log-probability given the
    # tokens before it, and the most likely alternatives there (both None for the first prompt token)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    # and each prompt token's rank among the vocabulary there (1: the most likely)
    prompt_ranks: list[int | None] | None = None
    # on a request's first chunk only: prompt tokens resumed from the prefix cache (not recomputed)
    num_cached_tokens: int | None = None


class Finished(msgspec.Struct, tag=True):
    req_id: str
    # "stop" (stop/eos token), "length" (max_tokens or max_req_total_len), "abort", "error"
    reason: str
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    # the stop or eos token that ended the request (it is the last of the output ids, not rendered as text)
    stop_token_id: int | None = None
    error: str | None = None
    # the HTTP status a failed request is answered with when not 500 (503: no capacity now, retry later)
    error_status: int | None = None


class EngineStats(msgspec.Struct, tag=True):
    """A snapshot of the engine for health checks and /metrics."""

    num_waiting: int = 0
    num_running: int = 0
    num_free_kv_tokens: int = 0
    num_free_state_slots: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    # speculative decoding: windows verified, draft tokens proposed and accepted
    num_spec_windows: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    # decode windows by accepted tokens per step: histogram[k] = windows that produced k+1 tokens
    accepted_length_counts: list[int] = msgspec.field(default_factory=list)
    # state memory by mode, e.g. {"native": 1048576}; filled from the runner when it reports it
    state_pool_bytes: dict[str, int] = msgspec.field(default_factory=dict)
    # replay folds performed so far (None when the runner does not expose it)
    num_folds: int | None = None
    # prefix cache: tokens looked up and resumed at admissions, checkpoints stored and evicted so far, checkpoint
    # bytes and KV tokens held now
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    # prompt tokens resumed from the host tier (shared host memory) instead of the device's prefix cache
    prefix_cache_host_hit_tokens: int = 0
    # entries copied into the host tier, and entries dropped instead because its copies were behind
    prefix_cache_host_entries_written: int = 0
    prefix_cache_host_entries_skipped: int = 0
    prefix_cache_checkpoints_stored: int = 0
    prefix_cache_checkpoints_evicted: int = 0
    prefix_cache_checkpoint_bytes: int = 0
    prefix_cache_tokens: int = 0


EngineInput = NewRequest | Abort
EngineOutput = TokenChunk | Finished | EngineStats
