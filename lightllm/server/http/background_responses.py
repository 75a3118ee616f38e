"""Background responses (`background: true`): the request returns at once with the response `queued`; the
generation runs on in this process, unbound from the client's connection, and the stored response is what
`GET /v1/responses/{id}` polls: `queued`, `in_progress`, then `completed` / `incomplete` / `failed`, or `cancelled`
once `POST /v1/responses/{id}/cancel` (through any HTTP process) left its mark in the store.

Every event of the response's stream goes to its event log in the store as it is made, so the stream can be read
from any HTTP process, from its start or after any event it names (`GET /v1/responses/{id}?stream=true
&starting_after=N`), while the response runs and after it ended: a streamed background request (`stream: true`) is
that reading from the start, and a client whose connection dropped picks it up where it left off. The log ends
with a record of this module's own once the response has ended, however it ended.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import msgspec

from lightllm.server.http.response_store import ResponseStore, StoredResponse

logger = logging.getLogger(__name__)

# how often a running background response looks for a cancel mark
CANCEL_POLL_S = 0.2
# how long a cancel waits for the running process to stop the response before answering with what is stored
CANCEL_WAIT_S = 15.0
# how often a reader looks for new events of a response another process runs
EVENTS_POLL_S = 0.05
# how often a reader that sees no new event checks that the response is still running
EVENTS_STALE_S = 1.0
# the states of a response that may still change
UNFINISHED = ("queued", "in_progress")
# the event log's last line: the response has ended (events all have a type, this record has none)
END_OF_EVENTS = b'{"end":true}'
_DECODE = msgspec.json.Decoder()


class BackgroundResponses:
    """This process's running background responses (their tasks, stopped when the server stops)."""

    def __init__(self, store: ResponseStore):
        self.store = store
        self._tasks: set[asyncio.Task] = set()
        # set when a response running here logs events: wakes this process's readers at once
        self._logged: dict[str, asyncio.Event] = {}

    async def start(self, built) -> dict:
        """Store `built`'s response as queued and run it on; returns the queued response."""
        queued = {**built.response(None), "status": "queued"}
        built.event("response.created", response=queued)
        built.event("response.queued", response=queued)
        await self._put(built, queued)
        self._logged[built.id] = asyncio.Event()
        task = asyncio.get_running_loop().create_task(self._run(built))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return queued

    async def _put(self, built, response: dict) -> None:
        """Store `response` and log the events made up to now."""
        await asyncio.to_thread(self.store.put, StoredResponse(response, built.conversation))
        await self._log(built)

    async def _log(self, built, end: bool = False) -> None:
        lines = built.take_lines() + ([END_OF_EVENTS] if end else [])
        if not lines:
            return
        await asyncio.to_thread(self.store.append_events, built.id, lines)
        logged = self._logged.get(built.id)
        if logged is not None:
            logged.set()

    async def _run(self, built) -> None:
        watcher = asyncio.get_running_loop().create_task(self._watch_cancel(built.id, asyncio.current_task()))
        try:
            started = False
            async for seq, delta in built.run.stream:
                if not started:
                    started = True
                    in_progress = {**built.response(None), "status": "in_progress"}
                    built.event("response.in_progress", response=in_progress)
                    await self._put(built, in_progress)
                if delta.finish_reason == "error":
                    await self._fail(built, seq.output.error or "the engine failed this request")
                    return
                built.take(seq, delta)
                if built.finished is not None:
                    # kept before the log says it is done: a reader may continue it at once
                    response = await built.final()
                    built.event(f"response.{response['status']}", response=response)
                await self._log(built)
            if built.finished is None:
                await self._fail(built, "the engine ended the request without finishing it")
        except asyncio.CancelledError:
            if not self.store.cancel_requested(built.id):
                # the server is stopping: a store that outlives it must not show the response running forever
                await self._fail(built, "the server stopped before the response was finished")
                raise
            await built.run.stream.aclose()  # the engine's sequences aborted before it says cancelled
            cancelled = built.partial("cancelled")
            # no stream event names a cancelled response: readers learn it from an error event, then the end
            built.event("error", code="response_cancelled", message=f"response {built.id} was cancelled", param=None)
            await self._put(built, cancelled)
        except Exception:
            logger.exception("background response %s failed", built.id)
            await self._fail(built, "internal server error")
        finally:
            watcher.cancel()
            await built.run.stream.aclose()
            self.store.clear_cancel(built.id)
            try:
                await self._log(built, end=True)
            except OSError as exc:
                logger.warning("background response %s: its event log was not ended: %s", built.id, exc)
            logged = self._logged.pop(built.id, None)
            if logged is not None:
                logged.set()

    async def _fail(self, built, message: str) -> None:
        built.failed_events(message)
        await self._put(built, built.failed(message))

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

    async def events(self, response_id: str, starting_after: int) -> AsyncIterator[tuple[str, bytes]]:
        """(type, JSON line) of each event of a background response's stream numbered after `starting_after`:
        those logged, then each as it is logged, until the response has ended (or its log is gone: deleted)."""
        offset, idle, ended_before = 0, 0.0, False
        while True:
            read = await asyncio.to_thread(self.store.read_events, response_id, offset)
            if read is None:
                return
            lines, offset = read
            for line in lines:
                if line == END_OF_EVENTS:
                    return
                event = _DECODE.decode(line)
                if event["sequence_number"] > starting_after:
                    yield event["type"], line
            idle = 0.0 if lines else idle + EVENTS_POLL_S
            if idle >= EVENTS_STALE_S:
                # the process that ran it may have stopped without ending the log: a reader must not wait forever.
                # Ended at two checks a second apart with nothing logged between them: its log will not grow
                # (the store shows the end a moment before the log does)
                idle = 0.0
                stored = await asyncio.to_thread(self.store.get, response_id)
                ended = stored is None or stored.response["status"] not in UNFINISHED
                if ended and ended_before:
                    return
                ended_before = ended
            elif lines:
                ended_before = False
            await self._wait_for_events(response_id)

    async def _wait_for_events(self, response_id: str) -> None:
        logged = self._logged.get(response_id)
        if logged is None:
            await asyncio.sleep(EVENTS_POLL_S)
            return
        try:
            await asyncio.wait_for(logged.wait(), EVENTS_POLL_S)
        except asyncio.TimeoutError:
            pass
        logged.clear()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
