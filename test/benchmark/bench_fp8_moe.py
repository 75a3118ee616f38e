"""The fused MoE's routed experts with block-FP8 weights against the same step with bf16 weights, in one run, at
Qwen3-Next-80B-A3B's expert shapes (512 experts, top-10, intermediate 512, hidden 2048; TP1).

    python test/benchmark/bench_fp8_moe.py                # CUDA (H200): the table below
    python test/benchmark/bench_fp8_moe.py --batches 4096,16384   # prefill token counts
    python test/benchmark/bench_fp8_moe.py --device cpu   # interpreter smoke run, tiny shapes

Per batch (tokens): bf16 us and fp8 us of `fused_experts` (routing ids and weights given; the FP8 step includes
quantizing x and the SwiGLU activations), their ratio fp8 / bf16 (decode reads every chosen expert's weights, so
half the bytes should show), and the FP8 output's relative error against the bf16 one. Medians of CUDA-graph
replays. Without CUDA (and without `--device cpu`) it prints a line and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

# the CPU smoke run needs Triton's interpreter, which is chosen when the kernels are defined (at import)
if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1 :][:1] == ["cpu"]:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from lightllm.kernels.fp8 import quantize_weight_blocks  # noqa: E402
from lightllm.kernels.fused_moe import fused_experts, softmax_topk  # noqa: E402
from lightllm.tools.gpu_timing import graph_us  # noqa: E402

# (experts, top_k, intermediate, hidden)
QWEN3_NEXT_80B = (512, 10, 512, 2048)
TINY = (8, 2, 40, 48)
BATCHES = {"cuda": (1, 64, 256, 4096), "cpu": (3,)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--batches", default=None, help="comma-separated token counts (default: 1,64,256,4096 on CUDA)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_fp8_moe: no CUDA device; skipped (use --device cpu for an interpreter smoke run)")
        return
    device = args.device
    num_experts, top_k, inter, hidden = QWEN3_NEXT_80B if device == "cuda" else TINY
    block = (128, 128) if device == "cuda" else (16, 16)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen, device=device, dtype=dtype) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter, generator=gen, device=device, dtype=dtype) / inter**0.5
    (gate_up_q, gate_up_s), (down_q, down_s) = (
        quantize_weight_blocks(gate_up, block),
        quantize_weight_blocks(down, block),
    )
    if device == "cuda":
        import triton

        print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}")
    print(f"E={num_experts} top_k={top_k} I={inter} H={hidden} block={list(block)}")
    print(f"{'tokens':>7s} {'bf16 us':>9s} {'fp8 us':>9s} {'fp8/bf16':>9s} {'rel err':>8s}")
    batches = [int(b) for b in args.batches.split(",")] if args.batches else BATCHES[device]
    for num_tokens in batches:
        x = torch.randn(num_tokens, hidden, generator=gen, device=device, dtype=dtype)
        logits = torch.randn(num_tokens, num_experts, generator=gen, device=device, dtype=torch.float32)
        weights, ids = softmax_topk(logits, top_k, True)
        bf16 = functools.partial(fused_experts, x, gate_up, down, weights, ids)
        scales = {"gate_up_scale": gate_up_s, "down_scale": down_s}
        fp8 = functools.partial(fused_experts, x, gate_up_q, down_q, weights, ids, block=block, **scales)
        ref, out = bf16().float(), fp8().float()
        err = ((out - ref).norm() / ref.norm()).item()
        assert err < 0.1, f"{num_tokens} tokens: FP8 experts vs bf16 relative error {err:.3f}"
        if device != "cuda":
            print(f"{num_tokens:7d} {'-':>9s} {'-':>9s} {'-':>9s} {err:8.1e}")
            continue
        t_bf16, t_fp8 = graph_us(bf16, iters=args.iters), graph_us(fp8, iters=args.iters)
        print(f"{num_tokens:7d} {t_bf16:9.1f} {t_fp8:9.1f} {t_fp8 / t_bf16:9.2f} {err:8.1e}")


if __name__ == "__main__":
    main()
