"""Greedy continuation through the runner equals transformers' greedy stream, in every state mode.

Every mode is driven with verify windows of width 2 (`[last token, draft]`, the draft taken from the
transformers stream, deliberately wrong every fourth step so partial acceptance happens) mixed with plain
width-1 decode steps; the accepted tokens must reproduce the reference stream exactly."""

from __future__ import annotations

import pytest

from unit_tests.models.conftest import ARCH_CASES
from unit_tests.models.drive import make_runner, prefill, verify

NEW_TOKENS = 64
_streams: dict[str, tuple[list[int], list[int]]] = {}


def reference(case: str, tiny) -> tuple[list[int], list[int]]:
    if case not in _streams:
        _, oracle = tiny(case)
        prompt = [(37 * i + 11) % 450 for i in range(12)]
        _streams[case] = (prompt, oracle.greedy(prompt, NEW_TOKENS))
    return _streams[case]


@pytest.mark.parametrize("mode", ["native", "compact", "replay"])
@pytest.mark.parametrize("case", ARCH_CASES)
def test_greedy_stream_matches_transformers(tiny, case, mode):
    model_dir, _ = tiny(case)
    prompt, expected = reference(case, tiny)
    runner = make_runner(model_dir, mode=mode, max_width=2, replay_capacity=4)
    h = runner.add_request()
    out = [int(prefill(runner, h, prompt).argmax())]
    step = 0
    while len(out) < NEW_TOKENS:
        step += 1
        if step % 5 == 0:
            window = [out[-1]]
        elif step % 4 == 0:
            # a wrong draft: only the first token of the window can be accepted
            window = [out[-1], (expected[len(out)] + 1) % 450]
        else:
            window = [out[-1], expected[len(out)]]
        logits = verify(runner, h, window)
        first = int(logits[0].argmax())
        accepted = 1
        out.append(first)
        if len(window) == 2 and window[1] == first:
            accepted = 2
            out.append(int(logits[1].argmax()))
        runner.accept([h], [accepted])
        assert out == expected[: len(out)], f"{case}/{mode}: diverged at generated token {len(out) - 1} (step {step})"
    assert out[:NEW_TOKENS] == expected
