"""Reading a Responses API stream in tests: each server-sent event's name, and its data validated against the
openai SDK's event types."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator

from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

EVENTS = TypeAdapter(ResponseStreamEvent)


def stream_events(lines: Iterable[str]) -> Iterator[tuple[str, dict]]:
    """(the `event:` name, the parsed data) of each server-sent event of `lines`; the name must be the data's type
    and the data one of the SDK's events."""
    name = None
    for line in lines:
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            event = json.loads(line[len("data: ") :])
            assert name == event["type"], (name, event["type"])
            EVENTS.validate_python(event)
            yield name, event
            name = None
