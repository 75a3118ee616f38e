"""One compile-ahead worker process: `python -m lightllm.kernels.compile_ahead.worker JOB` compiles entries of the job
file (`{"target": [backend, arch, warp_size], "entries": [...]}`) into the Triton cache, with their launchers where
the CUDA driver library is there, and prints one line per entry: `ok|failed SECONDS KERNEL [error]`. The job's
workers take entries in the list's order, each the next one no worker has claimed (a file created exclusively in the
job's `claims` folder), so a worker that drew a long compile does not hold up entries others could take. It launches
nothing and allocates no device memory (the engine's memory plan counts the device's free memory while workers run)."""

from __future__ import annotations

import json
import os
import sys
import time

from triton.backends.compiler import GPUTarget

from lightllm.kernels.compile_ahead.spec import compile_spec

# the folder beside the job file where workers claim entries
CLAIMS = "claims"


def build_launcher(kernel) -> None:
    """The kernel's host launcher (a C module Triton builds once per signature and caches); best effort, since it
    needs the CUDA driver library to link against."""
    try:
        from triton.backends.nvidia.driver import CudaLauncher

        CudaLauncher(kernel.src, kernel.metadata)
    except Exception:
        pass


def claim(claims_dir: str, index: int) -> bool:
    """Whether this process is the first to claim entry `index` (its file created here, exclusively)."""
    try:
        os.close(os.open(os.path.join(claims_dir, str(index)), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def main(job_path: str) -> int:
    job = json.loads(open(job_path).read())
    target = GPUTarget(*job["target"])
    claims = os.path.join(os.path.dirname(job_path), CLAIMS)
    # the engine process goes first: it loads weights meanwhile and compiles what it needs before these finish
    os.nice(5)
    for index, entry in enumerate(job["entries"]):
        if not claim(claims, index):
            continue
        t0 = time.perf_counter()
        try:
            build_launcher(compile_spec(entry["kernel"], entry["spec"], target))
            status, error = "ok", ""
        except Exception as exc:
            status, error = "failed", f" {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        print(f"{status} {time.perf_counter() - t0:.2f} {entry['kernel']}{error}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
