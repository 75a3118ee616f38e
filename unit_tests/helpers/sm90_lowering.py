"""Compile every state kernel for sm_90 at the head shapes we serve; print one row per kernel, exit 1 on a failure.

    python -m unit_tests.helpers.sm90_lowering

Run without `TRITON_INTERPRET` (the interpreter replaces the JIT functions this compiles); the test
`unit_tests/linear_att/kernels/test_sm90_lowering.py` runs it in a clean subprocess. Block sizes are the ones the
wrappers pick on CUDA: BV = 64 x 2 warps for the W = 1 kernels and 32 x 4 otherwise (the shipped tables), 16 for
the tiny heads, and 64 x 8 for the precompute window (its default); window blocks of at least 4 rows, padded
with zero rows to 16 for precompute's tensor-core products; history blocks of 16 rows.
"""

from __future__ import annotations

import sys
import traceback

import triton

from lightllm.linear_att.kernels import replay_decode, replay_fold, replay_window, serial
from unit_tests.helpers.sm90 import compile_sm90

# H, HV, K (= V), gate width, lower bound: the Qwen3-Next and Kimi-Linear TP1 heads and the tiny test models
SHAPES = {
    "qwen3-next": (16, 32, 128, 1, None),
    "kimi-linear-safe-gate": (32, 32, 128, 128, -5.0),
    "tiny-gdn": (2, 4, 16, 1, None),
    "tiny-kda": (2, 2, 16, 16, None),
}
L = 16


def _gates(shape, with_lower_bound: bool = True) -> dict:
    H, HV, D, GK, lower = shape
    c = dict(H=H, HV=HV, K=D, V=D, GK=GK, BK=triton.next_power_of_2(D), BG=triton.next_power_of_2(GK))
    if with_lower_bound:
        c["USE_LOWER_BOUND"] = lower is not None
        if lower is None:
            c["lower_bound"] = None
    return c


def _tile(shape, wide: bool) -> tuple[int, int]:
    bv, num_warps = (64, 2) if wide else (32, 4)
    return max(16, min(bv, shape[2])), num_warps


def cases(shape) -> list[tuple[str, object, dict, int]]:
    """(label, kernel, constexprs, num_warps) of every kernel at one head shape."""
    out = []
    for W in (1, 4):
        bv, nw = _tile(shape, wide=W == 1)
        c = {**_gates(shape), "WMAX": W, "BV": bv}
        out.append((f"native_verify W={W}", serial.serial_verify_kernel, {**c, "COMPACT": False}, nw))
        out.append((f"compact_verify W={W}", serial.serial_verify_kernel, {**c, "COMPACT": True}, nw))
    bv, nw = _tile(shape, wide=False)
    commit = {**_gates(shape, False), "WMAX": 4, "BV": bv}
    out.append(("compact_commit W=4", serial.compact_commit_kernel, commit, nw))
    bv1, nw1 = _tile(shape, wide=True)
    decode = {**_gates(shape), "L": L, "BV": bv1, "BL": L}
    out.append(("replay_decode W=1", replay_decode.replay_decode_kernel, decode, nw1))
    for W in (2, 3, 4, 8):
        for precompute in (False, True):
            bw, dot_pad = replay_window.window_blocks(W, precompute, on_gpu=True)
            wbv, wnw = (max(16, min(64, shape[2])), 8) if precompute else (bv, nw)  # autotune.default_config
            c = {**_gates(shape), "L": L, "WMAX": W, "BV": wbv, "BL": L, "BW": bw, "LOG2_BW": bw.bit_length() - 1}
            c.update(DOT_PAD=dot_pad, PRECOMPUTE=precompute, PRECISION="tf32x3" if precompute else "ieee")
            label = f"replay_window W={W} {'precompute' if precompute else 'inline'}"
            out.append((label, replay_window.replay_window_kernel, c, wnw))
    for has_out in (False, True):
        fold = {**_gates(shape, False), "L": L, "BV": bv, "HAS_OUT": has_out}
        out.append((f"replay_fold out={has_out}", replay_fold.replay_fold_kernel, fold, nw))
    return out


def main() -> int:
    failures = 0
    print("| shape | kernel | warps | registers | spill store bytes |\n|---|---|---|---|---|")
    for shape_name, shape in SHAPES.items():
        for label, kernel, constexprs, num_warps in cases(shape):
            try:
                alloc = compile_sm90(kernel, constexprs, num_warps)
                ok = 0 < alloc.registers <= 255
                row = f"{alloc.registers} | {alloc.spill_store_bytes}"
            except Exception as exc:  # noqa: BLE001 - report every kernel, then fail
                ok, row = False, f"FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                traceback.print_exc(limit=1, file=sys.stderr)
            failures += not ok
            print(f"| {shape_name} | {label} | {num_warps} | {row} |", flush=True)
    print(f"{failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
