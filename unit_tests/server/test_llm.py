"""Offline `LLM` / `SamplingParams` API over the fake runner."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lightllm import LLM, SamplingParams
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
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 5
