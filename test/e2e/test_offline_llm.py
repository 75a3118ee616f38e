"""`from lightllm import LLM, SamplingParams` with the real runner on a tiny checkpoint, against transformers."""

from __future__ import annotations

import torch

from lightllm import LLM, SamplingParams
from lightllm.tools.make_tiny_model import tiny_model_dir
from unit_tests.helpers.asserts import ranks_match


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


def _prompt_logprob_error(entries, prompt: list[int], logp: torch.Tensor, num_top: int, shift: int = 0) -> float:
    """Largest gap between `entries` (RequestOutput.prompt_logprobs) and `logp` [T, V], transformers' log_softmax
    over the prompt, where token p is scored by the row of position p - 1 + shift; inf if a top id differs."""
    assert entries[0] is None and len(entries) == len(prompt)
    worst = 0.0
    for p in range(1, len(prompt)):
        row = logp[min(p - 1 + shift, len(prompt) - 1)]
        lp, top = entries[p]
        if [t for t, _ in top] != torch.topk(row, num_top).indices.tolist():
            return float("inf")
        worst = max(worst, abs(lp - float(row[prompt[p]])), *(abs(v - float(row[t])) for t, v in top))
    return worst


def test_llm_prompt_logprobs_match_transformers(hf_oracle):
    """Prompt log-probabilities over chunked prefills (several prompts per step, one longer than three chunks)
    equal log_softmax of transformers' logits; a prompt that extends a cached one is still scored from its start."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model_dir = str(tiny_model_dir("qwen3_5"))
        # a checkpoint pool that keeps the first request's checkpoints
        llm = LLM(
            model_dir, device="cpu", chunked_prefill_size=16, max_total_token_num=1024, prefix_cache_state_bytes=2**20
        )
        oracle = hf_oracle(model_dir)
        rng = torch.Generator().manual_seed(4)
        prompts = [torch.randint(0, llm.info.vocab_size, (n,), generator=rng).tolist() for n in (10, 12, 50)]
        first = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
        # this prompt starts with the first request's tokens, which it left in the prefix cache
        prompts.append(prompts[0] + first.outputs[0].token_ids + [5, 6, 7])
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=1, prompt_logprobs=4, n=2)
        outs = llm.generate(prompts, params)
        # the second sequences, which do not score their prompt, did resume from the cache
        assert llm.engine.runner.prefix_cache_stats()["num_hit_tokens"] > 0
    finally:
        torch.set_num_threads(previous)
    for prompt, out in zip(prompts, outs):
        # every position was computed, the cached ones of the last prompt included
        assert None not in out.prompt_logprobs[1:]
        logp = torch.log_softmax(oracle.prefill_logits(prompt)[0], dim=-1)
        assert _prompt_logprob_error(out.prompt_logprobs, prompt, logp, 4) < 1e-4
        # twin: the same entries against the logits one position later
        assert _prompt_logprob_error(out.prompt_logprobs, prompt, logp, 4, shift=1) > 1e-2
        assert ranks_match(out.prompt_ranks, prompt, logp)
        assert not ranks_match(out.prompt_ranks, prompt, logp, shift=1)
        assert out.outputs[0].token_ids == out.outputs[1].token_ids == oracle.greedy(prompt, 3)
    assert first.prompt_logprobs is None
