"""Where start-up time goes: builds the offline engine on a checkpoint under cProfile and prints the phases and the
functions that took the most time (cumulative and own), so a start-up change is aimed at measured time.

    python test/gpu/startup_profile.py [--model_dir DIR | (default) the serving checkpoint] [--out startup.prof]

Runs on CPU too (`--tiny`: the tiny demo model), where the numbers only show the shape of the work.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model_dir", default=None)
    p.add_argument("--tiny", action="store_true", help="the tiny demo model on the CPU")
    p.add_argument("--ssm_state_mode", default="replay")
    p.add_argument("--out", default=None, help="write the raw profile here (pstats format)")
    p.add_argument("--top", type=int, default=30)
    a = p.parse_args()
    t0 = time.perf_counter()
    import torch

    if not torch.cuda.is_available() and not a.tiny:
        print("startup_profile: no CUDA device; skipped (use --tiny for a CPU run)")
        return

    from lightllm import LLM, SamplingParams
    from lightllm.tools.bench_throughput import serving_model_dir

    t_import = time.perf_counter() - t0
    model_dir = a.model_dir or (None if a.tiny else serving_model_dir())
    device = "cpu" if a.tiny else "cuda"
    profile = cProfile.Profile()
    t1 = time.perf_counter()
    profile.enable()
    llm = LLM(model_dir, ssm_state_mode=a.ssm_state_mode, device=device, max_running_requests=64)
    profile.disable()
    t_build = time.perf_counter() - t1
    t2 = time.perf_counter()
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4))
    t_first = time.perf_counter() - t2
    llm.close()
    print(f"imports {t_import:.1f} s, engine build {t_build:.1f} s, first request {t_first:.2f} s")
    if a.out:
        profile.dump_stats(a.out)
    for key in ("cumulative", "tottime"):
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats(key).print_stats(a.top)
        lines = text.getvalue().splitlines()
        start = next(i for i, line in enumerate(lines) if "ncalls" in line)
        print(f"== top {a.top} by {key}")
        print("\n".join(line[:200] for line in lines[start : start + a.top + 1]))


if __name__ == "__main__":
    main()
