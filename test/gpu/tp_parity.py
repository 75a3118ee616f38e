"""Tensor parallelism on 2 GPUs: TP-2 vs TP-1 greedy parity in bf16 at real width, and decode throughput per mode.

    python test/gpu/tp_parity.py [--parts parity,speed] [--modes native,replay,compact+mtp2] [--batch_sizes 64,256]
        [--num_layers 16] [--result_file out.json]

The checkpoint is the serving benchmark's random-weight Qwen3.5 layout (`SERVING_BENCH_SIZES`: hidden 2048, GDN
16 key / 32 value heads, 16 attention heads over 2 KV heads) with twice its layers, bf16, fp32 state. Parity runs
the same greedy prompts through a TP-1 engine on GPU 0 and a TP-2 engine on GPUs 0-1 and prints, per mode, how
many requests agree token for token and the mean length of the agreeing prefix (bf16 partial sums are added in
another order under TP, so late divergence on near-tied logits is possible; early divergence is a bug). Speed
reports decode tokens/s (median decode-only step) per mode and batch for TP-1 and TP-2, and their ratio.
"""

from __future__ import annotations

import argparse
import gc
import json

import numpy as np
import torch

from lightllm.engine.messages import Finished, NewRequest, TokenChunk
from lightllm.engine.sampling_params import SamplingParams
from lightllm.server.args import load_server_args
from lightllm.server.collector import quiet_garbage_collector
from lightllm.server.engine_process import engine_for_runner
from lightllm.server.model_info import read_model_info
from lightllm.server.runner_factory import build_rank_runner, create_tp_runner
from lightllm.tools.bench_throughput import SERVING_BENCH_SIZES, run_batch

# "cuda"; "cpu" with --tiny checks this script on a machine without GPUs
DEVICE = ["cuda"]
MODES = {
    "native": ("native", {}),
    "replay": ("replay", {}),
    "compact+mtp2": ("compact", {"mtp_step": 2}),
    "native+mtp2": ("native", {"mtp_step": 2}),
    "replay+mtp2": ("replay", {"mtp_step": 2}),
}


def model_dir(num_layers: int, tiny: bool) -> str:
    from lightllm.tools.make_tiny_model import tiny_model_dir

    if tiny:
        return str(tiny_model_dir("qwen3_5"))
    sizes = {**SERVING_BENCH_SIZES, "num_layers": num_layers}
    return str(tiny_model_dir("qwen3_5", seed=0, dtype="bfloat16", **sizes))


def build(path: str, mode: str, spec: dict, tp: int, group, max_requests: int, max_len: int, eager: bool):
    args, info = load_server_args(
        [],
        model_dir=path,
        device=DEVICE[0],
        tp=tp,
        ssm_state_mode=mode,
        max_running_requests=max_requests,
        max_req_total_len=max_len,
        disable_cudagraph=eager,
        **spec,
    )
    runner = build_rank_runner(args, info) if tp == 1 else create_tp_runner(args, info, group)
    engine = engine_for_runner(args, runner)
    quiet_garbage_collector()
    return engine, info


