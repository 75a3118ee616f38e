"""The HTTP process's side of the zmq link: submit and abort requests, route outputs to per-request queues."""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import zmq
import zmq.asyncio

from lightllm.engine.messages import Abort, EngineOutput, EngineStats, Finished, NewRequest, TokenChunk

logger = logging.getLogger(__name__)


class EngineClient:
    def __init__(self, input_addr: str, output_addr: str, frontend: int = 0):
        # this HTTP process's index (`--http_workers`): the engine sends its requests' outputs to `output_addr`
        self.frontend = frontend
        self._ctx = zmq.asyncio.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.connect(input_addr)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.connect(output_addr)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(list[EngineOutput])
        self._queues: dict[str, asyncio.Queue[TokenChunk | Finished]] = {}
        self._task: asyncio.Task | None = None
        # in-flight abort sends (kept referenced until done)
        self._sends: set[asyncio.Future] = set()
        self.stats = EngineStats()
        self.stats_time = 0.0
        # callbacks(req_id, msg) for metrics, run on every output
        self.observers: list = []

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._receive_loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    async def submit(self, req: NewRequest, queue: asyncio.Queue) -> None:
        """Send a request; its TokenChunk/Finished messages go to `queue` until it finishes or is released."""
        self._queues[req.req_id] = queue
        if self.frontend:
            req = msgspec.structs.replace(req, frontend=self.frontend)
        await self._push.send(self._encoder.encode(req))

    def abort(self, req_id: str) -> None:
        """Tell the engine to stop a request and return its slot (a no-op there if it already finished).

        Synchronous on purpose: it is called from cleanup code of cancelled handlers, where any await may be
        cancelled again. zmq starts the send at once and returns a future, kept referenced until it is done."""
        sent = self._push.send(self._encoder.encode(Abort(req_id)))
        self._sends.add(sent)
        sent.add_done_callback(self._sends.discard)

    def fail_all(self, error: str) -> None:
        for req_id, queue in list(self._queues.items()):
            queue.put_nowait(Finished(req_id, "error", error=error))
        self._queues.clear()

    def release(self, req_id: str) -> None:
        self._queues.pop(req_id, None)

    async def _receive_loop(self) -> None:
        while True:
            raw = await self._pull.recv()
            try:
                outputs = self._decoder.decode(raw)
            except msgspec.DecodeError:
                logger.exception("undecodable engine output")
                continue
            for out in outputs:
                if isinstance(out, EngineStats):
                    self.stats, self.stats_time = out, time.monotonic()
                    continue
                for observe in self.observers:
                    try:
                        observe(out)
                    except Exception:
                        # metrics must never stop the delivery of tokens
                        logger.exception("output observer failed")
                queue = self._queues.get(out.req_id)
                if queue is not None:
                    queue.put_nowait(out)
                if isinstance(out, Finished):
                    self._queues.pop(out.req_id, None)
