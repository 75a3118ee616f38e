"""Background responses (`background: true`): the request returns at once with the response `queued`; the
generation runs on in this process, unbound from the client's connection, and the stored response is what
`GET /v1/responses/{id}` polls: `queued`, `in_progress`, then `completed` / `incomplete` / `failed`, or `cancelled`
once `POST /v1/responses/{id}/cancel` (through any HTTP process) left its mark in the store.
"""

from __future__ import annotations

import asyncio
import logging

from lightllm.server.http.response_store import ResponseStore, StoredResponse

logger = logging.getLogger(__name__)

# how often a running background response looks for a cancel mark
CANCEL_POLL_S = 0.2
# how long a cancel waits for the running process to stop the response before answering with what is stored
CANCEL_WAIT_S = 5.0
# the states of a response that may still change
UNFINISHED = ("queued", "in_progress")


class BackgroundResponses:
    """This process's running background responses (their tasks, stopped when the server stops)."""

    def __init__(self, store: ResponseStore):
        self.store = store
        self._tasks: set[asyncio.Task] = set()

    async def start(self, built) -> dict:
        """Store `built`'s response as queued and run it on; returns the queued response."""
        queued = {**built.response(None), "status": "queued"}
        await self._put(built, queued)
        task = asyncio.get_running_loop().create_task(self._run(built))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return queued

    async def _put(self, built, response: dict) -> None:
        await asyncio.to_thread(self.store.put, StoredResponse(response, built.conversation))

    async def _run(self, built) -> None:
        watcher = asyncio.get_running_loop().create_task(self._watch_cancel(built.id, asyncio.current_task()))
        try:
            started = False
            async for seq, delta in built.run.stream:
                if not started:
                    started = True
                    await self._put(built, {**built.response(None), "status": "in_progress"})
                if delta.finish_reason == "error":
                    await self._put(built, built.failed(seq.output.error or "the engine failed this request"))
                    return
                built.take(seq, delta)
            await built.final()
        except asyncio.CancelledError:
            if not self.store.cancel_requested(built.id):
                # the server is stopping: a store that outlives it must not show the response running forever
                await self._put(built, built.failed("the server stopped before the response was finished"))
                raise
            await built.run.stream.aclose()  # the engine's sequences aborted before it says cancelled
            await self._put(built, built.partial("cancelled"))
        except Exception:
            logger.exception("background response %s failed", built.id)
            await self._put(built, built.failed("internal server error"))
        finally:
            watcher.cancel()
            await built.run.stream.aclose()
            self.store.clear_cancel(built.id)

    async def _watch_cancel(self, response_id: str, runner: asyncio.Task) -> None:
        while not await asyncio.to_thread(self.store.cancel_requested, response_id):
            await asyncio.sleep(CANCEL_POLL_S)
        runner.cancel()

    async def cancel(self, response_id: str) -> dict | None:
        """Ask for the response to stop (any process may run it); its stored response once it has stopped, or
        as it is after `CANCEL_WAIT_S` (None: not stored)."""
        stored = await asyncio.to_thread(self.store.get, response_id)
        if stored is None or stored.response["status"] not in UNFINISHED:
            return None if stored is None else stored.response
        await asyncio.to_thread(self.store.request_cancel, response_id)
        deadline = asyncio.get_running_loop().time() + CANCEL_WAIT_S
        while asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(CANCEL_POLL_S / 2)
            stored = await asyncio.to_thread(self.store.get, response_id)
            if stored is None or stored.response["status"] not in UNFINISHED:
                break
        return None if stored is None else stored.response

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
