"""Offline throughput of the engine per state mode, with each decode step split into GPU time and host time.

    python -m lightllm.tools.bench_throughput --modes native,replay --batch_sizes 1,64,256 --mtp_step 0 \
        [--model_dir DIR | --serving_model] [--input_len 256] [--output_len 128] [--result_file out.json] \
        [--simulate_acceptance 0.7]

Without `--model_dir` it runs the tiny demo model; `--serving_model` builds (once, cached) the random-weight
checkpoint the project's serving numbers are measured on (`SERVING_BENCH_SIZES`: Qwen3.5 layout at hidden 2048,
8 layers). For each mode and batch size it submits `batch` random prompts at once (greedy, fixed lengths) and
reports output tokens per second over the whole run (prefill included), decode tokens per second and the median
wall time of a decode-only step, and on CUDA the
kernel time per decode step (torch profiler over steady steps) and the rest of the step (host time not hidden
behind the GPU), and the share of decode steps left in flight while the host read the one before (overlap
scheduling, MTP verify steps included). Under each row it prints where the run's wall time went: decode-only
steps and the others (prefill and mixed steps, the last read-backs). Each mode is one engine; its batch sizes
share it.

`--simulate_acceptance P` (with `--mtp_step` or `--spec_ngram`) makes the verifier keep each draft position with
probability P whatever the model says (seeded by `--seed`; `engine.speculative.acceptance`), so the speed of
speculation can be measured at a chosen acceptance on random weights. The tokens are then not the model's
greedy output; the option exists here only, never as a server flag.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import numpy as np
import torch

from lightllm.engine.messages import Finished, NewRequest, TokenChunk
from lightllm.engine.sampling_params import SamplingParams
from lightllm.engine.speculative.acceptance import SimulatedAcceptance
from lightllm.models.quant_config import QUANTIZATION_CHOICES
from lightllm.server.args import load_server_args
from lightllm.server.collector import quiet_garbage_collector
from lightllm.server.engine_process import build_engine
from lightllm.server.model_info import LOAD_FORMATS
from lightllm.server.runner_factory import DEFAULT_RUNNER_FACTORY

# the serving benchmark's checkpoint: Qwen3.5 layout (6 GDN + 2 gated-attention layers), bf16 weights
SERVING_BENCH_SIZES = dict(
    hidden_size=2048,
    num_layers=8,
    vocab_size=32000,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    intermediate_size=6144,
    full_attention_interval=4,
)
# decode steps timed by the profiler (after the first few, which may still compile or allocate)
PROFILED_STEPS = 8


def serving_model_dir(cache_dir: str | None = None) -> str:
    """The serving benchmark's checkpoint (built once, cached under `cache_dir` or the default tiny-model cache)."""
    from lightllm.tools.make_tiny_model import tiny_model_dir

    return str(tiny_model_dir("qwen3_5", seed=0, dtype="bfloat16", cache_dir=cache_dir, **SERVING_BENCH_SIZES))


def serving_text_model_dir(cache_dir: str | None = None) -> str:
    """The serving checkpoint with a generated tokenizer over all its rows, for benchmarks that stream text (HTTP).
    Its own tokenizer is small (4771 tokens for 32000 rows): random weights draw from every row, and the ~85% of
    tokens beyond it decode to nothing and stream no event, so time to first text and the gaps between events
    would span several steps."""
    from lightllm.server.tiktoken_tokenizer import NUM_RESERVED_SPECIAL
    from lightllm.tools.synthetic_vocab import synthetic_vocab_dir

    base = serving_model_dir(cache_dir)
    rows = SERVING_BENCH_SIZES["vocab_size"]
    return str(synthetic_vocab_dir(base, rows - NUM_RESERVED_SPECIAL, rows, out_dir=f"{base}-text"))


def _is_decode_only(engine) -> bool:
    sched = engine.scheduler
    return not sched.waiting and bool(sched.running) and not any(r.is_prefilling for r in sched.running)


def profiled_steps(engine, num_steps: int, top_kernels: int = 0, leave_out: tuple[str, ...] = ()) -> tuple[float, list]:
    """Run `num_steps` engine steps under the CUDA profiler: (kernel ms per step, the steps' outputs, concatenated);
    prints the `top_kernels` kernels that take most of the time; kernels whose name starts with one of `leave_out`
    are not counted. Needs CUDA."""
    from torch.profiler import ProfilerActivity, profile

    outputs = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(num_steps):
            outputs += engine.step()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)
    events = [e for e in events if not e.key.startswith(leave_out)]
    total_us = sum(e.self_device_time_total for e in events)
    for e in events[:top_kernels]:
        share = e.self_device_time_total / max(total_us, 1e-9)
        print(
            f"  kernel {e.key[:90]}: {e.self_device_time_total / 1000 / num_steps:.3f} ms/step "
            f"({share:.0%}, {e.count / num_steps:.0f} calls)",
            flush=True,
        )
    return total_us / 1000 / num_steps, outputs


