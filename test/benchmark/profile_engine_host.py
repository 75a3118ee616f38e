"""Where an engine step's host time goes: wall time per decode step of each engine phase, on any device.

    python test/benchmark/profile_engine_host.py --mode replay --batch 256 [--mtp_step 2] [--device cpu]
    python test/benchmark/profile_engine_host.py --serving_model --device cuda --mode replay --batch 256 --top_ops 25

Runs the engine on the tiny demo model (or `--model_dir`) with `batch` requests decoding together, through the
same fixed-buffer decode path the CUDA graphs use, and times each phase by wrapping it: the scheduler, building the
batch, the runner's forward (on the CPU this includes the model's arithmetic, which is why the model is tiny),
verification, accept, an overlapped MTP step's one runner call (`verify_on_device`), emitting tokens and the whole
of `_process`. On the CPU the phases other than `forward` and `verify_on_device` are the host work a GPU step also
pays; the table prints milliseconds per step, medians of `--steps` steps.

On CUDA the forward and `verify_on_device` are followed by a synchronize timed as `gpu_wait` (the GPU work still
queued when the host finished launching), so `forward` is the host's launch cost alone; `--top_ops N` adds the
torch profiler's N most expensive host-side operators per step (self CPU time, with their counts: kernel launches,
copies, driver queries), which names what the launch cost is made of, and `--by_caller N` the N engine and runner
functions that make the most torch calls per step outside the model's modules (calls a CUDA graph replays are not
counted: they are not made from Python; on the CPU the buffers' forwards run eagerly, so their context building
counts). With `--mtp_step`, `--simulate_acceptance P` keeps each draft with probability
P (as `bench_throughput`'s option), so overlapped verify steps accept a controlled number of tokens.
`--host_only` takes the model's work out (forward passes return zeros; each fixed-buffer graph body runs once per
bucket and its outputs are replayed), so that on the CPU a step costs about the host work a GPU step pays: the way
to compare two trees' host paths without a GPU.

    python test/benchmark/profile_engine_host.py --serving_model --device cuda --mode replay --batch 64 \
        --mtp_step 3 --simulate_acceptance 0.7 --top_ops 18 --by_caller 20
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
from lightllm.engine.speculative.acceptance import SimulatedAcceptance
from lightllm.server.args import load_server_args
from lightllm.server.collector import quiet_garbage_collector
from lightllm.server.engine_process import build_engine
from lightllm.server.runner_factory import DEFAULT_RUNNER_FACTORY

PHASES = (
    ("scheduler", "schedule"),
    ("engine", "build_batch"),
    ("runner", "forward"),
    ("runner", "verify_on_device"),
    ("engine", "_verify_greedy"),
    ("runner", "accept"),
    ("engine", "emit"),
    ("engine", "_process"),
)


def _timed(owner, name: str, totals: dict[str, float], sync: bool = False) -> None:
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            t1 = time.perf_counter()
            totals[name] = totals.get(name, 0.0) + t1 - t0
            if sync:
                torch.cuda.synchronize()
                totals["gpu_wait"] = totals.get("gpu_wait", 0.0) + time.perf_counter() - t1

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
    p.add_argument("--serving_model", action="store_true", help="the real-width random checkpoint of bench_throughput")
    p.add_argument("--top_ops", type=int, default=0, help="print the N host operators with the most self CPU time")
    p.add_argument("--by_caller", type=int, default=0, help="print the N callers making the most torch calls")
    p.add_argument("--simulate_acceptance", type=float, default=None, metavar="P")
    p.add_argument(
        "--host_only",
        action="store_true",
        help="no model work: forward passes return zeros and the fixed-buffer graphs replay their first outputs",
    )
    a = p.parse_args(argv)
    # enough tokens for every measured step (a verify step emits up to mtp_step + 1 per row)
    num_tokens = (a.mtp_step + 1) * (2 * a.steps + 8) + 3 * a.steps
    torch.set_num_threads(1)
    model_dir = a.model_dir
    if a.serving_model:
        from lightllm.tools.bench_throughput import serving_model_dir

        model_dir = serving_model_dir()
    args, info = load_server_args(
        [],
        model_dir=model_dir,
        device=a.device,
        ssm_state_mode=a.mode,
        mtp_step=a.mtp_step,
        spec_ngram=a.spec_ngram,
        max_running_requests=a.batch,
        max_req_total_len=64 + num_tokens + 16,
        chunked_prefill_size=64 * a.batch,
        max_total_token_num=a.batch * (64 + num_tokens + 16),
    )
    acceptance = None if a.simulate_acceptance is None else SimulatedAcceptance(a.simulate_acceptance)
    engine = build_engine(args, info, DEFAULT_RUNNER_FACTORY, acceptance)
    if a.host_only:
        _stub_model(engine.runner.model)
    if engine.runner.decode_graphs is None:
        engine.runner.init_decode_graphs(use_graphs=a.device == "cuda")
    if a.host_only and a.device == "cpu":
        _replay_first_outputs(engine.runner)
    quiet_garbage_collector()
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    for i in range(a.batch):
        engine.add_request(NewRequest(f"r{i}", rng.integers(10, info.vocab_size - 10, 64).tolist(), params))
    while any(r.is_prefilling for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    totals: dict[str, float] = {}
    for owner_name, name in PHASES:
        owner = {"scheduler": engine.scheduler, "engine": engine, "runner": engine.runner}[owner_name]
        _timed(owner, name, totals, sync=name in ("forward", "verify_on_device") and a.device == "cuda")
    names = [name for _, name in PHASES] + (["gpu_wait"] if a.device == "cuda" else [])
    per_step: dict[str, list[float]] = {name: [] for name in names}
    steps = []
    for _ in range(a.steps):
        totals.clear()
        t0 = time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - t0) * 1000)
        for name in names:
            per_step[name].append(totals.get(name, 0.0) * 1000)
    gc.collect()
    result = {name: statistics.median(v) for name, v in per_step.items()}
    result["step"] = statistics.median(steps)
    print(f"| {a.mode} | mtp {a.mtp_step} | batch {a.batch} | {a.device} | ms per decode step (median of {a.steps}) |")
    print("|---|---|")
    for name, value in result.items():
        print(f"| {name} | {value:.3f} |")
    if a.top_ops:
        _print_top_ops(engine, a.steps, a.top_ops)
    if a.by_caller:
        result["torch_calls"] = _print_by_caller(engine, a.steps, a.by_caller)
    return result


def _stub_model(model) -> None:
    """The model's and the MTP head's forward return zeros of their output's shape (the LM head still runs)."""
    hidden, dtype = model.cfg.hidden_size, model.embed.dtype
    model.forward = lambda input_ids, ctx: torch.zeros(input_ids.shape[0], hidden, dtype=dtype)
    if model.mtp is not None:
        model.mtp.forward = lambda token_embeds, h, ctx: torch.zeros_like(h)


