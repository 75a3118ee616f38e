"""One compile-ahead worker process: `python -m lightllm.kernels.compile_ahead.worker JOB INDEX COUNT` compiles
entries INDEX, INDEX + COUNT, ... of the job file (`{"target": [backend, arch, warp_size], "entries": [...]}`)
into the Triton cache, with their launchers where the CUDA driver library is there, and prints one line per entry:
`ok|failed SECONDS KERNEL [error]`. It launches nothing and allocates no device memory (the engine's memory plan
counts the device's free memory while workers run)."""

from __future__ import annotations

import json
import os
import sys
import time

from triton.backends.compiler import GPUTarget

from lightllm.kernels.compile_ahead.spec import compile_spec


def build_launcher(kernel) -> None:
    """The kernel's host launcher (a C module Triton builds once per signature and caches); best effort, since it
    needs the CUDA driver library to link against."""
    try:
        from triton.backends.nvidia.driver import CudaLauncher

        CudaLauncher(kernel.src, kernel.metadata)
    except Exception:
        pass


def main(job_path: str, index: int, count: int) -> int:
    job = json.loads(open(job_path).read())
    target = GPUTarget(*job["target"])
    # the engine process goes first: it loads weights meanwhile and compiles what it needs before these finish
    os.nice(5)
    for entry in job["entries"][index::count]:
        t0 = time.perf_counter()
        try:
            build_launcher(compile_spec(entry["kernel"], entry["spec"], target))
            status, error = "ok", ""
        except Exception as exc:
            status, error = "failed", f" {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        print(f"{status} {time.perf_counter() - t0:.2f} {entry['kernel']}{error}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