def run_batch(engine, batch: int, input_len: int, output_len: int, vocab: int, seed: int, top_kernels: int = 0) -> dict:
    """Submit `batch` requests at once and run them to the end; returns the measured figures. Call once untimed
    first with the same shapes: the first prefill of a shape compiles and autotunes kernels."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i in range(batch):
        prompt = rng.integers(10, vocab - 10, size=input_len).tolist()
        assert engine.add_request(NewRequest(f"b{batch}-{i}", prompt, params)) == []
    num_tokens, step_ms, gpu_ms, num_overlapped, profiled_s = 0, [], None, 0, 0.0
    other_ms: list[float] = []
    # requests running in each decode-only step: fewer than the batch where some finished while others prefilled
    step_rows: list[int] = []
    stats = engine.stats
    windows_before, accepted_before = stats.num_spec_windows, stats.num_accepted_draft_tokens
    start = time.perf_counter()
    while engine.has_work():
        decode_only = _is_decode_only(engine)
        if decode_only and gpu_ms is None and len(step_ms) == 4 and torch.cuda.is_available():
            steps_left = min(r.num_remaining_tokens for r in engine.scheduler.running)
            if steps_left > PROFILED_STEPS:
                # the profiled steps run under the profiler's overhead: neither their time nor their tokens count
                t0 = time.perf_counter()
                gpu_ms, _ = profiled_steps(engine, PROFILED_STEPS, top_kernels)
                profiled_s += time.perf_counter() - t0
                continue
        t0 = time.perf_counter()
        rows = len(engine.scheduler.running)
        outputs = engine.step()
        if decode_only:
            step_ms.append((time.perf_counter() - t0) * 1000)
            step_rows.append(rows)
            # the step left one in flight: its successor was launched before its tokens were read
            num_overlapped += engine.overlap.has_work()
        else:
            other_ms.append((time.perf_counter() - t0) * 1000)
        for out in outputs:
            if isinstance(out, TokenChunk):
                num_tokens += len(out.token_ids)
            elif isinstance(out, Finished) and out.reason not in ("length", "stop"):
                raise RuntimeError(f"request {out.req_id} ended with {out.reason}: {out.error}")
    elapsed = time.perf_counter() - start - profiled_s
    step = statistics.median(step_ms) if step_ms else float("nan")
    decode_rows = statistics.median(step_rows) if step_rows else float("nan")
    windows = stats.num_spec_windows - windows_before
    accepted = 1 + (stats.num_accepted_draft_tokens - accepted_before) / windows if windows else None
    return {
        "batch": batch,
        "output_tokens": num_tokens,
        "seconds": elapsed,
        "output_tok_per_s": num_tokens / elapsed,
        # decode-only throughput: each running request emits its mean accepted length per decode step (1 without
        # drafts)
        "decode_tok_per_s": decode_rows * (accepted or 1.0) * 1000 / step,
        "decode_rows": decode_rows,
        "decode_step_ms": step,
        "gpu_ms_per_step": gpu_ms,
        "host_ms_per_step": None if gpu_ms is None else max(step - gpu_ms, 0.0),
        "mean_accepted_len": accepted,
        "overlapped_share": num_overlapped / len(step_ms) if step_ms else None,
        # where the wall time went: decode-only steps, and the others (prefill, mixed, the last read-backs)
        "decode_steps": len(step_ms),
        "decode_s": sum(step_ms) / 1000,
        "other_steps": len(other_ms),
        "other_s": sum(other_ms) / 1000,
    }


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lightllm.tools.bench_throughput", description=__doc__.split("\n\n")[0])
    p.add_argument("--model_dir", default=None, help="checkpoint folder (default: the tiny demo model)")
    p.add_argument("--serving_model", action="store_true", help="the project's real-width random checkpoint")
    p.add_argument("--load_format", default="auto", choices=LOAD_FORMATS, help="dummy: random weights from config.json")
    p.add_argument("--quantization", default=None, choices=QUANTIZATION_CHOICES)
    p.add_argument("--modes", default="native,replay", help="comma-separated state modes")
    p.add_argument("--batch_sizes", default="1,8", help="comma-separated request counts")
    p.add_argument("--input_len", type=int, default=32)
    p.add_argument("--output_len", type=int, default=32)
    p.add_argument("--mtp_step", type=int, default=0)
    p.add_argument("--spec_ngram", type=int, default=0)
    p.add_argument(
        "--simulate_acceptance",
        type=float,
        default=None,
        metavar="P",
        help="keep each draft position with probability P, independent of the model (benchmarks only)",
    )
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--disable_cudagraph", action="store_true")
    p.add_argument("--disable_overlap_schedule", action="store_true")
    p.add_argument("--replay_capacity", type=int, default=None)
    p.add_argument("--linear_att_ssm_data_type", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mem_fraction", type=float, default=None, help="the server's --mem_fraction (default: its own)")
    p.add_argument("--result_file", default=None, help="write every row as JSON here")
    p.add_argument("--top_kernels", type=int, default=0, help="on CUDA, print the N kernels taking most GPU time")
    return p.parse_args(argv)


def _print_row(r: dict) -> None:
    print(
        f"| {r['mode']} | {r['mtp_step']} | {r['spec_ngram']} | {_fmt(r['simulate_acceptance'], 'g')} | "
        f"{r['batch']} | {r['output_tok_per_s']:.0f} | "
        f"{r['decode_tok_per_s']:.0f} | "
        f"{r['decode_step_ms']:.2f} | {_fmt(r['gpu_ms_per_step'], '.2f')} | {_fmt(r['host_ms_per_step'], '.2f')} "
        f"| {_fmt(r['mean_accepted_len'], '.2f')} | {_fmt(r['overlapped_share'], '.0%')} |",
        flush=True,
    )


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> list[dict]:
    a = _parse(argv)
    if a.simulate_acceptance is not None and not (a.mtp_step or a.spec_ngram):
        raise SystemExit("--simulate_acceptance needs drafts: give --mtp_step or --spec_ngram")
    model_dir = serving_model_dir() if a.serving_model else a.model_dir
    batches = [int(b) for b in a.batch_sizes.split(",")]
    rows = []
    # rows print as they finish: a run cut short by a time limit still shows what it measured
    print(
        "| mode | mtp | ngram | sim. accept | batch | out tok/s | decode tok/s | decode step ms | GPU ms/step "
        "| host ms/step | accepted len | overlapped |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for mode in a.modes.split(","):
        flags = dict(
            model_dir=model_dir,
            load_format=a.load_format,
            quantization=a.quantization,
            device=a.device,
            ssm_state_mode=mode,
            mtp_step=a.mtp_step,
            spec_ngram=a.spec_ngram,
            max_running_requests=max(batches),
            max_req_total_len=a.input_len + a.output_len + 8,
            linear_att_ssm_data_type=a.linear_att_ssm_data_type,
            disable_cudagraph=a.disable_cudagraph,
            disable_overlap_schedule=a.disable_overlap_schedule,
        )
        if a.mem_fraction is not None:
            flags["mem_fraction"] = a.mem_fraction
        if mode == "replay" and a.replay_capacity:
            flags["replay_capacity"] = a.replay_capacity
        args, info = load_server_args([], **flags)
        acceptance = None
        if a.simulate_acceptance is not None:
            acceptance = SimulatedAcceptance(a.simulate_acceptance, seed=a.seed)
        engine = build_engine(args, info, DEFAULT_RUNNER_FACTORY, acceptance)
        quiet_garbage_collector()
        for batch in batches:
            # untimed pass: compiles and autotunes for this batch's shapes (and warms CUDA graphs' buckets)
            run_batch(engine, batch, a.input_len, min(a.output_len, 4), info.vocab_size, a.seed + 1)
            row = run_batch(engine, batch, a.input_len, a.output_len, info.vocab_size, a.seed, a.top_kernels)
            row.update(
                mode=mode,
                mtp_step=a.mtp_step,
                spec_ngram=a.spec_ngram,
                simulate_acceptance=a.simulate_acceptance,
                device=args.device,
            )
            rows.append(row)
            _print_row(row)
            fewer = row["decode_rows"] < batch
            print(
                f"  batch {batch}: {row['seconds']:.3f} s = {row['decode_steps']} decode-only steps "
                f"{row['decode_s']:.3f} s + {row['other_steps']} other steps {row['other_s']:.3f} s; decode-only steps "
                f"of {row['decode_rows']:g} rows (median)"
                + (": fewer than the batch, the others finished while later prompts prefilled" if fewer else ""),
                flush=True,
            )
            if a.result_file:
                with open(a.result_file, "w") as f:
                    json.dump(rows, f, indent=2)
        del engine
        # the frozen start-up objects of this engine may be collected again once it is gone
        gc.unfreeze()
        # the engine's objects hold reference cycles: collect them, or the next mode finds the device memory taken
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    main()
