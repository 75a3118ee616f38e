"""Static sm_90 instruction mix of the decode / verify kernels, per kernel and per source line, without a GPU.

    python test/benchmark/sass_mix_linear_att.py                       # H200 table configs, Qwen3-Next + Kimi-Linear
    python test/benchmark/sass_mix_linear_att.py --kernels window-inline --configs 32x1,64x2 --top 20

Triton lowers on the CPU, the bundled ptxas assembles for sm_90a with Triton's line table, and nvdisasm attributes
every SASS instruction to a source line (`unit_tests/helpers/sm90.py`). The kernels are issue-bound on the H200
(Nsight Compute: ~47% of issue slots busy, DRAM 29%, for the W = 4 window kernel), so the instruction count a
program issues is a fair first estimate of a change's effect, and the per-line table shows where the count comes
from: FFMA of the tile contractions (the essential work), SHFL / BAR / LDS / STS of cross-thread reductions and
layout conversions (the overhead). Counts are static: a loop body counts once, whatever its trip count (the
record loop of `fold_tile_from_records` runs h times). Timing still needs the GPU: `docs/benchmarks.md`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter, defaultdict

import triton

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, ROOT)

from lightllm.linear_att.kernels import replay_decode as rd  # noqa: E402
from lightllm.linear_att.kernels import replay_window as rw  # noqa: E402
from lightllm.linear_att.kernels import serial  # noqa: E402
from unit_tests.helpers import sm90  # noqa: E402

# H, HV, gate width: the TP1 heads the tuned tables cover (K = V = 128)
SHAPES = {"qwen3-next-tp1": (16, 32, 1), "qwen3.5-tp1": (16, 64, 1), "kimi-linear-tp1": (32, 32, 128)}
KERNELS = ("decode", "window-inline", "window-precompute", "native", "compact")
COLUMNS = ("FFMA", "FMUL", "FADD", "MUFU", "SHFL", "BAR", "LDS", "STS", "LDG", "STG", "HMMA")
SOURCE_DIRS = (os.path.dirname(rw.__file__), os.path.join(os.path.dirname(triton.__file__), "language"))


def lower(kernel: str, shape: str, W: int, L: int, BV: int, num_warps: int):
    H, HV, GK = SHAPES[shape]
    c = dict(H=H, HV=HV, K=128, V=128, GK=GK, L=L, BK=128, BV=BV, BG=triton.next_power_of_2(GK))
    c.update(USE_LOWER_BOUND=False, lower_bound=None)
    if kernel == "decode":
        return sm90.lower_sm90(rd.replay_decode_kernel, dict(c, BL=L), num_warps)
    if kernel in ("native", "compact"):
        del c["L"]
        return sm90.lower_sm90(serial.serial_verify_kernel, dict(c, WMAX=W, COMPACT=kernel == "compact"), num_warps)
    precompute = kernel == "window-precompute"
    bw, dot_pad = rw.window_blocks(W, precompute, on_gpu=True)
    c.update(WMAX=W, BL=max(16, L), BW=bw, LOG2_BW=bw.bit_length() - 1, DOT_PAD=dot_pad, PRECOMPUTE=precompute)
    c.update(PRECISION="tf32x3" if precompute else "ieee")
    return sm90.lower_sm90(rw.replay_window_kernel, c, num_warps)


def source_text(path: str, line: int) -> str:
    """The source line, found by file name under the kernel and Triton folders (the line table may name the path
    the kernel was first compiled from, when Triton's cache served it)."""
    for folder in SOURCE_DIRS:
        candidate = os.path.join(folder, os.path.basename(path))
        if os.path.exists(candidate):
            with open(candidate) as f:
                lines = f.read().splitlines()
            return lines[line - 1].strip() if 0 < line <= len(lines) else ""
    return ""


def report(kernel: str, shape: str, W: int, L: int, BV: int, num_warps: int, top: int) -> list[str]:
    compiled = lower(kernel, shape, W, L, BV, num_warps)
    alloc = sm90.allocation(compiled.asm["ptx"])
    counts = sm90.sass_by_line(compiled.asm["ptx"])
    total, per_line = Counter(), defaultdict(Counter)
    for (path, line, op), n in counts.items():
        total[op] += n
        per_line[(os.path.basename(path), line)][op] += n
    head = f"| {kernel} | {shape} | {W} | {L} | {BV}x{num_warps} | {alloc.registers} | {sum(total.values())} | "
    out = [head + " | ".join(str(total[c]) for c in COLUMNS) + " |"]
    if top:
        ranked = sorted(per_line.items(), key=lambda item: -sum(item[1].values()))[:top]
        for (name, line), ops in ranked:
            mix = " ".join(f"{op} {n}" for op, n in ops.most_common(4))
            out.append(f"    {sum(ops.values()):5d}  {name}:{line}  [{mix}]  {source_text(name, line)[:80]}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", default=",".join(KERNELS))
    p.add_argument("--shapes", default="qwen3-next-tp1,kimi-linear-tp1")
    p.add_argument("--configs", default="64x2", help="BVxWARPS launch configs, e.g. 32x1,64x2")
    p.add_argument("--width", type=int, default=4, help="window width of the window kernels")
    p.add_argument("--replay_capacity", type=int, default=16)
    p.add_argument("--top", type=int, default=0, help="also list the N source lines with the most instructions")
    args = p.parse_args(argv)
    print(f"# static sm_90a SASS instruction counts (per warp, loop bodies once), triton {triton.__version__}\n")
    print("| kernel | shape | W | L | config | registers | instructions | " + " | ".join(COLUMNS) + " |")
    print("|---" * (7 + len(COLUMNS)) + "|")
    for kernel in args.kernels.split(","):
        W = 1 if kernel == "decode" else args.width
        for shape in args.shapes.split(","):
            for cfg in args.configs.split(","):
                BV, num_warps = (int(x) for x in cfg.split("x"))
                for row in report(kernel, shape, W, args.replay_capacity, BV, num_warps, args.top):
                    print(row, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
