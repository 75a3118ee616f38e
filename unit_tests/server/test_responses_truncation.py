"""`truncation: "auto"`'s cut, without a server: the longest tail of the conversation that starts at a user turn and
fits, against a brute-force search over random conversations; a conversation that fits is left whole; where nothing
fits, the last turn; a text known too long before tokenizing counts as not fitting."""

from __future__ import annotations

import asyncio
import random

from lightllm.server.http.responses_protocol import INPUT_ITEMS
from lightllm.server.http.responses_truncation import fitting_turns, turn_starts


def _conversation(rng: random.Random, turns: int) -> list:
    raw = []
    for t in range(turns):
        raw.append({"role": "user", "content": "u" * rng.randrange(1, 40)})
        if rng.random() < 0.4:
            raw.append({"type": "function_call", "call_id": f"c{t}", "name": "f", "arguments": "{}"})
            raw.append({"type": "function_call_output", "call_id": f"c{t}", "output": "o" * rng.randrange(1, 30)})
        if rng.random() < 0.3:
            raw.append({"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "r"}]})
        raw.append({"role": "assistant", "content": "a" * rng.randrange(1, 40)})
    return INPUT_ITEMS.validate_python(raw)


def _size(items) -> int:
    # a stand-in for the rendered prompt's length: a few tokens per item plus its text
    return sum(4 + len(item.model_dump_json()) // 8 for item in items)


def _fit(items, room: int, calls: list | None = None):
    async def prompt_len(tail):
        if calls is not None:
            calls.append(len(tail))
        return _size(tail)

    return asyncio.run(fitting_turns(items, prompt_len, room))


def test_the_cut_is_the_longest_fitting_tail_at_a_user_turn():
    rng = random.Random(5)
    for _ in range(200):
        items = _conversation(rng, rng.randrange(1, 12))
        room = rng.randrange(5, _size(items) + 20)
        starts = turn_starts(items)
        fitting = [c for c in starts if _size(items[c:]) <= room]
        expected = items[fitting[0] :] if fitting else items[starts[-1] :]
        calls = []
        got = _fit(items, room, calls)
        assert got == expected
        # bisection: about log2 of the turn count renders, not one per turn
        assert len(calls) <= 3 + len(starts).bit_length()
        first = got[0]
        assert first is items[0] or (first.type == "message" and first.role == "user")


def test_a_conversation_that_fits_is_whole_and_a_smaller_room_cuts_it():
    items = _conversation(random.Random(9), 6)
    assert _fit(items, _size(items)) == items
    # the twin: one token less and the first turn goes
    cut = _fit(items, _size(items) - 1)
    assert len(cut) < len(items) and cut == items[len(items) - len(cut) :]


def test_nothing_fits_gives_the_last_turn_and_too_long_text_does_not_fit():
    items = _conversation(random.Random(2), 5)
    assert _fit(items, 1) == items[turn_starts(items)[-1] :]

    async def unknown_until_short(tail):
        # texts of more than three turns are known too long before tokenizing
        return None if len(turn_starts(tail)) > 3 else _size(tail)

    got = asyncio.run(fitting_turns(items, unknown_until_short, 10**6))
    assert len(turn_starts(got)) == 3 and got == items[turn_starts(items)[2] :]
