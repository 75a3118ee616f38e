"""Compile a `@triton.jit` kernel for sm_90 on a machine without a GPU and report ptxas' register allocation.

Triton lowers to PTX on the CPU and the `ptxas` bundled with it assembles for sm_90a, so a kernel that would fail to
lower on the H200 (or spill) is caught here. The signature mimics a launch: pointers 16-byte aligned and strides
multiples of 16 (what Triton specialises on at these head sizes), so loads vectorise as they do on the device.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
TARGET = GPUTarget("cuda", 90, 32)
INT_PTRS = {"cursor", "parity", "pending", "slots", "widths", "ssm_index", "accepted", "conv_offset"}
ACT_PTRS = {"q", "k", "v", "graw", "braw", "o", "win_k", "win_v"}
SCALARS = {"scale": "fp32", "lower_bound": "fp32"}


@dataclass(frozen=True)
class Allocation:
    registers: int
    spill_store_bytes: int

    def __str__(self) -> str:
        return f"{self.registers} | {self.spill_store_bytes}"


def compile_sm90(jit_fn, constexprs: dict, num_warps: int, num_stages: int = 1) -> Allocation:
    """`jit_fn` (a `@triton.jit` function, heuristics wrappers included) with `constexprs`; every
    other argument typed from its name: `stride_*` int64, the names in `SCALARS` fp32, int32 pointers for per-slot
    scalars, bf16 pointers for activations, fp32 pointers otherwise."""
    while not hasattr(jit_fn, "params"):  # `@triton.heuristics` wraps the JIT function
        jit_fn = jit_fn.fn
    names = jit_fn.arg_names
    sig, consts = {}, {}
    for i, name in enumerate(names):
        if name in constexprs:
            sig[name], consts[(i,)] = "constexpr", constexprs[name]
        elif name.startswith("stride"):
            sig[name] = "i64"
        elif name in SCALARS:
            sig[name] = SCALARS[name]
        else:
            sig[name] = "*i32" if name in INT_PTRS else "*bf16" if name in ACT_PTRS else "*fp32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n][0] == "*" or n.startswith("stride")}
    kernel = triton.compile(
        ASTSource(fn=jit_fn, signature=sig, constexprs=consts, attrs=attrs),
        target=TARGET,
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(kernel.asm["ptx"])
        out = subprocess.run([PTXAS, "-v", "--gpu-name=sm_90a", path, "-o", os.devnull], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"ptxas failed: {out.stderr[-2000:]}")
    regs = spill = -1
    for line in out.stderr.splitlines():
        if "Used" in line and "registers" in line:
            regs = int(line.split("Used")[1].split("registers")[0].strip())
        if "spill stores" in line:
            spill = int(line.split("bytes spill stores")[0].split(",")[-1].strip())
    return Allocation(regs, spill)
