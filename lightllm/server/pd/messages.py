"""Messages of prefill/decode disaggregation, on top of the engine's own (`lightllm.engine.messages`).

master → prefill node: `PdPrefill` (a request and the decode node that continues it), `Abort`.
master → decode node: `Abort`. prefill node → decode node: `PdTransfer`. decode node → prefill node: `TransferAck`.
Nodes → master: the engine's `TokenChunk`, `Finished`, `EngineStats`. All cross zmq as msgpack, no pickle.
"""

from __future__ import annotations

import msgspec

from lightllm.cache.payload import RequestState
from lightllm.engine.messages import Abort, NewRequest, TokenChunk
from lightllm.server.pd.staging import DeviceRegion


class PdPrefill(msgspec.Struct, tag=True):
    request: NewRequest
    # zmq address of the decode node's inbox, where the prefilled request goes
    decode_addr: str
    # the kinds of staging region the decode node reads (`staging.py`); empty: host-staged transfers only
    decode_reads: list[str] = msgspec.field(default_factory=list)


class PdTransfer(msgspec.Struct, tag=True):
    """A prefilled request handed to a decode node."""

    # the sender's header fingerprint: a decode node refuses a transfer from an incompatible model or layout
    fingerprint: str
    request: NewRequest
    # the first sampled token (with its logprobs and the request's prompt scores), emitted by the decode node
    first_chunk: TokenChunk
    # MTP drafts for the first decode window
    draft_ids: list[int]
    state: RequestState
    # where the decode node confirms (the prefill node's inbox)
    ack_addr: str
    # a seeded request's generator state after the first sample (torch.Generator.get_state bytes)
    generator_state: bytes | None = None
    # where the state's bytes lie when they went device to device (its blobs hold offsets into this region)
    region: DeviceRegion | None = None


class TransferAck(msgspec.Struct, tag=True):
    req_id: str
    # None: the decode node holds the request, the prefill node frees its slot; else why it was refused
    error: str | None = None


NodeInput = PdPrefill | PdTransfer | TransferAck | Abort
