"""Compile a `@triton.jit` kernel for sm_90 on a machine without a GPU and report ptxas' register allocation.

Triton lowers to PTX on the CPU and the `ptxas` bundled with it assembles for sm_90a, so a kernel that would fail to
lower on the H200 (or spill) is caught here. The signature mimics a launch: pointers 16-byte aligned and strides
multiples of 16 (what Triton specialises on at these head sizes), so loads vectorise as they do on the device;
arguments a kernel lists in `do_not_specialize` get no alignment, as at a launch.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
PTXAS = os.path.join(_BIN, "ptxas")
NVDISASM = os.path.join(_BIN, "nvdisasm")
TARGET = GPUTarget("cuda", 90, 32)
INT_PTRS = {"cursor", "parity", "pending", "slots", "widths", "ssm_index", "accepted", "conv_offset"}
ACT_PTRS = {"q", "k", "v", "graw", "braw", "o"}
SCALARS = {"scale": "fp32", "lower_bound": "fp32"}
# the tuple arguments of the linear-attention kernels (`lightllm/linear_att/bundles.py` order): q, k, v, graw, braw
# as activations, A_log and dt_bias fp32; each kernel's state pointers (per-slot scalars int32); stride tuples
TUPLES = {
    "tokens": ("*bf16",) * 5 + ("*fp32",) * 2,
    "token_strides": ("i64",) * 8,
    "o_strides": ("i64",) * 2,
    "out_strides": ("i64",) * 2,
}
_REPLAY_STATE = ("*fp32",) * 4 + ("*i32",) * 2
KERNEL_TUPLES = {
    "serial_verify_kernel": {
        "state": ("*fp32", "*i32", "*fp32", "*fp32", "*fp32", "*i32", "*i32"),
        "state_strides": ("i64",) * 11,
    },
    "compact_commit_kernel": {"state": _REPLAY_STATE, "state_strides": ("i64",) * 14},
    "replay_decode_kernel": {"state": _REPLAY_STATE, "state_strides": ("i64",) * 10},
    "replay_window_kernel": {"state": _REPLAY_STATE, "state_strides": ("i64",) * 10},
    "replay_fold_kernel": {"state": _REPLAY_STATE, "state_strides": ("i64",) * 14},
}


@dataclass(frozen=True)
class Allocation:
    registers: int
    spill_store_bytes: int

    def __str__(self) -> str:
        return f"{self.registers} | {self.spill_store_bytes}"


def lower_sm90(
    jit_fn,
    constexprs: dict,
    num_warps: int,
    num_stages: int = 1,
    types: dict | None = None,
    options: dict | None = None,
):
    """Triton's compiled kernel (`.asm["ttgir"]`, `.asm["ptx"]`) of `jit_fn` (a `@triton.jit` function,
    heuristics wrappers included) with `constexprs`; every other argument typed by `types` (name -> Triton type,
    e.g. "*bf16", "i32") or else from its name: the tuples of `TUPLES` / `KERNEL_TUPLES`, `stride_*` int64, the
    names in `SCALARS` fp32, int32 pointers for per-slot scalars, bf16 pointers for activations, fp32 pointers
    otherwise; `options`: further compile options of the launch (e.g. `enable_fp_fusion`)."""
    while not hasattr(jit_fn, "params"):  # `@triton.heuristics` wraps the JIT function
        jit_fn = jit_fn.fn
    names = jit_fn.arg_names
    tuples = {**TUPLES, **KERNEL_TUPLES.get(jit_fn.__name__, {})}
    sig, consts = {}, {}
    for i, name in enumerate(names):
        if name in constexprs:
            sig[name], consts[(i,)] = "constexpr", constexprs[name]
        elif types and name in types:
            sig[name] = types[name]
        elif name in tuples:
            sig[name] = tuples[name]
        elif name.startswith("stride"):
            sig[name] = "i64"
        elif name in SCALARS:
            sig[name] = SCALARS[name]
        else:
            sig[name] = "*i32" if name in INT_PTRS else "*bf16" if name in ACT_PTRS else "*fp32"
    aligned = [[["tt.divisibility", 16]]]
    # what the kernel declines to specialise on (`do_not_specialize`) is not known aligned at a launch either
    unspecialised = set(jit_fn.do_not_specialize or ())
    attrs = {
        (i,): aligned[0]
        for i, n in enumerate(names)
        if (sig[n][0] == "*" or n.startswith("stride")) and n not in unspecialised and i not in unspecialised
    }
    for i, n in enumerate(names):
        if n in tuples:
            attrs.update({(i, j): aligned[0] for j, t in enumerate(tuples[n]) if t[0] == "*" or t == "i64"})
    return triton.compile(
        ASTSource(fn=jit_fn, signature=sig, constexprs=consts, attrs=attrs),
        target=TARGET,
        options={"num_warps": num_warps, "num_stages": num_stages, **(options or {})},
    )


ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def run_lowering_module(module: str) -> str:
    """Run `python -m module` (a lowering script of `unit_tests.helpers`) in a clean subprocess, since a test
    session runs Triton as the interpreter; returns its stdout, or raises AssertionError with its output."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-m", module], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr[-3000:]}"
    return run.stdout


def _ptxas(ptx: str, *flags: str, cubin: str = os.devnull) -> str:
    """Assemble `ptx` for sm_90a; returns ptxas' report (stderr)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run([PTXAS, *flags, "--gpu-name=sm_90a", path, "-o", cubin], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"ptxas failed: {out.stderr[-2000:]}")
    return out.stderr


def allocation(ptx: str) -> Allocation:
    """ptxas' register and spill report of `ptx`."""
    regs = spill = -1
    for line in _ptxas(ptx, "-v").splitlines():
        if "Used" in line and "registers" in line:
            regs = int(line.split("Used")[1].split("registers")[0].strip())
        if "spill stores" in line:
            spill = int(line.split("bytes spill stores")[0].split(",")[-1].strip())
    return Allocation(regs, spill)


def compile_sm90(
    jit_fn, constexprs: dict, num_warps: int, num_stages: int = 1, types: dict | None = None
) -> Allocation:
    """Registers and spills of `jit_fn` on sm_90 (arguments as for `lower_sm90`)."""
    return allocation(lower_sm90(jit_fn, constexprs, num_warps, num_stages, types).asm["ptx"])


_SOURCE = re.compile(r'//## File "([^"]+)", line (\d+)')
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")


def sass_by_line(ptx: str) -> Counter:
    """Static SASS instruction counts of `ptx` on sm_90a, keyed `(source file, line, opcode)`: ptxas keeps Triton's
    line table (`-lineinfo`) and `nvdisasm -g` prints the source line above each instruction group. Counts are
    static: a loop body counts once, whatever its trip count. Instructions before any line marker are keyed
    `("", 0, opcode)`."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        _ptxas(ptx, "-lineinfo", cubin=cubin)
        out = subprocess.run([NVDISASM, "-c", "-g", cubin], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"nvdisasm failed: {out.stderr[-2000:]}")
    counts, where = Counter(), ("", 0)
    for text in out.stdout.splitlines():
        marker = _SOURCE.search(text)
        if marker:
            where = (marker.group(1), int(marker.group(2)))
            continue
        ins = _INSTRUCTION.match(text)
        if ins:
            counts[(*where, ins.group(1))] += 1
    return counts
