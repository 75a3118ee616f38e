"""A request is data: ids, progress counters, drafts, settings and status. The scheduler and engine mutate it."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from lightllm.cache.prefix.namespace import DEFAULT_NAMESPACE, salt_namespace
from lightllm.engine.messages import NewRequest
from lightllm.engine.sampling_params import SamplingParams
from lightllm.engine.thinking_budget import ThinkingCount

if TYPE_CHECKING:
    from lightllm.engine.grammar import RequestGrammar


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    req_id: str
    prompt_ids: list[int]
    params: SamplingParams
    # token ids that finish the request (eos unless ignore_eos, plus params.stop_token_ids)
    stop_ids: frozenset[int]
    # hard cap on generated tokens (max_tokens clipped so prompt + output <= max_req_total_len)
    max_new_tokens: int
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_token_id: int | None = None
    error: str | None = None
    # with params.prompt_logprobs: entries for prompt positions 1, 2, ... gathered over the prefill chunks, sent
    # (and dropped) with the first token
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    # and each scored prompt token's rank (`sampler.token_ranks`)
    prompt_ranks: list[int | None] = field(default_factory=list)
    # runner handle while RUNNING (state slot + KV row), None otherwise
    handle: int | None = None
    # tokens of `all_ids` already in the runner's KV cache / linear state
    num_computed_tokens: int = 0
    # tokens to prefill before the first sample of this admission (prompt, or prompt + output after preemption)
    num_prefill_tokens: int = 0
    # draft tokens proposed for the next decode window: a list, or MTP drafts still on the device
    # (`speculative.device_drafts.DeviceDrafts`: its length is known, its values are read on demand)
    draft_ids: Sequence[int] = field(default_factory=list)
    # admission order, used to pick preemption victims (latest first)
    admit_seq: int = 0
    num_preemptions: int = 0
    # prompt tokens resumed from the prefix cache at the first admission
    num_cached_tokens: int = 0
    # prefill position where the tokens branch off a cached path (a checkpoint is taken there); 0 = none
    branch_point: int = 0
    # resumed from the prefix cache with a short suffix: the prefill feeds the last prompt token too (one step
    # less to the first token; its prefill-end checkpoint is after that token, not before it)
    prefills_last_token: bool = False
    # prompt positions the front-end asked to checkpoint, ascending
    checkpoint_hints: list[int] = field(default_factory=list)
    # seeded requests draw every random number from their own generator, so batching cannot change them
    generator: torch.Generator | None = None
    # with params.grammar: the matcher every sampled position is masked by (engine/grammar.py)
    grammar: RequestGrammar | None = None
    # with params.allowed_token_ids: the tokens it may take as a [vocab] bool mask on the device, built at its first
    # sampled position (`sampler.allowed_mask`)
    allowed_mask: torch.Tensor | None = None
    # lower runs first (the waiting queue's order, and who is preempted for whom: `Scheduler`)
    priority: int = 0
    # with params.thinking_token_budget: where its reasoning block stands over the output so far
    thinking: ThinkingCount | None = None
    # the scheduler's arrival count, set when it first queues the request (a preempted request keeps it)
    arrival_seq: int = 0
    # the prefix-cache namespace it resumes from and publishes to (its cache_salt's; `lightllm.cache.prefix.namespace`)
    cache_namespace: bytes = DEFAULT_NAMESPACE

    @classmethod
    def from_message(cls, msg: NewRequest, max_req_total_len: int) -> Request:
        """The engine's request for `msg`: it stops at EOS (unless ignore_eos) or a stop token id, and generates at
        most max_tokens, clipped to the room the context leaves."""
        params = msg.params
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(msg.eos_token_ids))
        max_new = max_req_total_len - len(msg.prompt_ids)
        if params.max_tokens is not None:
            max_new = min(max_new, params.max_tokens)
        req = cls(msg.req_id, list(msg.prompt_ids), params, frozenset(stop_ids), max_new, priority=msg.priority)
        req.cache_namespace = salt_namespace(msg.cache_salt)
        if params.thinking_token_budget is not None:
            req.thinking = ThinkingCount.of_prompt(params, req.prompt_ids)
        return req

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_token_id(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prefill_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt log-probabilities are asked for and not sent yet: its prefill must compute every prompt position
        (a prefix cache must not resume it)."""
        return self.params.prompt_logprobs is not None and not self.output_ids

    @property
    def num_remaining_tokens(self) -> int:
        return self.max_new_tokens - len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED
