"""The fused MoE (Triton: device routing, grouped GEMMs, combine) against the per-expert torch loop, in one run, at
the served MoE layer shapes, with the expert weight bytes each launch must read against the HBM peak.

    python test/benchmark/bench_fused_moe.py [--shapes qwen3.5-35b-a3b,qwen3-next-80b-a3b,kimi-linear-48b-a3b] \
        [--batches 1,64,256] [--dtype bfloat16] [--hbm_tbps 4.8] [--iters 50] [--largest_tuned]

Each row routes `batch` tokens (random router logits: Qwen's softmax top-k, Kimi's biased sigmoid top-k) and runs
the routed experts of one layer; the shared expert is the same dense GEMM in both and left out. Columns: the loop
(`route_softmax`/`route_sigmoid` + `run_experts`, eager: it syncs the host per layer), the fused path eager and
replayed from a CUDA graph (it has no host sync), the bytes floor (the weights of the experts the batch routes to,
read once), the graph replay's effective bandwidth against `--hbm_tbps` (H200: 4.8 TB/s) and its TFLOP/s, and with
`--largest_tuned` the graph replay with the tuned table's largest bucket's configuration (what a prefill batch far
above the table took before it fell back to the heuristic; e.g. `--batches 1024,4096,16384`). Outputs are checked
against each other before timing. Without CUDA it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from lightllm.kernels.fused_moe import fused_experts, get_config, sigmoid_topk, softmax_topk
from lightllm.kernels.fused_moe.configs import tuned_entries
from lightllm.kernels.fused_moe.shapes import SERVED_SHAPES, MoEShape
from lightllm.models.config import MoEConfig
from lightllm.models.layers.moe import route_sigmoid, route_softmax, run_experts

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
KIMI_SCALING = 2.446


def layer(shape: MoEShape, batch: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(batch, shape.hidden, device="cuda", generator=gen).to(dtype)
    gate_up = torch.randn(shape.num_experts, 2 * shape.inter, shape.hidden, device="cuda", generator=gen)
    down = torch.randn(shape.num_experts, shape.hidden, shape.inter, device="cuda", generator=gen)
    logits = torch.randn(batch, shape.num_experts, device="cuda", generator=gen)
    bias = torch.randn(shape.num_experts, device="cuda", generator=gen) * 0.1
    return x, (gate_up / shape.hidden**0.5).to(dtype), (down / shape.inter**0.5).to(dtype), logits, bias


def loop_block(shape: MoEShape, x, gate_up, down, logits, bias):
    if shape.scoring == "sigmoid":
        cfg = MoEConfig("sigmoid", shape.num_experts, shape.top_k, shape.inter, routed_scaling_factor=KIMI_SCALING)
        weights, ids = route_sigmoid(logits, bias, cfg)
    else:
        weights, ids = route_softmax(logits.to(x.dtype), MoEConfig("softmax", shape.num_experts, shape.top_k, 1))
    return run_experts(x, gate_up, down, weights, ids)


def fused_block(shape: MoEShape, x, gate_up, down, logits, bias, config: dict | None = None):
    if shape.scoring == "sigmoid":
        weights, ids = sigmoid_topk(logits, bias, shape.top_k, True, KIMI_SCALING)
    else:
        weights, ids = softmax_topk(logits.to(x.dtype), shape.top_k, True)
    return fused_experts(x, gate_up, down, weights, ids, config=config)


def median_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_of(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def row(shape: MoEShape, batch: int, dtype: torch.dtype, iters: int, hbm_tbps: float, largest_tuned: bool) -> dict:
    x, gate_up, down, logits, bias = layer(shape, batch, dtype)
    args = (shape, x, gate_up, down, logits, bias)
    ref, out = loop_block(*args).float(), fused_block(*args).float()
    err = ((out - ref).norm() / ref.norm()).item()
    assert err < 2e-2, f"{shape.name} batch {batch}: fused vs loop relative error {err:.3e}"
    if shape.scoring == "sigmoid":
        _, ids = sigmoid_topk(logits, bias, shape.top_k, True, KIMI_SCALING)
    else:
        _, ids = softmax_topk(logits, shape.top_k, True)
    used = int(ids.unique().numel())
    floor_bytes = used * shape.expert_bytes(x.element_size())
    graph = graph_of(lambda: fused_block(*args))
    graph_ms = median_ms(graph.replay, iters)
    config = get_config(batch, shape.num_experts, shape.inter, shape.hidden, shape.top_k, dtype, x.device)
    tuned = tuned_entries(shape.num_experts, shape.inter, shape.hidden, shape.top_k, dtype, x.device)
    largest_ms = None
    if largest_tuned and tuned:
        largest = tuned[max(tuned, key=int)]
        largest_ms = median_ms(graph_of(lambda: fused_block(*args, config=largest)).replay, iters)
    return {
        "shape": shape.name,
        "batch": batch,
        "experts": used,
        "loop_ms": median_ms(lambda: loop_block(*args), iters),
        "fused_ms": median_ms(lambda: fused_block(*args), iters),
        "graph_ms": graph_ms,
        "floor_ms": floor_bytes / (hbm_tbps * 1e9),
        "gbps": floor_bytes / (graph_ms * 1e6),
        "peak_pct": 100 * floor_bytes / (graph_ms * 1e-3) / (hbm_tbps * 1e12),
        "block_m": config["BLOCK_M"],
        "tflops": batch * shape.top_k * 6 * shape.hidden * shape.inter / (graph_ms * 1e9),
        "largest_tuned_ms": largest_ms,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen3.5-35b-a3b,qwen3-next-80b-a3b,kimi-linear-48b-a3b")
    p.add_argument("--batches", default="1,64,256")
    p.add_argument(
        "--data_type", default="bfloat16", choices=tuple(DTYPES), help="activations and experts (the server's flag)"
    )
    p.add_argument("--hbm_tbps", type=float, default=4.8, help="HBM peak, TB/s (H200: 4.8)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument(
        "--largest_tuned",
        action="store_true",
        help="also time each batch with the tuned table's largest bucket's configuration (prefill batches above it)",
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fused_moe: no CUDA device; nothing to measure")
        return 0
    print(f"{torch.cuda.get_device_name()}, {args.data_type}, HBM peak {args.hbm_tbps} TB/s")
    header = (
        "| shape | batch | experts used | loop ms | fused ms | fused graph ms | speedup | floor ms | GB/s | % peak | BM "
        "| TFLOP/s | largest tuned bucket's config, graph ms |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for name in args.shapes.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            r = row(SERVED_SHAPES[name], batch, DTYPES[args.data_type], args.iters, args.hbm_tbps, args.largest_tuned)
            largest = "-" if r["largest_tuned_ms"] is None else f"{r['largest_tuned_ms']:.3f}"
            print(
                f"| {r['shape']} | {r['batch']} | {r['experts']} | {r['loop_ms']:.3f} | {r['fused_ms']:.3f} | "
                f"{r['graph_ms']:.3f} | {r['loop_ms'] / r['graph_ms']:.1f}x | {r['floor_ms']:.3f} | {r['gbps']:.0f} | "
                f"{r['peak_pct']:.0f}% | {r['block_m']} | {r['tflops']:.0f} | {largest} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
