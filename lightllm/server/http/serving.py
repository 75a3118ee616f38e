"""Front-end request handling shared by the OpenAI routes: validation, fan-out to engine requests, streaming of
per-sequence deltas, aborts on stop strings and client disconnects."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec

from lightllm.engine.messages import NewRequest, TokenChunk
from lightllm.engine.sampling_params import SamplingParams
from lightllm.server.args import ServerArgs
from lightllm.server.http.engine_client import EngineClient
from lightllm.server.http.metrics import Metrics
from lightllm.server.model_info import ModelInfo
from lightllm.server.output import Delta, SequenceOutput, prompt_problem
from lightllm.server.tokenizer import Tokenizer


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was complete; its sequences have been aborted."""


# put on a request's queue by its disconnect watcher
_DISCONNECTED = object()


class ApiError(Exception):
    """A request problem reported as an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


@dataclass
class Sequence:
    """One generated sequence of an HTTP request: prompt index × n."""

    index: int
    prompt_index: int
    req_id: str
    output: SequenceOutput


class Frontend:
    def __init__(
        self,
        args: ServerArgs,
        info: ModelInfo,
        tokenizer: Tokenizer,
        client: EngineClient,
        metrics: Metrics,
        engine_alive=lambda: True,
    ):
        self.args, self.info, self.tokenizer, self.client, self.metrics = args, info, tokenizer, client, metrics
        self.engine_alive = engine_alive

    def check_engine(self) -> None:
        if not self.engine_alive():
            raise ApiError(503, "the engine process is not running", kind="server_error")

    def check_model(self, model: str) -> None:
        if model != self.args.served_model_name:
            raise ApiError(400, f"model {model!r} is not served here; use {self.args.served_model_name!r}", "model")

    def check_prompt(self, ids: list[int], params: SamplingParams, param: str) -> None:
        problem = prompt_problem(ids, params, self.info.vocab_size, self.args.max_req_total_len)
        if problem is not None:
            message, field = problem
            raise ApiError(400, message, param if field == "prompt" else field)

    async def generate(
        self, prompts: list[list[int]], params: SamplingParams, request=None
    ) -> AsyncIterator[tuple[Sequence, Delta]]:
        """Run `params.n` sequences per prompt; yields (sequence, delta) as tokens arrive, in arrival order."""
        base = uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        seqs: dict[str, Sequence] = {}
        # submitted and not finished; everything left here at exit is aborted
        pending: set[str] = set()
        watcher = None if request is None else asyncio.create_task(_watch_disconnect(request, queue))
        try:
            for p, ids in enumerate(prompts):
                for j in range(params.n):
                    index = p * params.n + j
                    # n sequences from one seed must differ, and stay reproducible
                    sub = msgspec.structs.replace(params, n=1, seed=None if params.seed is None else params.seed + j)
                    output = SequenceOutput(self.tokenizer, sub, self.tokenizer.eos_token_ids)
                    seq = seqs[f"{base}-{index}"] = Sequence(index, p, f"{base}-{index}", output)
                    self.metrics.on_submit(seq.req_id)
                    pending.add(seq.req_id)
                    await self.client.submit(
                        NewRequest(seq.req_id, ids, sub, list(self.tokenizer.eos_token_ids)), queue
                    )
            while pending:
                msg = await queue.get()
                if msg is _DISCONNECTED:
                    raise ClientDisconnected()
                seq = seqs[msg.req_id]
                out = seq.output
                delta = out.on_tokens(msg) if isinstance(msg, TokenChunk) else out.on_finished(msg)
                if out.finished:
                    pending.discard(seq.req_id)
                    self.client.release(seq.req_id)
                    if out.stop_string_hit:
                        self.client.abort(seq.req_id)
                    self.metrics.count_finished(out.finish_reason)
                yield seq, delta
        finally:
            if watcher is not None:
                watcher.cancel()
            # the client went away (or the handler failed): every unfinished sequence gives its slot back
            # no await here: a cancelled handler may be cancelled again at any await, skipping the rest
            for req_id in pending:
                self.client.abort(req_id)
                self.client.release(req_id)
                self.metrics.count_finished("abort")


async def _watch_disconnect(request, queue: asyncio.Queue) -> None:
    """Wake the request's consumer when the client disconnects. A blocking receive sees the disconnect however
    the ASGI stack wraps `receive` (a zero-timeout poll can miss it); the body was read before the handler ran,
    so nothing else is waiting for these messages."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    queue.put_nowait(_DISCONNECTED)
