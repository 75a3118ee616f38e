"""What the runner keeps per request (`RequestRecord`) and of a step's decode rows until they are accepted."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lightllm.cache.prefix.namespace import DEFAULT_NAMESPACE
from lightllm.linear_att.base import DecodeRows


@dataclass
class RequestRecord:
    """What the runner keeps of one request: its handle (the KV row), state slot and committed tokens."""

    handle: int
    state_slot: int
    # tokens whose KV / linear state is committed
    num_tokens: int = 0
    # MTP: final hidden states not yet paired with their next token, as (step output, first row, rows) spans,
    # and the tokens that follow them as (step's token ids on the device, first, count) spans
    mtp_hidden: list[tuple[torch.Tensor, int, int]] = field(default_factory=list)
    mtp_next_ids: list[tuple[torch.Tensor, int, int]] = field(default_factory=list)
    # MTP: committed (hidden, token) pairs in the MTP head's KV
    mtp_len: int = 0
    # MTP: (step output, row) of the last committed token's hidden state once a draft consumed the spans
    mtp_last_hidden: tuple[torch.Tensor, int] | None = None
    # the last step accepted on the device that `settle` counted for this request (see device_accept.py)
    settled_step: object | None = None
    # the prefix-cache namespace it resumes from and publishes to (`lightllm.cache.prefix.namespace`)
    namespace: bytes = DEFAULT_NAMESPACE


@dataclass
class PendingVerify:
    """The decode rows of the last step, waiting for `accept`."""

    handles: list[int]
    widths: list[int]
    rows: DecodeRows
