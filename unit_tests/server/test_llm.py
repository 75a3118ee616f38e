"""Offline `LLM` / `SamplingParams` API over the fake runner."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lightllm import LLM, SamplingParams, StructuredOutputsParams
from lightllm.server.http.structured import constraint_grammar
from unit_tests.engine.fake_runner import FakeRunner
from unit_tests.server.live_server import FAKE_RUNNER


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(runner_factory=FAKE_RUNNER, device="cpu", spec_ngram=2, max_total_token_num=2048)


def test_import_lightllm_is_light():
    code = "import sys, lightllm; print(any(m in sys.modules for m in ('torch', 'transformers', 'fastapi')))"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )


def test_generate_text_and_ids_match_reference(llm):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(["first prompt", "second, longer prompt"], params)
    assert len(outs) == 2
    for out in outs:
        expected = FakeRunner(llm.info.vocab_size).greedy(out.prompt_token_ids, 20)
        assert out.outputs[0].token_ids == expected
        assert out.outputs[0].text == llm.tokenizer.decode(expected)
        assert out.outputs[0].finish_reason == "length"


def test_generate_token_id_prompt_and_n(llm):
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=8, ignore_eos=True))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    again = llm.generate([[1, 2, 3]], SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=8, ignore_eos=True))[0]
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in again.outputs]


def test_generate_stop_string(llm):
    full = llm.generate("abc", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0].text
    stop = full[8:10]
    out = llm.generate("abc", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert out.text == full[: full.index(stop)] and out.finish_reason == "stop"
    assert llm.engine.has_work() is False


def test_generate_refuses_bad_prompt(llm):
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate("x", SamplingParams(max_tokens=10**6))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=2.0)


def test_params_changed_after_construction_are_checked_again(llm):
    params = SamplingParams(max_tokens=2, logit_bias={3: 1.0})
    params.logit_bias = {"3": 1.0}
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate("x", params)
    params.logit_bias = {3: 1.0}
    assert len(llm.generate("x", params)[0].outputs[0].token_ids) == 2


def test_chat(llm):
    (out,) = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 5


def _rendered(llm, messages, **kwargs) -> list[int]:
    return llm.tokenizer.encode_rendered(llm.tokenizer.render_chat(messages, **kwargs))


def test_chat_takes_vllms_switches_and_a_batch_of_conversations(llm):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    asked = [{"role": "user", "content": "Count to five."}]
    begun = [*asked, {"role": "assistant", "content": "1, 2,"}]
    (plain,) = llm.chat(asked, params, chat_template_kwargs={"enable_thinking": False})
    (continued,) = llm.chat(begun, params, add_generation_prompt=False, continue_final_message=True)
    # each conversation rendered as the template renders it with those switches, and decoded from there
    assert plain.prompt_token_ids == _rendered(llm, asked, enable_thinking=False)
    assert continued.prompt_token_ids == _rendered(llm, begun, add_generation_prompt=False, continue_final_message=True)
    assert llm.tokenizer.decode(continued.prompt_token_ids).endswith("assistant\n1, 2,")
    for out in (plain, continued):
        assert out.outputs[0].token_ids == FakeRunner(llm.info.vocab_size).greedy(out.prompt_token_ids, 6)
    # twins: without the switches the prompt differs (thinking left on; the reply closed and a new turn opened)
    (thinking,) = llm.chat(asked, params)
    assert thinking.prompt_token_ids == _rendered(llm, asked) != plain.prompt_token_ids
    (reopened,) = llm.chat(begun, params)
    assert reopened.prompt_token_ids == _rendered(llm, begun) != continued.prompt_token_ids
    # a batch gives one output per conversation, each the one a single call gives
    batch = llm.chat([asked, begun], params)
    assert [b.prompt_token_ids for b in batch] == [thinking.prompt_token_ids, reopened.prompt_token_ids]
    assert [b.outputs[0].token_ids for b in batch] == [thinking.outputs[0].token_ids, reopened.outputs[0].token_ids]


def test_chat_refuses_a_continuation_it_cannot_render(llm):
    asked = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="set add_generation_prompt to false"):
        llm.chat([*asked, {"role": "assistant", "content": "he"}], continue_final_message=True)
    with pytest.raises(ValueError, match="the last message must be the assistant's"):
        llm.chat(asked, add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(ValueError, match="at least one message"):
        llm.chat([asked, []])


def test_structured_outputs_constrain_offline_as_over_http(llm):
    """vLLM's `SamplingParams(structured_outputs=StructuredOutputsParams(...))`: each constraint's output obeys it
    and equals the output of the grammar the HTTP route compiles for it (same seed); the twin without a
    constraint writes something else."""
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    schema["additionalProperties"] = False
    cases = {
        "choice": (["alpha", "beta"], lambda t: t in ("alpha", "beta")),
        "regex": ("[0-9]{3}", lambda t: len(t) == 3 and t.isdigit()),
        "json": (schema, lambda t: isinstance(json.loads(t)["a"], bool)),
        "grammar": ('start: "x" "y"+', lambda t: t.startswith("xy") and set(t[1:]) == {"y"}),
    }
    knobs = dict(temperature=1.0, seed=4, max_tokens=40)
    for kind, (value, valid) in cases.items():
        params = SamplingParams(**knobs, structured_outputs=StructuredOutputsParams(**{kind: value}))
        text = llm.generate("Answer:", params)[0].outputs[0].text
        assert valid(text), (kind, text)
        explicit = SamplingParams(**knobs, grammar=constraint_grammar(kind, value, llm.tokenizer.whole_tokens))
        assert llm.generate("Answer:", explicit)[0].outputs[0].text == text, kind
    free = llm.generate("Answer:", SamplingParams(**knobs))[0].outputs[0].text
    assert free not in ("alpha", "beta")


def test_structured_outputs_in_chat_start_after_the_reasoning_block(llm):
    """A conversation whose template opens `<think>` keeps the block free: the fake model never closes it, so its
    output is unconstrained; with thinking off the output is constrained from its first token."""
    asked = [{"role": "user", "content": "Pick one."}]
    params = SamplingParams(
        temperature=1.0, seed=2, max_tokens=12, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
    )
    (off,) = llm.chat(asked, params, chat_template_kwargs={"enable_thinking": False})
    assert off.outputs[0].text in ("yes", "no")
    (on,) = llm.chat(asked, params)
    assert llm.tokenizer.decode(on.prompt_token_ids, skip_special_tokens=False).rstrip().endswith("<think>")
    assert on.outputs[0].text not in ("yes", "no") and len(on.outputs[0].token_ids) == 12


def test_structured_outputs_refusals_name_the_problem(llm):
    for wrong in ({"regex": "a", "choice": ["b"]}, {"choice": "ab"}, {"choice": ["a", 3]}, {"json_object": False}):
        with pytest.raises(ValueError, match="exactly one of json"):
            SamplingParams(structured_outputs=StructuredOutputsParams(**wrong))
    with pytest.raises(ValueError, match=r"structured_outputs\.regex"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")))
    with pytest.raises(ValueError, match="ignore_eos"):
        llm.generate("x", SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputsParams(regex="a")))
    begun = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "he"}]
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a"]))
    with pytest.raises(ValueError, match="continue_final_message: cannot be combined with structured_outputs"):
        llm.chat(begun, params, add_generation_prompt=False, continue_final_message=True)


def test_bad_words_and_allowed_token_ids_offline_as_over_http(llm):
    """`bad_words` are tokenized by `LLM` as the HTTP front-end does: the output never holds a spelling of the word
    that its free greedy output holds (twin: the free output); allowed_token_ids keep every token to the set, and
    with a grammar they are refused."""
    params = dict(temperature=0, max_tokens=24, ignore_eos=True)
    free = llm.generate("abc", SamplingParams(**params))[0].outputs[0]
    word = llm.tokenizer.decode(free.token_ids[2:4]).strip()
    spellings = [llm.tokenizer.encode_rendered(t) for t in (word, " " + word)]

    def holds(ids, seq):
        return any(ids[i : i + len(seq)] == seq for i in range(len(ids)))

    assert any(holds(free.token_ids, s) for s in spellings)
    banned = llm.generate("abc", SamplingParams(bad_words=[word], **params))[0].outputs[0]
    assert not any(holds(banned.token_ids, s) for s in spellings)
    assert banned.token_ids[:2] == free.token_ids[:2]
    allowed = sorted(set(range(5, 60, 3)) - set(free.token_ids[:1]))
    limited = llm.generate("abc", SamplingParams(allowed_token_ids=allowed, **params))[0].outputs[0]
    assert set(limited.token_ids) <= set(allowed) and limited.token_ids != free.token_ids
    with pytest.raises(ValueError, match="allowed_token_ids: cannot be combined with constrained output"):
        llm.generate("x", SamplingParams(allowed_token_ids=[3], structured_outputs=StructuredOutputsParams(regex="a")))
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=[" "])


def test_thinking_token_budget_offline_fills_the_reasoning_tokens(llm):
    """A prompt ending inside a reasoning block: with a budget of 2 the fake model's greedy output takes the
    tokenizer's </think> third (twin: without the budget its own third token)."""
    think, end = llm.tokenizer.encode_rendered("<think>"), llm.tokenizer.encode_rendered("</think>")
    prompt = [5, 6] + think
    params = dict(temperature=0, max_tokens=6, ignore_eos=True)
    runner = FakeRunner(llm.info.vocab_size)
    expected = runner.greedy(prompt, 2) + end
    expected += runner.greedy(prompt + expected, 6 - len(expected))
    out = llm.generate([prompt], SamplingParams(thinking_token_budget=2, **params))[0].outputs[0]
    assert out.token_ids == expected
    free = llm.generate([prompt], SamplingParams(**params))[0].outputs[0]
    assert free.token_ids == runner.greedy(prompt, 6) != expected
