"""Registers and spills of the replay kernels for sm_90, without a GPU: Triton compiles to PTX on the CPU and the
`ptxas` bundled with Triton reports the allocation (`ptxas -v`).

    python test/benchmark/registers_linear_att.py            # the Qwen3-Next / Kimi-Linear head shape, L in {16, 64}

Occupancy is what the memory-bound forward lives on (65536 registers per SM: 64 registers x 128 threads allows 8
programs per SM), so check a kernel change here before spending device time on it.
"""

from __future__ import annotations

import argparse
import os
import sys

import triton

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from lightllm.linear_att.kernels import replay_decode as rd  # noqa: E402
from lightllm.linear_att.kernels import replay_window as rw  # noqa: E402
from unit_tests.helpers.sm90 import compile_sm90  # noqa: E402


def ptxas_report(jit_fn, constants: dict, num_warps: int) -> str:
    """`registers | spill store bytes` of `jit_fn` compiled for sm_90 (see `unit_tests/helpers/sm90.py`)."""
    return str(compile_sm90(jit_fn, constants, num_warps))


def decode(L: int, GK: int, H: int, HV: int, BV: int, num_warps: int) -> str:
    c = dict(H=H, HV=HV, K=128, V=128, GK=GK, L=L, BK=128, BV=BV, BG=triton.next_power_of_2(GK), BL=L)
    c.update(USE_LOWER_BOUND=False, lower_bound=None)
    return ptxas_report(rd.replay_decode_kernel.fn, c, num_warps)


def window(W: int, L: int, GK: int, H: int, HV: int, BV: int, num_warps: int, precompute: bool) -> str:
    c = dict(H=H, HV=HV, K=128, V=128, GK=GK, L=L, WMAX=W, BK=128, BV=BV, BG=triton.next_power_of_2(GK))
    bw, dot_pad = rw.window_blocks(W, precompute, on_gpu=True)
    c.update(BL=max(16, L), BW=bw, LOG2_BW=bw.bit_length() - 1, DOT_PAD=dot_pad, USE_LOWER_BOUND=False)
    c.update(lower_bound=None, PRECOMPUTE=precompute, PRECISION="tf32x3" if precompute else "ieee")
    return ptxas_report(rw.replay_window_kernel.fn, c, num_warps)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--capacities", default="16,64")
    p.add_argument("--widths", default="1,2,4,8")
    args = p.parse_args(argv)
    Ls = [int(x) for x in args.capacities.split(",")]
    Ws = [int(x) for x in args.widths.split(",")]
    print(f"# sm_90 register allocation (ptxas -v), triton {triton.__version__}, K = V = 128\n")
    print("| kernel | W | L | config | registers | spill stores (bytes) |\n|---|---|---|---|---|---|")
    for L in Ls:
        for algo, GK, H, HV in (("GDN", 1, 16, 32), ("KDA", 128, 32, 32)):
            for BV, nw in ((64, 2), (32, 2), (64, 4), (32, 4)):
                print(f"| decode {algo} | 1 | {L} | BV={BV} {nw} warps | {decode(L, GK, H, HV, BV, nw)} |", flush=True)
        for W in Ws:
            if W == 1:
                continue  # plain decode is `decode` above
            for algo, GK, H, HV in (("GDN", 1, 16, 32), ("KDA", 128, 32, 32)):
                for projection in ("inline", "precompute"):
                    for BV, nw in ((32, 4), (64, 4), (32, 2), (64, 8)):
                        regs = window(W, L, GK, H, HV, BV, nw, projection == "precompute")
                        print(f"| window {projection} {algo} | {W} | {L} | BV={BV} {nw} warps | {regs} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
