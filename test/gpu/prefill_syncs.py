"""Where the host waits for the GPU while prefill-heavy steps run: the tiny Qwen3.5 checkpoint on CUDA, replay,
prompts of mixed lengths (one longer than a 2048-token step budget, so a row spans steps), one warm pass, then the
same workload under CUDA's sync debug mode with every synchronizing call counted by its calling line in lightllm or
fla. The steps' own read-back of their tokens is expected (one per step, in `overlap.py`); anything else is a wait
the overlap cannot hide.

    python test/gpu/prefill_syncs.py
"""

from __future__ import annotations

import collections
import traceback
import warnings

import torch

from lightllm import LLM, SamplingParams
from lightllm.tools.make_tiny_model import tiny_model_dir


def main() -> None:
    llm = LLM(
        str(tiny_model_dir("qwen3_5")),
        device="cuda",
        ssm_state_mode="replay",
        max_running_requests=16,
        max_req_total_len=3000,
        max_num_batched_tokens=2048,
    )
    gen = torch.Generator().manual_seed(0)
    vocab = llm.engine.runner.vocab_size

    def prompts():
        return [torch.randint(3, vocab - 3, (n,), generator=gen).tolist() for n in (300, 50, 1000, 2100, 7, 640)]

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.generate(prompts(), params)
    sites: collections.Counter[str] = collections.Counter()

    def count(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "lightllm" in f.filename or "/fla/" in f.filename]
        site = f"{frames[-1].filename.rsplit('/', 3)[-3:]}:{frames[-1].lineno} {frames[-1].name}" if frames else "?"
        sites[site] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = count
        torch.cuda.set_sync_debug_mode("warn")
        try:
            llm.generate(prompts(), params)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    print(f"{llm.engine.stats.num_steps} steps so far; synchronizing calls by site:")
    for site, n in sites.most_common(20):
        print(f"  {n:5d}  {site}")
    llm.close()


if __name__ == "__main__":
    main()
