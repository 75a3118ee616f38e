"""Stored Responses API responses: what `store` keeps, `previous_response_id` continues and `GET` / `DELETE
/v1/responses/{id}` read and remove; and stored conversations.

One JSON file per response in a folder that every HTTP process of the server shares (`--http_workers`: a
continuation may reach another process than the response it continues), written whole under a temporary name and
renamed, so a reader sees a response entirely or not at all. The folder is bounded in bytes
(`--responses_store_mb`): past the bound the least recently written responses are removed first. By default it is a
temporary folder removed when the server stops; `--responses_store_dir` names one that outlives the server.

A background response is stored as soon as it is queued and again when it ends; a `.cancel` mark beside it asks
the process that runs it (whichever received the cancel) to stop it. Its stream's events are appended, one JSON
line each, to an event log beside it (`.events`), which any process reads from an offset to stream them again; a
response's log counts towards the bound with it and goes with it.

A stored record holds the response object as it was returned and the conversation it answered: the input items of
the responses it continued, their outputs, then its own input (instructions are not part of it: a continuation
sends its own, as OpenAI's API specifies).

Conversations (`conversations.py` reads and writes their records) live in the same folder under the same bound: one
append-only log each (`.conversation`), which any process extends with one write per change.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

# the ids this server gives responses and conversations; anything else is nothing stored (and never a path)
RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")
CONVERSATION_ID = re.compile(r"conv_[0-9a-f]{32}")
# a process rescans the folder once it has written this share of the bound since its last scan
_SCAN_SHARE = 8
# what eviction leaves of the bound, so that the next writes do not evict one response each
_EVICT_TO = 0.9


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def new_conversation_id() -> str:
    return f"conv_{uuid.uuid4().hex}"


@dataclass
class StoredResponse:
    response: dict
    # the conversation the response answered, as input items (earlier turns' outputs among them)
    input: list[dict]

    def conversation(self) -> list[dict]:
        """The input items a continuation of this response starts from: its input, then its output."""
        return [*self.input, *self.response.get("output", [])]


class ResponseStore:
    """Responses stored in `directory` (None: a temporary folder of this store's own, removed by `close`), at most
    `max_bytes` of them; `max_bytes` 0 stores nothing (`enabled` false)."""

    def __init__(self, directory: str | None, max_bytes: int):
        self.max_bytes = max_bytes
        self.enabled = max_bytes > 0
        self._owned = self.enabled and directory is None
        self.directory: Path | None = None
        if self.enabled:
            self.directory = Path(directory or tempfile.mkdtemp(prefix="lightllm-responses-"))
            self.directory.mkdir(parents=True, exist_ok=True)
        # bytes this process wrote since it last summed the folder (starts full: the first write scans)
        self._unscanned = max_bytes

    def _path(self, response_id: str) -> Path | None:
        if not self.enabled or not RESPONSE_ID.fullmatch(response_id):
            return None
        return self.directory / f"{response_id}.json"

    def put(self, record: StoredResponse) -> bool:
        """Store `record` under its response's id; False (nothing stored) when it alone exceeds the bound."""
        path = self._path(record.response["id"])
        if path is None:
            raise ValueError(f"not a response id of this server: {record.response['id']!r}")
        data = json.dumps({"response": record.response, "input": record.input}, ensure_ascii=False).encode()
        if len(data) > self.max_bytes:
            return False
        fd, scratch = tempfile.mkstemp(prefix=".", suffix=".part", dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(scratch, path)
        except BaseException:
            Path(scratch).unlink(missing_ok=True)
            raise
        self._unscanned += len(data)
        if self._unscanned * _SCAN_SHARE >= self.max_bytes:
            self._evict()
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        path = self._path(response_id)
        if path is None:
            return None
        try:
            data = json.loads(path.read_bytes())
        except FileNotFoundError:
            return None
        return StoredResponse(data["response"], data["input"])

    def append_events(self, response_id: str, lines: list[bytes]) -> None:
        """Append `lines` (each one line, without its end) to the response's event log, creating it."""
        path = self._path(response_id)
        if path is None:
            raise ValueError(f"not a response id of this server: {response_id!r}")
        self._append(path.with_suffix(".events"), lines, os.O_CREAT)

    def read_events(self, response_id: str, offset: int) -> tuple[list[bytes], int] | None:
        """The whole lines of the response's event log from byte `offset` on, and the offset after them; None
        where it has no log."""
        path = self._path(response_id)
        return None if path is None else _read_lines(path.with_suffix(".events"), offset)

    # -- conversations: one log of records each, appended by any process ---------------------------------------

    def _conversation_path(self, conversation_id: str) -> Path | None:
        if not self.enabled or not CONVERSATION_ID.fullmatch(conversation_id):
            return None
        return self.directory / f"{conversation_id}.conversation"

    def create_conversation(self, conversation_id: str, lines: list[bytes]) -> None:
        """A new conversation's log holding `lines`."""
        path = self._conversation_path(conversation_id)
        if path is None:
            raise ValueError(f"not a conversation id of this server: {conversation_id!r}")
        self._append(path, lines, os.O_CREAT | os.O_EXCL)

    def append_conversation(self, conversation_id: str, lines: list[bytes]) -> bool:
        """Append `lines` to the conversation's log in one write; False where it is not stored (never created,
        deleted, or evicted: it is not created again)."""
        path = self._conversation_path(conversation_id)
        if path is None:
            return False
        try:
            self._append(path, lines, 0)
        except FileNotFoundError:
            return False
        return True

    def read_conversation(self, conversation_id: str) -> list[bytes] | None:
        """The whole lines of the conversation's log; None where it is not stored."""
        path = self._conversation_path(conversation_id)
        read = None if path is None else _read_lines(path, 0)
        return None if read is None else read[0]

    def delete_conversation(self, conversation_id: str) -> bool:
        path = self._conversation_path(conversation_id)
        if path is None:
            return False
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        return True

    def _append(self, path: Path, lines: list[bytes], flags: int) -> None:
        """Append `lines` to `path` (opened with `flags` besides appending) in one write."""
        data = b"".join(line + b"\n" for line in lines)
        # one write of an append-only file: a reader sees whole lines, and at worst the start of the last one;
        # readable by the server's user only, as the responses are
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | flags, 0o600)
        with os.fdopen(fd, "ab") as f:
            f.write(data)
        self._unscanned += len(data)
        if self._unscanned * _SCAN_SHARE >= self.max_bytes:
            self._evict()

    def delete(self, response_id: str) -> bool:
        path = self._path(response_id)
        if path is None:
            return False
        path.with_suffix(".cancel").unlink(missing_ok=True)
        path.with_suffix(".events").unlink(missing_ok=True)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        return True

    def request_cancel(self, response_id: str) -> None:
        """Leave a mark that asks the process running this background response to stop it."""
        path = self._path(response_id)
        if path is not None:
            path.with_suffix(".cancel").touch()

    def cancel_requested(self, response_id: str) -> bool:
        path = self._path(response_id)
        return path is not None and path.with_suffix(".cancel").exists()

    def clear_cancel(self, response_id: str) -> None:
        path = self._path(response_id)
        if path is not None:
            path.with_suffix(".cancel").unlink(missing_ok=True)

    def num_bytes(self) -> int:
        return sum(size for _, size, _ in self._entries())

    def _entries(self) -> list[tuple[int, int, list[Path]]]:
        """(last written, bytes, files) of every stored response (its event log included) and conversation; a
        file another process removes meanwhile is left out."""
        entries: dict[str, tuple[int, int, list[Path]]] = {}
        for entry in os.scandir(self.directory):
            stem, _, suffix = entry.name.rpartition(".")
            if suffix not in ("json", "events", "conversation"):
                continue
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue
            written, size, files = entries.get(stem, (0, 0, []))
            entries[stem] = (max(written, st.st_mtime_ns), size + st.st_size, [*files, Path(entry.path)])
        return list(entries.values())

    def _evict(self) -> None:
        self._unscanned = 0
        entries = self._entries()
        total = sum(size for _, size, _ in entries)
        if total <= self.max_bytes:
            return
        for _, size, files in sorted(entries):
            for path in files:
                path.unlink(missing_ok=True)
            total -= size
            if total <= self.max_bytes * _EVICT_TO:
                return

    def close(self) -> None:
        """Remove the folder if it is this store's own temporary one."""
        if self._owned and self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)


def _read_lines(path: Path, offset: int) -> tuple[list[bytes], int] | None:
    """The whole lines of `path` from byte `offset` on and the offset after them; None where there is no file."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return None
    whole = data[: data.rfind(b"\n") + 1]
    return whole.splitlines(), offset + len(whole)
