"""Where an engine step's host time goes: wall time per decode step of each engine phase, on any device.

    python test/benchmark/profile_engine_host.py --mode replay --batch 256 [--mtp_step 2] [--device cpu]

Runs the engine on the tiny demo model (or `--model_dir`) with `batch` requests decoding together, through the
same fixed-buffer decode path the CUDA graphs use, and times each phase by wrapping it: the scheduler, building the
batch, the runner's forward (on the CPU this includes the model's arithmetic, which is why the model is tiny),
verification, accept, emitting tokens and the whole of `_process`. On the CPU the phases other than `forward` are
the host work a GPU step also pays; the table prints milliseconds per step, medians of `--steps` steps.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import numpy as np
import torch

from lightllm.engine.messages import NewRequest
from lightllm.engine.sampling_params import SamplingParams
from lightllm.server.args import load_server_args
from lightllm.server.engine_process import build_engine, quiet_garbage_collector
from lightllm.server.runner_factory import DEFAULT_RUNNER_FACTORY

PHASES = (
    ("scheduler", "schedule"),
    ("engine", "_build_batch"),
    ("runner", "forward"),
    ("engine", "_verify_greedy"),
    ("runner", "accept"),
    ("engine", "_emit"),
    ("engine", "_process"),
)


def _timed(owner, name: str, totals: dict[str, float]) -> None:
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[name] = totals.get(name, 0.0) + time.perf_counter() - t0

    setattr(owner, name, wrapper)


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model_dir", default=None)
    p.add_argument("--mode", default="replay", choices=("native", "compact", "replay"))
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--mtp_step", type=int, default=0)
    p.add_argument("--spec_ngram", type=int, default=0)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    args, info = load_server_args(
        [], model_dir=a.model_dir, device=a.device, ssm_state_mode=a.mode, mtp_step=a.mtp_step,
        spec_ngram=a.spec_ngram, max_running_requests=a.batch, max_req_total_len=64 + 2 * a.steps + 16,
        chunked_prefill_size=64 * a.batch, max_total_token_num=a.batch * (64 + 2 * a.steps + 16),
    )  # fmt: skip
    engine = build_engine(args, info, DEFAULT_RUNNER_FACTORY)
    if engine.runner.decode_graphs is None:
        engine.runner.init_decode_graphs(use_graphs=a.device == "cuda")
    quiet_garbage_collector()
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=2 * a.steps + 8, ignore_eos=True)
    for i in range(a.batch):
        engine.add_request(NewRequest(f"r{i}", rng.integers(10, info.vocab_size - 10, 64).tolist(), params))
    while any(r.is_prefilling for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    totals: dict[str, float] = {}
    for owner_name, name in PHASES:
        owner = {"scheduler": engine.scheduler, "engine": engine, "runner": engine.runner}[owner_name]
        _timed(owner, name, totals)
    per_step: dict[str, list[float]] = {name: [] for _, name in PHASES}
    steps = []
    for _ in range(a.steps):
        totals.clear()
        t0 = time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - t0) * 1000)
        for _, name in PHASES:
            per_step[name].append(totals.get(name, 0.0) * 1000)
    gc.collect()
    result = {name: statistics.median(v) for name, v in per_step.items()}
    result["step"] = statistics.median(steps)
    print(f"| {a.mode} | mtp {a.mtp_step} | batch {a.batch} | {a.device} | ms per decode step (median of {a.steps}) |")
    print("|---|---|")
    for name, value in result.items():
        print(f"| {name} | {value:.3f} |")
    return result


if __name__ == "__main__":
    main()
