"""`from lightllm import LLM, SamplingParams` with the real runner on a tiny checkpoint, against transformers."""

from __future__ import annotations

import torch

from lightllm import LLM, SamplingParams
from lightllm.tools.make_tiny_model import tiny_model_dir


def test_llm_generate_matches_transformers(hf_oracle):
    # one OpenMP thread: tiny forwards on a shared CPU (see unit_tests/server/live_server.py)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _check(hf_oracle)
    finally:
        torch.set_num_threads(previous)


def _check(hf_oracle):
    model_dir = str(tiny_model_dir("qwen3_5"))
    llm = LLM(model_dir, device="cpu", ssm_state_mode="replay", mtp_step=2, max_total_token_num=1024)
    oracle = hf_oracle(model_dir)
    prompts = ["Linear attention keeps", [7, 8, 9, 10]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for out in outs:
        expected = oracle.greedy(out.prompt_token_ids, 12)
        assert out.outputs[0].token_ids == expected
        assert out.outputs[0].text == llm.tokenizer.decode(expected)
    assert outs[0].prompt == "Linear attention keeps" and outs[1].prompt is None


def test_llm_stop_string_cuts_the_buffered_text():
    """Sequences without stop strings build their text at finish; one with a stop string is cut where the stop
    first appears, with the same tokens up to there."""
    llm = LLM(str(tiny_model_dir("qwen3_5")), device="cpu", max_total_token_num=1024)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = llm.generate([[7, 8, 9, 10]], params)[0].outputs[0]
    assert full.text == llm.tokenizer.decode(full.token_ids) and len(full.text) > 6
    stop = full.text[3:6]
    cut = llm.generate([[7, 8, 9, 10]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))
    out = cut[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == full.text[: full.text.index(stop)]
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
