"""What the engine hands the model runner for one forward, and what comes back.

A batch describes itself by data: per-row query lengths and whether a row is a prefill chunk or a decode/verify
window. Rows are ordered: prefill rows first, then decode rows. A decode row of width W carries the last accepted
token followed by W - 1 draft tokens (W = 1 is plain decode).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from lightllm.cache.payload import RequestState, TensorBlob
from lightllm.cache.prefix.cache import PrefixMatch
from lightllm.cache.prefix.namespace import DEFAULT_NAMESPACE


@dataclass
class ForwardBatch:
    # runner-side request handles (from `ModelRunner.add_request`), one per row
    req_handles: list[int]
    # tokens this step per row (prefill chunk length, or verify width W)
    query_lens: list[int]
    # tokens of the row already in its KV cache / linear state before this step
    num_cached_tokens: list[int]
    # number of leading rows that are prefill chunks; the rest are decode/verify rows
    num_prefill_rows: int
    # [sum(query_lens)] int64, all rows' tokens flattened in row order
    input_ids: torch.Tensor
    # per prefill row: True if this chunk ends the prompt (its last position gets logits); empty = all True
    prefill_is_last_chunk: list[bool] = field(default_factory=list)
    # per prefill row: True if every position of the chunk gets logits in `ForwardOutput.prompt_logits` (prompt
    # log-probabilities); empty = no row asks
    prefill_prompt_logits: list[bool] = field(default_factory=list)
    # [num_decode_rows] int64 on the runner's device: each decode row's first token, replacing its entry in
    # `input_ids` (the previous step's sample, launched before the host has read it); None = take `input_ids`
    decode_input_ids: torch.Tensor | None = None
    # [num_decode_rows, D] int64 on the runner's device: row i's drafts (its tokens 1 .. W_i - 1) in its first
    # W_i - 1 columns, -1 after them, replacing the placeholders in `input_ids` (drafts the host has not read,
    # `engine.speculative.device_drafts`); None = take `input_ids`
    decode_draft_ids: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return len(self.req_handles)

    @property
    def num_decode_rows(self) -> int:
        return self.num_rows - self.num_prefill_rows


@dataclass
class ForwardOutput:
    # [num_logit_tokens, vocab] fp32: the last token of each prefill row that ends its prompt, then every token of
    # every decode row (row-major, W_i tokens per row)
    logits: torch.Tensor
    # [num_logit_tokens, hidden] final hidden states at the same positions (input of the MTP head), or None
    hidden: torch.Tensor | None = None
    # [sum of the asking rows' query lengths, vocab] fp32: logits at every position of each prefill row with
    # `prefill_prompt_logits` set, in row order (None when no row asks)
    prompt_logits: torch.Tensor | None = None
    # num_prefill_rows + 1 cumulative starts: prefill row i's positions are prompt_logits[offsets[i]:offsets[i + 1]]
    # (empty for rows that did not ask)
    prompt_logits_offsets: list[int] = field(default_factory=list)


class ModelRunnerProtocol(Protocol):
    """The engine's view of a model: memory pools + forward. Implemented in `lightllm.worker.runner`."""

    vocab_size: int
    # largest verify width the state was sized for (mtp_step + 1 or spec_ngram + 1)
    max_width: int
    # number of MTP draft steps the checkpoint supports (0 = none)
    mtp_step: int

    def add_request(self, prefix: list[int] | None = None, namespace: bytes = DEFAULT_NAMESPACE) -> int:
        """Reserve a linear-state slot and a KV slot table row; returns the request handle. With `prefix` (the
        request's tokens) a runner with a prefix cache resumes it from the longest cached checkpoint on them in
        `namespace`, which its publishes go to as well (`lightllm.cache.prefix.namespace`)."""

    def free_request(self, handle: int) -> None:
        """Release every KV token and the state slot of a request (tokens shared with the prefix cache stay)."""

    def num_tokens(self, handle: int) -> int:
        """Tokens of the request already committed (after `add_request`: those resumed from the prefix cache)."""

    def match_prefix(self, token_ids: list[int], namespace: bytes = DEFAULT_NAMESPACE) -> PrefixMatch:
        """What `add_request(token_ids, namespace)` would resume from the prefix cache; changes nothing."""

    def publish(self, handle: int, token_ids: list[int]) -> None:
        """Offer the request's committed tokens (all `num_tokens(handle)` of them, `token_ids`) to the prefix
        cache with a checkpoint of its state at their end. Between steps only (after `accept`)."""

    def publish_many(self, entries: list[tuple[int, list[int]]]) -> None:
        """`publish` for each (handle, token ids) of `entries`, at once."""

    def num_free_requests(self) -> int: ...

    def num_free_kv_tokens(self) -> int: ...

    def bytes_per_request(self) -> int:
        """Linear-attention state bytes of one request slot (all layers, this state mode)."""

    def prefix_cache_stats(self) -> dict[str, int] | None:
        """The prefix cache's counters (queried / hit tokens, checkpoints stored / evicted, bytes); None without
        a prefix cache."""

    def stats(self) -> dict[str, int | None]:
        """Counters for the metrics endpoint, read between steps: `num_folds` (None in a mode without folds)."""

    def export_request(
        self, handle: int, pack: Callable[[list[torch.Tensor]], list[TensorBlob]] | None = None
    ) -> RequestState:
        """The committed state of request `handle` (between steps only) with every rank's heads, its tensors packed
        by `pack` (None: host copies). Prefill/decode disaggregation sends it to another engine."""

    def import_request(
        self, state: RequestState, region: torch.Tensor | None = None, namespace: bytes = DEFAULT_NAMESPACE
    ) -> int:
        """A new request holding `state` (laid out by global head) in a fresh state slot and KV row, publishing to
        `namespace`; returns its handle. Blobs whose bytes lie in a device region are read from `region`. Raises
        RuntimeError when no slot or not enough KV is free (nothing is kept then)."""

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """Allocate KV slots for the new tokens, run the model, return logits (KV of all new tokens is kept).
        Prefill tokens are committed at once; decode rows stay pending until `accept`, which must be called
        before the next `forward` whenever the step had decode rows (also for plain decode: accept 1)."""

    def accept(self, handles: list[int], num_accepted: list[int]) -> None:
        """After a step with decode rows: keep the first `num_accepted[i]` tokens of each decode row's window
        (linear state via `LinearAttState.accept`, KV beyond them released). Every decode row must be listed."""

    def draft(self, handles: list[int], next_tokens: torch.Tensor, mtp_step: int) -> torch.Tensor:
        """MTP head: chained greedy drafts `[len(handles), mtp_step]` int64.

        Call after `forward` (and `accept`, for decode rows) with each request's newly sampled token: the
        runner keeps the main model's hidden states of the accepted tokens itself, commits them with their
        following tokens into the MTP layer's KV, then drafts `mtp_step` tokens greedily. The drafts form the
        next verify window `[next_token, *drafts]` (width mtp_step + 1)."""
