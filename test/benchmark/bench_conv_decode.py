"""The causal conv's decode / verify kernel (`ops.causal_conv_decode`) against its bytes floor, at the served channel
count (8192: GDN's q, k, v of Qwen3.5 / Qwen3-Next) and kernel size 4, bf16 windows and inputs.

    python test/benchmark/bench_conv_decode.py                          # CUDA: the table below
    python test/benchmark/bench_conv_decode.py --device cpu --rows 4    # interpreter smoke run, tiny shapes

Per case (rows N x window width W): µs of one layer's launch (a CUDA graph cycling over `--layers` layers' buffers
at shuffled slots of a `4 N`-slot pool, so a launch does not find its window in L2), the bytes it must move
(history read, inputs read, window rewritten, outputs written, weights) at the measured copy bandwidth, and the
ratio. Every case is first checked against the torch twin (outputs and the rewritten window; a mismatch stops the
run). The script runs against whichever `lightllm` is first on `PYTHONPATH` (another revision's tree, for a before /
after in one command). Without CUDA (and without `--device cpu`) it prints a line and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys

# the CPU smoke run needs Triton's interpreter, which is chosen when the kernels are defined (at import)
if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1 :][:1] == ["cpu"]:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from lightllm.linear_att import ops  # noqa: E402
from lightllm.tools.gpu_timing import graph_us  # noqa: E402

KC = 4
# bf16 outputs of the same fp32 sums, summed in another order: a few bf16 units at most
MAX_REL_ERROR = 2e-2


def _bandwidth(device: torch.device) -> float:
    # an older tree under comparison may lack the shared helper
    try:
        from lightllm.tools.gpu_timing import copy_bandwidth
    except ImportError:
        return 4.8e12
    return copy_bandwidth(device)


def floor_bytes(rows: int, width: int, channels: int, elem: int) -> int:
    """What one launch must move: each row's Kc - 1 history columns and W inputs read, Kc - 2 + W window columns
    and W outputs written, the weights once."""
    per_row = (KC - 1) + width + (KC - 2 + width) + width
    return rows * channels * per_row * elem + channels * KC * elem


def case(rows: int, width: int, channels: int, layers: int, dtype, device) -> tuple[float, float]:
    """(µs per layer, relative error against the twin) of rows x width."""
    gen = torch.Generator(device="cpu").manual_seed(rows * 10 + width)
    pool = 4 * rows
    convs = [torch.randn(pool, channels, KC - 1 + width - 1, generator=gen).to(device, dtype) for _ in range(layers)]
    weights = [torch.randn(channels, KC, generator=gen).to(device, dtype) for _ in range(layers)]
    x = torch.randn(rows, width, channels, generator=gen).to(device, dtype)
    slots = torch.randperm(pool, generator=gen)[:rows].to(device, torch.int32)
    widths = torch.full((rows,), width, dtype=torch.int32, device=device)
    offset = torch.randint(0, width, (pool,), generator=gen, dtype=torch.int32).to(device)
    conv = convs[0].clone()
    twin_conv = convs[0].cpu()
    y = ops.causal_conv_decode(x, conv, offset, slots, widths, weights[0], None)
    cpu = [t.cpu() for t in (x, twin_conv, offset, slots, widths, weights[0])]
    y_twin = ops.causal_conv_decode(*cpu, None, backend="torch")
    err = float((y.float().cpu() - y_twin.float()).abs().max() / y_twin.float().abs().max())
    # the outputs are rounded once from fp32 in both; the window holds copies of its inputs
    if err > MAX_REL_ERROR or not torch.equal(conv.cpu(), cpu[1]):
        raise AssertionError(f"rows {rows} W {width}: the kernel differs from the torch twin (rel. error {err:.1e})")

    def step():
        for conv, weight in zip(convs, weights):
            ops.causal_conv_decode(x, conv, offset, slots, widths, weight, None)

    return graph_us(step, iters=10, launches=4, device=device) / layers, err


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", default="64,256", help="comma-separated row counts")
    parser.add_argument("--widths", default="1,2,3,4", help="comma-separated window widths")
    parser.add_argument("--channels", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing measured")
        return 0
    cpu = device.type == "cpu"
    channels, layers = (37, 2) if cpu else (args.channels, args.layers)
    dtype = torch.float32 if cpu else torch.bfloat16
    elem = torch.empty((), dtype=dtype).element_size()
    bandwidth = _bandwidth(device) if not cpu else 1e12
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, channels {channels}, Kc {KC}, {dtype}")
    print("| rows | W | µs | floor µs | µs / floor | rel. error vs twin |")
    print("|---|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        for width in (int(w) for w in args.widths.split(",")):
            us, err = case(rows, width, channels, layers, dtype, device)
            floor = floor_bytes(rows, width, channels, elem) / bandwidth * 1e6
            print(f"| {rows} | {width} | {us:.1f} | {floor:.1f} | {us / floor:.2f} | {err:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
