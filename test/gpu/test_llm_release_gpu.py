"""GPU check of the offline `LLM`'s release: after `close()` the device memory the engine took (weights, KV cache
sized from free memory, state pools, CUDA graphs) is back, and a second `LLM` in the process gives the same
tokens; with two GPUs the same for `tp=2` (NCCL). Skipped without CUDA.

    python -m pytest -q test/gpu/test_llm_release_gpu.py
"""

from __future__ import annotations

import gc

import pytest
import torch

from lightllm import LLM, SamplingParams
from lightllm.tools.make_tiny_model import tiny_model_dir

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPT = [5, 6, 7, 8, 9, 31, 7]
# the CUDA context and cuBLAS/NCCL workspaces stay after the first engine; everything else must come back
SLACK_BYTES = 1 << 30


def free_bytes(devices: int) -> int:
    gc.collect()
    torch.cuda.synchronize()
    return sum(torch.cuda.mem_get_info(d)[0] for d in range(devices))


@pytest.mark.parametrize("tp", [1, 2])
def test_close_gives_the_memory_back_and_a_second_llm_matches(tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    model = str(tiny_model_dir("qwen3_next", dtype="bfloat16"))
    # a first engine creates the CUDA context and library workspaces, which stay for the process
    with LLM(model, tp=tp) as llm:
        expected = llm.generate([PROMPT], PARAMS)[0].outputs[0].token_ids
    baseline = free_bytes(tp)
    allocated = torch.cuda.memory_allocated()
    for _ in range(3):
        llm = LLM(model, tp=tp)
        # the KV cache is sized from free memory, so an engine that let nothing go would show here
        assert free_bytes(tp) < baseline - SLACK_BYTES
        assert llm.generate([PROMPT], PARAMS)[0].outputs[0].token_ids == expected
        llm.close()
        assert torch.cuda.memory_allocated() == allocated
        assert free_bytes(tp) > baseline - SLACK_BYTES