def release(engine) -> None:
    """Drop the engine's runner (closed on every rank) so that the next engine finds its device memory free."""
    close = getattr(engine.runner, "close", None)
    if close is not None:
        close()
    engine.runner = engine.scheduler = None
    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def greedy(engine, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(NewRequest(f"p{i}", p, params))
    out = {f"p{i}": [] for i in range(len(prompts))}
    while engine.has_work():
        for o in engine.step():
            if isinstance(o, TokenChunk):
                out[o.req_id] += o.token_ids
            elif isinstance(o, Finished) and o.reason != "length":
                raise RuntimeError(f"request {o.req_id} ended with {o.reason}: {o.error}")
    return [out[f"p{i}"] for i in range(len(prompts))]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def parity(
    path: str, modes: list[str], group, num_prompts: int, input_len: int, num_tokens: int, eager: bool
) -> list[dict]:
    rng = np.random.default_rng(0)
    vocab = read_model_info(path).vocab_size
    prompts = [rng.integers(10, vocab - 10, size=input_len).tolist() for _ in range(num_prompts)]
    rows = []
    print("| mode | requests identical | mean agreeing prefix | earliest divergence |")
    print("|---|---|---|---|", flush=True)
    for name in modes:
        mode, spec = MODES[name]
        outs = {}
        for tp in (1, 2):
            engine, _ = build(path, mode, spec, tp, group, num_prompts, input_len + num_tokens + 8, eager)
            outs[tp] = greedy(engine, prompts, num_tokens)
            release(engine)
        prefixes = [common_prefix(a, b) for a, b in zip(outs[1], outs[2])]
        row = dict(
            mode=name,
            identical=sum(p == num_tokens for p in prefixes),
            requests=num_prompts,
            mean_prefix=float(np.mean(prefixes)),
            earliest=min(prefixes),
            tokens=num_tokens,
        )
        rows.append(row)
        print(
            f"| {name} | {row['identical']}/{num_prompts} | {row['mean_prefix']:.1f}/{num_tokens} "
            f"| {row['earliest']} |",
            flush=True,
        )
    return rows


def speed(
    path: str, modes: list[str], group, batches: list[int], input_len: int, output_len: int, eager: bool
) -> list[dict]:
    rows = []
    print("| mode | batch | TP-1 decode tok/s | TP-2 decode tok/s | TP-2/TP-1 | TP-1 step ms | TP-2 step ms |")
    print("|---|---|---|---|---|---|---|", flush=True)
    measured: dict[tuple[str, int, int], dict] = {}
    for name in modes:
        mode, spec = MODES[name]
        for tp in (1, 2):
            engine, info = build(path, mode, spec, tp, group, max(batches), input_len + output_len + 8, eager)
            for batch in batches:
                # untimed pass: compiles and autotunes this batch's shapes
                run_batch(engine, batch, input_len, 4, info.vocab_size, 1)
                measured[name, tp, batch] = run_batch(engine, batch, input_len, output_len, info.vocab_size, 0)
            release(engine)
        for batch in batches:
            one, two = measured[name, 1, batch], measured[name, 2, batch]
            row = dict(mode=name, batch=batch, tp1=one, tp2=two)
            rows.append(row)
            print(
                f"| {name} | {batch} | {one['decode_tok_per_s']:.0f} | {two['decode_tok_per_s']:.0f} "
                f"| {two['decode_tok_per_s'] / one['decode_tok_per_s']:.2f} | {one['decode_step_ms']:.2f} "
                f"| {two['decode_step_ms']:.2f} |",
                flush=True,
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="parity,speed")
    p.add_argument("--modes", default="native,replay,compact+mtp2")
    p.add_argument("--batch_sizes", default="64,256")
    p.add_argument("--num_layers", type=int, default=2 * SERVING_BENCH_SIZES["num_layers"])
    p.add_argument("--num_prompts", type=int, default=16)
    p.add_argument("--input_len", type=int, default=256)
    p.add_argument("--parity_tokens", type=int, default=64)
    p.add_argument("--output_len", type=int, default=128)
    p.add_argument("--disable_cudagraph", action="store_true", help="eager decode steps on every rank")
    p.add_argument(
        "--tiny", action="store_true", help="the tiny demo checkpoint instead (with --device cpu: a dry run)"
    )
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--result_file", default=None)
    a = p.parse_args()
    DEVICE[0] = a.device
    if a.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit(f"needs 2 GPUs, {torch.cuda.device_count()} visible")
    from lightllm.worker.tp.group import TPGroup

    path = model_dir(a.num_layers, a.tiny)
    gpu = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
    print(f"checkpoint {path}: {a.num_layers} layers; {gpu}; torch {torch.__version__}")
    modes, parts = a.modes.split(","), a.parts.split(",")
    group = TPGroup(2, a.device, num_threads=1 if a.device == "cpu" else None)
    results = {}
    try:
        if "parity" in parts:
            results["parity"] = parity(
                path, modes, group, a.num_prompts, a.input_len, a.parity_tokens, a.disable_cudagraph
            )
        if "speed" in parts:
            batches = [int(b) for b in a.batch_sizes.split(",")]
            results["speed"] = speed(path, modes, group, batches, a.input_len, a.output_len, a.disable_cudagraph)
    finally:
        group.shutdown()
    if a.result_file:
        with open(a.result_file, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
