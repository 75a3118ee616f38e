"""Stop strings under overlapped MTP steps, through the offline `LLM` (the server's output path: the text is matched
as chunks arrive and the request is aborted when a stop string shows up): the chunk holding the stop string is read
back while the request's next window is already in flight, so the abort lands a step late and that window rides
along. With scripted drafts (keeping 0 .. W - 1, the same windows on and off), in every state mode and width, the
sequence ends on "stop" with the text cut before the stop string, the tokens and log-probabilities of the
synchronous run, and a sequence beside it without the stop string runs to its length limit unchanged. Twin: chained
steps fed their predecessor's tokens moved by one give another output."""

from __future__ import annotations

import pytest

from lightllm import LLM, SamplingParams
from unit_tests.models.conftest import case_dir
from unit_tests.models.test_device_drafts_engine import greedy_continuations
from unit_tests.models.test_spec_overlap_engine import script_drafts, shift_chained_tokens

# (request id, prompt): the first is cut by its stop string, the second runs to MAX_TOKENS
PROMPTS = [("s", [5, 6, 7, 8, 9]), ("d", [3, 1, 4, 1, 5, 9, 2, 6])]
MAX_TOKENS = 24
# the stop string: the first STOP_LEN printable characters of the first output's text from its middle on that
# appear nowhere before them, nor in the second output
STOP_LEN = 3


def _llm(mode: str, mtp_step: int, truth, overlap: bool, shift_tokens: bool = False):
    """An LLM whose engine runs decode and draft steps through the fixed buffers (eager on the CPU), with scripted
    drafts; and the request ids whose overlapped step was read back after they had finished (rode along)."""
    llm = LLM(
        case_dir("qwen3_5-hv2"),
        device="cpu",
        data_type="float32",
        ssm_state_mode=mode,
        mtp_step=mtp_step,
        max_running_requests=2,
        chunked_prefill_size=16,
        max_total_token_num=512,
        disable_cudagraph=False,
    )
    engine = llm.engine
    assert engine.runner.init_decode_graphs(use_graphs=False)
    engine.overlap_schedule = overlap
    script_drafts(engine, mtp_step, truth, [])
    spec, rode_along = engine.overlap.spec, []
    launch, complete = spec.launch, spec.complete

    def launching(plan, previous):
        if shift_tokens and previous is not None:
            shift_chained_tokens(previous, engine.runner.vocab_size)
        return launch(plan, previous)

    def reading(inflight):
        rode_along.extend(row.req.req_id for row in inflight.plan.decode if row.req.is_finished)
        return complete(inflight)

    spec.launch, spec.complete = launching, reading
    return llm, rode_along


def _generate(llm, stop: list[str]):
    outs = llm.generate(
        [p for _, p in PROMPTS],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1, stop=stop),
    )
    return [o.outputs[0] for o in outs]


def _stop_string(text: str, other: str) -> str:
    for start in range(len(text) // 2, len(text) - STOP_LEN):
        stop = text[start : start + STOP_LEN]
        if stop.isascii() and stop.isprintable() and text.index(stop) == start and stop not in other:
            return stop
    raise AssertionError(f"no stop string in {text!r}")


@pytest.fixture(scope="module")
def truth():
    # the greedy continuations the scripted drafts follow (the stop token greedy_continuations picks is not used)
    requests = [(rid, prompt, MAX_TOKENS, 0) for rid, prompt in PROMPTS]
    return greedy_continuations(requests=requests, num_tokens=MAX_TOKENS + 8, stop_at=0)[0]


def _same(a, b) -> bool:
    return (
        a.text == b.text
        and a.token_ids == b.token_ids
        and a.finish_reason == b.finish_reason
        and len(a.logprobs) == len(b.logprobs)
        and all(abs(x[0] - y[0]) <= 1e-5 for x, y in zip(a.logprobs, b.logprobs))
    )


@pytest.mark.parametrize("mtp_step", [1, 2, 3], ids=["W2", "W3", "W4"])
@pytest.mark.parametrize("mode", ["native", "compact", "replay"])
def test_a_stop_string_found_a_step_late_gives_the_synchronous_output(mode, mtp_step, truth):
    sync, _ = _llm(mode, mtp_step, truth, overlap=False)
    full = _generate(sync, [])
    stop = _stop_string(full[0].text, full[1].text)
    expected = _generate(sync, [stop])
    sync.close()
    overlapped, rode_along = _llm(mode, mtp_step, truth, overlap=True)
    got = _generate(overlapped, [stop])
    overlapped.close()
    assert all(_same(g, e) for g, e in zip(got, expected)), (got, expected)
    cut, other = got
    # cut before the stop string, the greedy tokens up to there
    assert cut.finish_reason == "stop" and cut.text == full[0].text[: full[0].text.index(stop)]
    assert cut.token_ids == full[0].token_ids[: len(cut.token_ids)] == truth[tuple(PROMPTS[0][1])][: len(cut.token_ids)]
    assert other.finish_reason == "length" and other.token_ids == full[1].token_ids
    # the stop string was read while the sequence's next window was in flight: that window rode along, dropped
    assert any(rid.endswith("-0-0") for rid in rode_along), rode_along


def test_twin_chained_steps_fed_shifted_tokens_give_another_output(truth):
    sync, _ = _llm("replay", 2, truth, overlap=False)
    full = _generate(sync, [])
    stop = _stop_string(full[0].text, full[1].text)
    expected = _generate(sync, [stop])
    sync.close()
    broken, _ = _llm("replay", 2, truth, overlap=True, shift_tokens=True)
    got = _generate(broken, [stop])
    broken.close()
    assert not all(_same(g, e) for g, e in zip(got, expected))