def _replay_first_outputs(runner) -> None:
    """Each fixed-buffer step body (decode, MTP draft, overlapped MTP step) runs once per bucket and returns those
    outputs after, as a CUDA graph's replay returns its buffers without host work: with `_stub_model` a CPU step
    then costs the host work a GPU step pays (its Python and the launches outside the graphs). The outputs repeat
    (the same counts and tokens every step), which is all the host's bookkeeping needs."""
    sets = [runner.decode_graphs, getattr(runner.drafter, "graphs", None), runner.spec_step_graphs]
    for graphs in (g._graphs for g in sets if g is not None):
        first: dict[int, object] = {}

        def run(rows, graphs=graphs, first=first, body=graphs.run):
            if rows not in first:
                first[rows] = body(rows)
            return first[rows]

        graphs.run = run


def _print_top_ops(engine, steps: int, top: int) -> None:
    """The host operators (and Python-level ranges) with the most self CPU time, per step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    print("| host operator | calls per step | self CPU ms per step |")
    print("|---|---|---|")
    for e in rows:
        print(f"| {e.key} | {e.count / steps:.1f} | {e.self_cpu_time_total / 1000 / steps:.3f} |")


# the model's modules: calls made inside a forward (eager on the CPU, replayed from a graph on CUDA) are not counted
_MODEL_PATHS = ("lightllm/models/", "lightllm/linear_att/", "lightllm/kernels/")


def _print_by_caller(engine, steps: int, top: int) -> float:
    """Torch calls per step made from Python outside the model's modules, by calling function; returns the total."""
    import collections
    import sys

    from torch.overrides import TorchFunctionMode

    counts: collections.Counter = collections.Counter()

    class _Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            frame = sys._getframe(1)
            while frame is not None and "/torch/" in frame.f_code.co_filename:
                frame = frame.f_back
            caller, outer = frame, frame
            while outer is not None and not any(m in outer.f_code.co_filename for m in _MODEL_PATHS):
                outer = outer.f_back
            if caller is not None and outer is None:
                name = caller.f_code.co_filename.split("lightllm/")[-1]
                counts[f"{name}:{caller.f_code.co_name}"] += 1
            return func(*args, **(kwargs or {}))

    with _Count():
        for _ in range(steps):
            engine.step()
    total = sum(counts.values()) / steps
    print(f"| torch calls per step outside the model: {total:.1f} | calls per step |")
    print("|---|---|")
    for name, n in counts.most_common(top):
        print(f"| {name} | {n / steps:.1f} |")
    return total


if __name__ == "__main__":
    main()
