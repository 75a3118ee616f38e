"""Launch each decode / verify kernel a few times at a fixed cursor, eagerly, for Nsight Compute to profile.

    ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section WarpStateStats -k 'regex:replay|native|compact' python test/benchmark/profile_replay_ncu.py

(`bash test/gpu/h200_stages.sh profile` runs exactly that and keeps the report.) The cursor is pinned at `--h`
committed records with room for the window, so no launch folds: the profile is the steady-state read path. Shapes
and inputs are the benchmark's (`bench_linear_att.py`); `--kernels` picks a subset.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import bench_linear_att as bench  # noqa: E402

from lightllm.linear_att.bundles import CompactBuffers, NativeBuffers, ReplayBuffers  # noqa: E402
from lightllm.linear_att.kernels.replay_verify import replay_verify_triton  # noqa: E402
from lightllm.linear_att.kernels.serial import compact_verify_triton, native_verify_triton  # noqa: E402

KERNELS = ("replay-decode", "replay-inline", "replay-precompute", "native", "compact")


def launches(name: str, shape, N: int, W: int, h: int, device) -> None:
    inp = bench.make_inputs(shape, N, W, torch.bfloat16, device)
    if name == "native":
        ssm = torch.randn(N, W, shape.HV, shape.K, shape.V, device=device).mul_(0.05)
        index = torch.zeros(N, device=device, dtype=torch.int32)
        for _ in range(2):
            native_verify_triton(inp.tokens, NativeBuffers(ssm, index), inp.slots, inp.widths)
    elif name == "compact":
        ssm, win, pending, parity = bench.compact_buffers(shape, N, W, torch.float32, torch.bfloat16, device)
        for _ in range(2):
            state = CompactBuffers(ssm[0], *(t[0] for t in win), pending, parity)
            compact_verify_triton(inp.tokens, state, inp.slots, inp.widths)
    else:
        ssm, hist, cursor, parity = bench.replay_buffers(shape, N, 16, torch.float32, device)
        projection = "inline" if name == "replay-decode" else name.removeprefix("replay-")
        for _ in range(2):
            cursor.fill_(h)
            state = ReplayBuffers(ssm, *hist, cursor, parity)
            replay_verify_triton(inp.tokens, state, inp.slots, inp.widths, projection=projection)
    torch.cuda.synchronize()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qwen3-next-tp1,kimi-linear-tp1")
    p.add_argument("--kernels", default=",".join(KERNELS))
    p.add_argument("--n", type=int, default=128)
    p.add_argument("--w", type=int, default=4, help="verify width of the W > 1 kernels")
    p.add_argument("--h", type=int, default=8, help="committed records at the pinned cursor (<= 16 - w)")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    for shape_name in args.shapes.split(","):
        shape = bench.SHAPES[shape_name]
        for name in args.kernels.split(","):
            W = 1 if name == "replay-decode" else args.w
            print(f"{shape_name} {name} W={W} N={args.n} h={args.h}", flush=True)
            launches(name, shape, args.n, W, args.h, device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
