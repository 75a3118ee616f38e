"""Where a replay verify step spends its time: the whole step against each of its launches alone.

    python test/benchmark/replay_phases.py [--shapes qwen3-next-tp1,kimi-linear-tp1] [--ws 2,4] [--ns 128]

For W > 1 a step is `replay_prepare_kernel` + `replay_forward_kernel` + the cursor kernel; this times the step,
then the step with the forward launch left out, then with the prepare launch left out (the forward then reads
the coefficients an earlier call left in the scratch buffer, which is the same work). Same method as
`bench_linear_att.py` (CUDA graphs over pools rotated beyond L2), so the rows add up to the benchmark's cells.
"""

from __future__ import annotations

import argparse
import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import bench_linear_att as bench  # noqa: E402

from lightllm.linear_att.kernels import replay_verify as rv  # noqa: E402


class _Skipped:
    """Stands in for a Triton kernel: `kernel[grid](...)` launches nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qwen3-next-tp1,kimi-linear-tp1")
    p.add_argument("--ws", default="2,4")
    p.add_argument("--ns", default="128")
    p.add_argument("--capacity", type=int, default=16)
    p.add_argument("--projections", default="inline,precompute")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    timer = bench.Timer(device, reps=max(24, 2 * args.capacity))
    print("| shape | W | N | projection | step µs | prepare only | forward only | read floor |")
    print("|---|---|---|---|---|---|---|---|")
    bw = bench.copy_bandwidth(device)
    for name in args.shapes.split(","):
        shape = bench.SHAPES[name]
        for W in (int(w) for w in args.ws.split(",")):
            for N in (int(n) for n in args.ns.split(",")):
                inp = bench.make_inputs(shape, N, W, torch.bfloat16, device)
                floor = N * shape.HV * shape.K * shape.V * 4 / bw * 1e6
                for projection in args.projections.split(","):
                    cell = (shape, inp, N, W, args.capacity, torch.float32, projection, device)
                    full = timer(bench.replay_steps(*cell))
                    with mock.patch.object(rv, "replay_forward_kernel", _Skipped()):
                        prepare = timer(bench.replay_steps(*cell))
                    with mock.patch.object(rv, "replay_prepare_kernel", _Skipped()):
                        forward = timer(bench.replay_steps(*cell))
                    print(
                        f"| {name} | {W} | {N} | {projection} | {full:.1f} | {prepare:.1f} | {forward:.1f} "
                        f"| {floor:.1f} |",
                        flush=True,
                    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
