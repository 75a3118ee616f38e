"""Block-FP8 W8A8 GEMM (`lightllm.kernels.fp8`) against the bf16 GEMM (`torch.matmul`), in one run, at prefill
sizes and Qwen3-Next-80B-A3B's linear-layer shapes (hidden 2048; TP1).

    python test/benchmark/bench_fp8_gemm.py                    # CUDA (H200): the table below
    python test/benchmark/bench_fp8_gemm.py --sweep            # also every tuning candidate of the GEMM per case
    python test/benchmark/bench_fp8_gemm.py --device cpu       # interpreter smoke run, tiny shapes

Per case (M tokens x N outputs x K inputs): bf16 us (`x @ w.T`), fp8 gemm us (`fp8_block_gemm` on already
quantized activations), fp8 linear us (per-token-group activation quantization + GEMM: what a layer pays), and
the speed-ups bf16 / fp8. Times are medians of CUDA-graph replays of 10 launches. Every case first checks the
Triton GEMM against the dequantize-then-matmul reference. Without CUDA (and without `--device cpu`) it prints a
line and exits 0.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

# the CPU smoke run needs Triton's interpreter, which is chosen when the kernels are defined (at import)
if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1 :][:1] == ["cpu"]:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from lightllm.kernels.fp8 import (  # noqa: E402
    fp8_block_gemm,
    fp8_block_gemm_reference,
    quantize_activation_groups,
    quantize_weight_blocks,
)
from lightllm.kernels.fp8.shapes import SERVED_GEMMS  # noqa: E402
from lightllm.tools.gpu_timing import graph_us  # noqa: E402
from lightllm.tools.tune_fp8_gemm import candidates  # noqa: E402

QWEN3_NEXT_80B = SERVED_GEMMS["qwen3-next-80b-a3b"]
PREFILL_M = (4096, 8192, 16384)
TINY = {"tiny odd": (45, 71)}
TINY_M = (5,)
MAX_REL = 1e-2


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run_case(m: int, n: int, k: int, device: str, iters: int, sweep: bool, block=(128, 128)) -> dict:
    gen = torch.Generator(device=device).manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, generator=gen, device=device, dtype=torch.bfloat16) / k**0.5
    w_q, w_s = quantize_weight_blocks(w, block)
    a_q, a_s = quantize_activation_groups(x, block[1], backend="triton")
    out = fp8_block_gemm(a_q, a_s, w_q, w_s, torch.bfloat16, block)
    err = relative_error(out, fp8_block_gemm_reference(a_q, a_s, w_q, w_s, torch.float32, block))
    assert err < MAX_REL, f"M={m} N={n} K={k}: fp8_block_gemm vs reference relative error {err:.2e}"
    row = {"M": m, "N": n, "K": k, "err": err}
    if device != "cuda":
        return row
    row["bf16"] = graph_us(lambda: torch.matmul(x, w.T), iters=iters)
    row["fp8 gemm"] = graph_us(lambda: fp8_block_gemm(a_q, a_s, w_q, w_s, torch.bfloat16, block), iters=iters)

    def linear():
        q, s = quantize_activation_groups(x, block[1], backend="triton")
        return fp8_block_gemm(q, s, w_q, w_s, torch.bfloat16, block)

    row["fp8 linear"] = graph_us(linear, iters=iters)
    if sweep:
        best = min(
            (
                graph_us(lambda c=c: fp8_block_gemm(a_q, a_s, w_q, w_s, torch.bfloat16, block, config=c), iters=iters),
                str(c),
            )
            for c in candidates(m, block)
        )
        row["best"] = best
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--sweep", action="store_true", help="time every tuning candidate per case")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_fp8_gemm: no CUDA device; skipped (use --device cpu for an interpreter smoke run)")
        return
    shapes, ms = (QWEN3_NEXT_80B, PREFILL_M) if args.device == "cuda" else (TINY, TINY_M)
    block = (128, 128) if args.device == "cuda" else (32, 32)
    if args.device == "cuda":
        import triton

        print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}")
    header = f"{'layer':24s} {'M':>6s} {'N':>6s} {'K':>5s} {'bf16 us':>9s} {'fp8 gemm':>9s} {'x':>5s}"
    print(header + f" {'fp8 linear':>10s} {'x':>5s} {'rel err':>8s}" + ("  best config" if args.sweep else ""))
    for (name, (n, k)), m in itertools.product(shapes.items(), ms):
        r = run_case(m, n, k, args.device, args.iters, args.sweep, block)
        if args.device != "cuda":
            print(f"{name:24s} {m:6d} {n:6d} {k:5d} {'-':>9s} {'-':>9s} {'-':>5s} {'-':>10s} {'-':>5s} {r['err']:8.1e}")
            continue
        line = f"{name:24s} {m:6d} {n:6d} {k:5d} {r['bf16']:9.1f} {r['fp8 gemm']:9.1f} {r['bf16'] / r['fp8 gemm']:5.2f}"
        line += f" {r['fp8 linear']:10.1f} {r['bf16'] / r['fp8 linear']:5.2f} {r['err']:8.1e}"
        if args.sweep:
            us, c = r["best"]
            line += f"  {us:.1f} us {c} ({r['bf16'] / us:.2f}x)"
        print(line)


if __name__ == "__main__":
    main()
