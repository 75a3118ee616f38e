"""A server-sent event is one line for every line reader, whatever text it carries, and decodes to what was sent."""

from __future__ import annotations

import json
import random

import msgspec
from httpx._decoders import LineDecoder

from lightllm.server.http.openai_api import _sse

# characters str.splitlines (and httpx's iter_lines) end a line at, besides ASCII controls JSON escapes anyway
UNICODE_BREAKS = ["\x85", "\u2028", "\u2029"]
OTHER = ["a", " ", "é", "中", "\U0001f600", "\n", "\r", "\x0b", "\x1c", '"', "\\", "\u2027", "\u202a"]


def _random_texts(n: int) -> list[str]:
    rng = random.Random()
    alphabet = UNICODE_BREAKS + OTHER
    return [
        "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) + rng.choice(UNICODE_BREAKS) for _ in range(n)
    ]


def _lines(event: bytes) -> tuple[list[str], list[str]]:
    text = event.decode()
    decoder = LineDecoder()
    return text.splitlines(), decoder.decode(text) + decoder.flush()


def test_an_event_is_one_line_for_every_reader_and_round_trips():
    for text in _random_texts(200):
        event = _sse({"choices": [{"index": 0, "text": text, "logprobs": None}]})
        assert event.startswith(b"data: ") and event.endswith(b"\n\n")
        for lines in _lines(event):
            assert [line for line in lines if line] == [event.decode().rstrip("\n")], repr(text)
        assert json.loads(event[len(b"data: ") :])["choices"][0]["text"] == text


def test_twin_json_alone_breaks_the_event_for_splitlines_readers():
    for text in _random_texts(20):
        plain = b"data: " + msgspec.json.encode({"text": text}) + b"\n\n"
        assert all(len([line for line in lines if line]) > 1 for lines in _lines(plain)), repr(text)
