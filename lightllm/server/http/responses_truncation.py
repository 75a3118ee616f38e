"""`truncation: "auto"` of the Responses API: a conversation too long for the context is served without its oldest
turns, as OpenAI's API does (the items dropped from its beginning).

Turns are cut only where a user message starts one, so that no function call loses its output, no output its call,
and no reasoning its answer. The cut is the earliest at which the rendered prompt plus `max_output_tokens` fits
`--max_req_total_len`, found by bisection over the cut points (a render each). Where not even the last turn alone
fits, the request is served from that turn and gets the usual 400 saying how long the prompt is.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from lightllm.server.http.responses_protocol import InputItem, MessageItem
from lightllm.server.http.serving import PromptTooLong


def turn_starts(items: list[InputItem]) -> list[int]:
    """Where the conversation may be cut: its start, and every user message after it."""
    return [0] + [i for i, item in enumerate(items) if i and isinstance(item, MessageItem) and item.role == "user"]


async def fitting_turns(
    items: list[InputItem], prompt_len: Callable[[list[InputItem]], Awaitable[int | None]], room: int
) -> list[InputItem]:
    """The longest tail of `items` cut at a turn start whose prompt fits `room` tokens (`prompt_len`: its length,
    None when it is known too long before tokenizing); the last turn where none fits."""

    async def fits(cut: int) -> bool:
        n = await prompt_len(items[cut:])
        return n is not None and n <= room

    starts = turn_starts(items)
    if await fits(starts[0]):
        return items
    lo, hi = 1, len(starts) - 1  # the earliest fitting cut is in starts[lo..hi], or none fits
    if hi < lo or not await fits(starts[hi]):
        return items[starts[-1] :]
    while lo < hi:
        mid = (lo + hi) // 2
        if await fits(starts[mid]):
            hi = mid
        else:
            lo = mid + 1
    return items[starts[lo] :]


async def rendered_len(render: Callable[[list[InputItem]], Awaitable[list[int]]], items: list[InputItem]) -> int | None:
    """`render(items)`'s length, None where its text is already too long to tokenize."""
    try:
        return len(await render(items))
    except PromptTooLong:
        return None
