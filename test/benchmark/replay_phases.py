"""Where a replay step spends its time: the amortised step against the verify launch at a pinned cursor.

    python test/benchmark/replay_phases.py [--shapes qwen3-next-tp1,kimi-linear-tp1] [--ws 1,2,4] [--ns 128]

A step is one launch (`replay_decode_kernel` for W = 1, `replay_window_kernel` for W > 1, either projection)
plus the cursor kernel. This times the step with the cursor cycling through fold cycles, then the launch alone
with the cursor pinned at 0 (no history, no fold) and at L - W (a full history, no fold): the difference between
the pinned rows is the cost of the history, the one between the cycling step and the pinned rows that of the
folds and the cursor kernel. Same method as `bench_linear_att.py` (CUDA graphs over pools rotated beyond L2), so
the rows add up to the benchmark's cells.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import bench_linear_att as bench  # noqa: E402

from lightllm.linear_att.kernels import replay_verify as rv  # noqa: E402


def pinned_rows(shape, inp, N, W, L, device, timer, floor, projection="inline") -> None:
    """The amortised step, then the verify launches alone at a pinned cursor: 0 (no history, no fold) and L - W
    (a full history, no fold)."""
    cells = {"cycling": timer(bench.replay_steps(shape, inp, N, W, L, torch.float32, projection, device))}
    for pinned in (0, L - W):
        steps = []
        for r in range(bench.num_pools(N * shape.HV * shape.K * shape.V * 4, device)):
            ssm, hist, cursor, parity = bench.replay_buffers(shape, N, L, torch.float32, device, seed=r + 1)
            cursor.fill_(pinned)
            state = bench.ReplayBuffers(ssm, *hist, cursor, parity)
            steps.append(
                lambda state=state: rv.replay_verify_triton(
                    inp.tokens, state, inp.slots, inp.widths, projection=projection
                )
            )
        cells[f"h={pinned}"] = timer(steps)
    text = " | ".join(f"{k} {v:.1f}" for k, v in cells.items())
    print(f"| {shape.name} | {W} | {N} | {projection} | {text} | {floor:.1f} |", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qwen3-next-tp1,kimi-linear-tp1")
    p.add_argument("--ws", default="1,2,4")
    p.add_argument("--ns", default="128")
    p.add_argument("--replay_capacity", type=int, default=16)
    p.add_argument("--projections", default="inline,precompute")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    timer = bench.Timer(device, reps=max(24, 2 * args.replay_capacity))
    print("| shape | W | N | projection | µs: cycling, pinned h=0, pinned h=L-W | read floor |")
    print("|---|---|---|---|---|---|")
    bw = bench.copy_bandwidth(device)
    for name in args.shapes.split(","):
        shape = bench.SHAPES[name]
        for W in (int(w) for w in args.ws.split(",")):
            for N in (int(n) for n in args.ns.split(",")):
                inp = bench.make_inputs(shape, N, W, torch.bfloat16, device)
                floor = N * shape.HV * shape.K * shape.V * 4 / bw * 1e6
                for projection in ["inline"] if W == 1 else args.projections.split(","):
                    pinned_rows(shape, inp, N, W, args.replay_capacity, device, timer, floor, projection)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
