"""What a prefill node and a decode node do around `Engine.step` (transport-free: messages in, outputs out): the
roles of the shared step loop (`lightllm.server.engine_loop`).

Prefill: a `PdPrefill` is queued in the engine; once its first token is sampled (and, with MTP, drafted) the
request leaves the engine, its state is exported and sent to its decode node, and its slot is held until the
decode node confirms (then freed) or the confirmation times out (then freed and the request fails). The first
token is not emitted here: the decode node emits it, so the master sees one ordered stream per request.

Decode: a `PdTransfer` is confirmed at once (its state is in host memory here, or was just copied out of the
prefill node's device region) and waits until a state slot and KV for its tokens are free, then is imported into a
fresh slot and decodes like any request.

With a staging buffer (`staging.py`: CUDA IPC or NIXL) the prefill node stages the state in it when the decode
node reads that kind of region; the region is freed with the slot.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import torch

from lightllm.engine import grammar
from lightllm.engine.engine import Engine
from lightllm.engine.messages import Abort, EngineOutput, Finished, TokenChunk
from lightllm.engine.request import Request, Status
from lightllm.server.pd.messages import PdPrefill, PdTransfer, TransferAck
from lightllm.server.pd.staging import DeviceRegion, RegionReader, StagingBuffer
from lightllm.server.pd.transport import StateTransport, TransportError
from lightllm.worker.transfer.request_state import host_blobs

logger = logging.getLogger(__name__)
# an aborted request id is remembered this long, in case its transfer arrives after the abort
ABORT_MEMORY_S = 120.0


@dataclass
class _Held:
    handle: int
    num_prompt_tokens: int
    deadline: float
    region: DeviceRegion | None = None


# how many dropped inbox frames a node logs one by one (then one line per LOG_EVERY)
LOG_FIRST, LOG_EVERY = 20, 1000


class DropUndecodable:
    """A role's `on_undecodable`: an inbox frame that is not sealed with the PD secret, replayed, or unreadable
    (a version skew) is dropped, never answered (its request ids are not to be trusted), and logged with a bound
    so a flood of garbage cannot fill the disk."""

    def __init__(self):
        self.num_dropped = 0

    def __call__(self, raw: bytes, exc: Exception) -> list[EngineOutput]:
        self.num_dropped += 1
        if self.num_dropped <= LOG_FIRST or self.num_dropped % LOG_EVERY == 0:
            logger.error("dropping an undecodable or unauthenticated message (%d so far): %s", self.num_dropped, exc)
        return []


class PrefillRole:
    def __init__(
        self,
        engine: Engine,
        transport: StateTransport,
        fingerprint: str,
        ack_addr: str,
        transfer_timeout_s: float,
        staging: StagingBuffer | None = None,
    ):
        self.engine = engine
        self.on_undecodable = DropUndecodable()
        # an overlapped step would feed a request's first sampled token to the model before `after_step` sees the
        # token, so the exported state would hold one token more than the transfer says; a prefill engine decodes
        # nothing, so it loses nothing by stepping synchronously
        engine.overlap_schedule = False
        # device-to-device transfers to decode nodes that read this buffer's kind of region
        self.staging = staging
        self.transport = transport
        self.fingerprint = fingerprint
        self.ack_addr = ack_addr
        self.transfer_timeout_s = transfer_timeout_s
        # req_id -> the PdPrefill that brought it (the request, its decode node)
        self._routes: dict[str, PdPrefill] = {}
        # transferred requests whose slot waits for the decode node's confirmation
        self.held: dict[str, _Held] = {}

    def has_work(self) -> bool:
        return self.engine.has_work() or bool(self.held)

    def on_message(self, msg) -> list[EngineOutput]:
        if isinstance(msg, PdPrefill):
            outputs = self.engine.add_request(msg.request)
            if not outputs:
                self._routes[msg.request.req_id] = msg
            return outputs
        if isinstance(msg, TransferAck):
            held = self.held.pop(msg.req_id, None)
            if held is None:
                return []
            self._free(held)
            if msg.error is None:
                return []
            return [Finished(msg.req_id, "error", num_prompt_tokens=held.num_prompt_tokens, error=msg.error)]
        if isinstance(msg, Abort):
            self._routes.pop(msg.req_id, None)
            held = self.held.pop(msg.req_id, None)
            if held is not None:
                self._free(held)
                return [Finished(msg.req_id, "abort", num_prompt_tokens=held.num_prompt_tokens)]
            return self.engine.abort(msg.req_id)
        return []

    def after_step(self, outputs: list[EngineOutput]) -> list[EngineOutput]:
        """Hand off every request that got its first token in this step; their chunks leave the outputs."""
        kept: list[EngineOutput] = []
        for out in outputs:
            req = self.engine.requests.get(out.req_id) if isinstance(out, TokenChunk) else None
            if req is None or req.is_finished or out.req_id not in self._routes:
                if isinstance(out, Finished):
                    self._routes.pop(out.req_id, None)
                kept.append(out)
                continue
            kept += self._hand_off(req, out)
        return kept

    def _hand_off(self, req: Request, chunk: TokenChunk) -> list[EngineOutput]:
        route = self._routes.pop(req.req_id)
        request, decode_addr = route.request, route.decode_addr
        engine = self.engine
        # the decode node verifies the request's drafts first, and its exported MTP state must be the one after them
        engine.speculator.flush([req])
        # its prompt's prefix-cache publish, queued by the step, needs the state the hand-off takes
        engine.publish_now([req])
        engine.requests.pop(req.req_id)
        engine.scheduler.running.remove(req)
        handle, req.handle, req.status = req.handle, None, Status.FINISHED
        num_prompt = len(req.prompt_ids)
        held = _Held(handle, num_prompt, time.monotonic() + self.transfer_timeout_s)
        try:
            state = engine.runner.export_request(handle, self._packer(route, held))
            generator = req.generator.get_state().numpy().tobytes() if req.generator is not None else None
            transfer = PdTransfer(
                self.fingerprint, request, chunk, list(req.draft_ids), state, self.ack_addr, generator, held.region
            )
            self.transport.send(decode_addr, transfer)
        except (TransportError, RuntimeError) as exc:
            logger.error("transfer of %s to %s failed: %s", req.req_id, decode_addr, exc)
            self._free(held)
            return [Finished(req.req_id, "error", num_prompt_tokens=num_prompt, error=f"transfer failed: {exc}")]
        self.held[req.req_id] = held
        return []

    def _packer(self, route: PdPrefill, held: _Held):
        """Host bytes, or the staging buffer when the decode node reads its kind of region and one is free."""
        if self.staging is None or self.staging.kind not in route.decode_reads:
            return host_blobs

        def pack(tensors: list[torch.Tensor]):
            staged = self.staging.stage(tensors)
            if staged is None:
                logger.warning("the staging buffer is full: %s goes host-staged", route.request.req_id)
                return host_blobs(tensors)
            held.region, blobs = staged
            return blobs

        return pack

    def _free(self, held: _Held) -> None:
        self.engine.runner.free_request(held.handle)
        if held.region is not None:
            self.staging.release(held.region)
            held.region = None

    def tick(self) -> list[EngineOutput]:
        """Free the slots whose confirmation is overdue and fail those requests."""
        now = time.monotonic()
        outputs: list[EngineOutput] = []
        for req_id, held in list(self.held.items()):
            if now > held.deadline:
                del self.held[req_id]
                self._free(held)
                error = f"the decode node did not confirm the transfer within {self.transfer_timeout_s:g} s"
                logger.error("%s: %s", req_id, error)
                outputs.append(Finished(req_id, "error", num_prompt_tokens=held.num_prompt_tokens, error=error))
        return outputs


class DecodeRole:
    def __init__(
        self,
        engine: Engine,
        transport: StateTransport,
        fingerprint: str,
        reader: RegionReader | None = None,
        device_budget_bytes: int | None = None,
    ):
        """`device_budget_bytes`: device memory for the copies of regions whose transfer waits for a slot (None:
        no bound); copies past it are kept in host memory until their import."""
        self.engine = engine
        self.on_undecodable = DropUndecodable()
        self.transport = transport
        self.fingerprint = fingerprint
        # reads prefill nodes' staging regions (None: this node takes host-staged transfers only)
        self.reader = reader
        # confirmed transfers waiting for a state slot and KV
        self.pending: deque[PdTransfer] = deque()
        # req_id -> a pending transfer's bytes copied out of its prefill node's region
        self._regions: dict[str, torch.Tensor] = {}
        # a waiting transfer's region copy lives outside the KV cache's budget: under backpressure (up to
        # --max_queue_len transfers waiting) device copies would exhaust the GPU, so past the budget they wait
        # in host memory
        self.device_budget_bytes = device_budget_bytes
        self.device_region_bytes = 0
        self._device_region_sizes: dict[str, int] = {}
        self._aborted: dict[str, float] = {}

    def has_work(self) -> bool:
        return self.engine.has_work() or bool(self.pending)

    def tick(self) -> list[EngineOutput]:
        """Between steps: import the transfers that fit."""
        return self.admit()

    def after_step(self, outputs: list[EngineOutput]) -> list[EngineOutput]:
        return outputs

    def on_message(self, msg) -> list[EngineOutput]:
        if isinstance(msg, PdTransfer):
            return self._receive(msg)
        if isinstance(msg, Abort):
            for transfer in self.pending:
                if transfer.request.req_id == msg.req_id:
                    self.pending.remove(transfer)
                    self._take_region(msg.req_id)
                    return [self._aborted_finish(transfer)]
            if msg.req_id in self.engine.requests:
                return self.engine.abort(msg.req_id)
            self._aborted[msg.req_id] = time.monotonic()
        return []

    def _receive(self, transfer: PdTransfer) -> list[EngineOutput]:
        req_id = transfer.request.req_id
        error = None
        if transfer.fingerprint != self.fingerprint:
            error = (
                f"the decode node refused the transfer: header {transfer.fingerprint} (prefill node) differs from "
                f"{self.fingerprint} (decode node)"
            )
        elif req_id in self.engine.requests or any(t.request.req_id == req_id for t in self.pending):
            error = f"duplicate request id {req_id!r} on the decode node"
        elif transfer.region is not None:
            error = self._pull(transfer)
        self._send_ack(transfer, TransferAck(req_id, error))
        if error is not None:
            return []
        if self._aborted.pop(req_id, None) is not None:
            self._take_region(req_id)
            return [self._aborted_finish(transfer)]
        self.pending.append(transfer)
        return []

    def _pull(self, transfer: PdTransfer) -> str | None:
        """Copy the transfer's device region here now (the prefill node frees it on our confirmation or its
        timeout); the reason when that cannot be done."""
        if self.reader is None:
            return "the decode node refused the transfer: it does not read staging regions (--pd_transport host)"
        req_id, nbytes = transfer.request.req_id, transfer.region.nbytes
        budget = self.device_budget_bytes
        host = budget is not None and self.device_region_bytes + nbytes > budget
        try:
            self._regions[req_id] = self.reader.pull(transfer.region, host=host)
        except Exception as exc:
            logger.exception("reading the device region of %s failed", req_id)
            return f"the decode node could not read the transfer's device region: {exc}"
        if not host:
            self.device_region_bytes += nbytes
            self._device_region_sizes[req_id] = nbytes
        return None

    def _take_region(self, req_id: str) -> torch.Tensor | None:
        self.device_region_bytes -= self._device_region_sizes.pop(req_id, 0)
        return self._regions.pop(req_id, None)

    def _send_ack(self, transfer: PdTransfer, ack: TransferAck) -> None:
        try:
            self.transport.send(transfer.ack_addr, ack)
        except TransportError as exc:
            # the prefill node times out and frees its slot on its own
            logger.error("could not confirm %s to %s: %s", ack.req_id, transfer.ack_addr, exc)

    @staticmethod
    def _aborted_finish(transfer: PdTransfer) -> Finished:
        return Finished(
            transfer.request.req_id, "abort", num_prompt_tokens=len(transfer.request.prompt_ids), num_output_tokens=1
        )

    def admit(self) -> list[EngineOutput]:
        """Import the waiting transfers that fit: a free state slot, and KV for their tokens on top of what the
        running requests still claim (a verify window each, the rest of running prefills)."""
        now = time.monotonic()
        self._aborted = {k: t for k, t in self._aborted.items() if now - t < ABORT_MEMORY_S}
        engine, scheduler = self.engine, self.engine.scheduler
        runner = engine.runner
        outputs: list[EngineOutput] = []
        while self.pending:
            transfer = self.pending[0]
            committed = sum(r.num_prefill_tokens - r.num_computed_tokens for r in scheduler.running)
            committed += scheduler.max_width * (len(scheduler.running) + 1)
            fits = transfer.state.num_tokens + committed <= runner.num_free_kv_tokens()
            if not fits or runner.num_free_requests() == 0 or len(scheduler.running) >= scheduler.max_running_requests:
                break
            self.pending.popleft()
            outputs += self._import(transfer)
        return outputs

    def _import(self, transfer: PdTransfer) -> list[EngineOutput]:
        engine, msg = self.engine, transfer.request
        req_id = msg.req_id
        req = Request.from_message(msg, engine.max_req_total_len)
        try:
            # its publishes here go to its namespace, as they would on a monolithic server
            handle = engine.runner.import_request(
                transfer.state, self._take_region(req_id), namespace=req.cache_namespace
            )
        except RuntimeError as exc:
            logger.error("import of %s failed: %s", req_id, exc)
            return [Finished(req_id, "error", num_prompt_tokens=len(msg.prompt_ids), error=f"import failed: {exc}")]
        req.output_ids = list(transfer.first_chunk.token_ids)
        # a grammar resumes where the prefill node's first token left it
        problem = (
            grammar.attach(engine.grammars, req, msg)
            or grammar.compile_error(req)
            or grammar.advance(req, req.output_ids)
        )
        if problem is not None:
            engine.runner.free_request(handle)
            return [Finished(req_id, "error", num_prompt_tokens=len(msg.prompt_ids), error=problem)]
        req.handle, req.status = handle, Status.RUNNING
        req.num_computed_tokens = req.num_prefill_tokens = transfer.state.num_tokens
        req.num_cached_tokens = transfer.first_chunk.num_cached_tokens or 0
        req.draft_ids = list(transfer.draft_ids)
        if transfer.generator_state is not None:
            req.generator = torch.Generator(device=engine.runner.device)
            req.generator.set_state(torch.frombuffer(bytearray(transfer.generator_state), dtype=torch.uint8))
        scheduler = engine.scheduler
        scheduler._admit_seq += 1
        req.admit_seq = scheduler._admit_seq
        engine.requests[req_id] = req
        scheduler.running.append(req)
        return [transfer.first_chunk]
