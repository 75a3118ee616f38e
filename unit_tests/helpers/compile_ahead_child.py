"""Run in a subprocess without the interpreter (`python -m unit_tests.helpers.compile_ahead_child MODE`): records
the sm_90 compiles of real launches of two project kernels on the CPU (Triton's JIT under a driver that targets
sm_90 and has no device), lists them, has compile-ahead workers compile the list into an empty Triton cache, starts
them a second time (the first start's marker: none runs), then repeats the launches with the JIT's in-memory caches
cleared and prints, as JSON, the workers' reports and how many files the repeated launches added to the cache (none
when every one was a cache hit). MODE `stale` changes one listed constexpr before the workers run (a list that no
longer matches its launch)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch
from triton.backends.driver import DriverBase
from triton.runtime.driver import driver

from unit_tests.helpers.sm90 import TARGET


class NoDeviceSM90(DriverBase):
    """Enough of a driver for the JIT to specialize CPU tensors and compile for sm_90 (`warmup`: no launch)."""

    def __init__(self) -> None:
        pass

    @classmethod
    def is_active(cls) -> bool:
        return False

    def get_current_target(self):
        return TARGET

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def get_benchmarker(self):
        raise NotImplementedError

    def map_python_to_cpp_type(self, ty):
        raise NotImplementedError


def launch_all() -> list:
    """Compile-only launches (`warmup`) of the two kernels, the RMSNorm one with two constexpr sets."""
    from lightllm.kernels.host_flag import wait_host_flag_kernel
    from lightllm.kernels.rms_norm import rms_norm_kernel

    x = torch.randn(8, 128, dtype=torch.bfloat16)
    out, w = torch.empty_like(x), torch.randn(128, dtype=torch.bfloat16)
    kernels = [wait_host_flag_kernel, rms_norm_kernel]
    wait_host_flag_kernel.warmup(torch.zeros(4, dtype=torch.int32), 3, 100, grid=(1,))
    for residual, block_r in ((False, 4), (True, 2)):
        rms_norm_kernel.warmup(
            x, x, x, w, out, out, 8, 128, 128, 128, 128, 128, 128, 1e-6,
            WEIGHT_MODE=0, GATE_KIND=0, HAS_RESIDUAL=residual, BLOCK_R=block_r, BLOCK_D=128, num_warps=4, grid=(1,),
        )  # fmt: skip
    return kernels


def cache_files(path: str) -> int:
    return sum(len(files) for _, _, files in os.walk(path))


def main(mode: str) -> int:
    from lightllm.kernels.compile_ahead.lists import merge_entries, read_entries
    from lightllm.kernels.compile_ahead.pool import CompileAhead
    from lightllm.kernels.compile_ahead.record import CompileRecorder

    driver.set_active(NoDeviceSM90())
    tmp = tempfile.mkdtemp()
    os.environ["TRITON_CACHE_DIR"] = os.path.join(tmp, "recording")
    with CompileRecorder() as recorder:
        kernels = launch_all()
    listed = os.path.join(tmp, "list.json")
    merge_entries(listed, "group", recorder.entries)
    entries = read_entries(listed, "group")
    if mode == "stale":
        for entry in entries:
            entry["spec"]["constants"] = [[p, 8 if v == 4 else v] for p, v in entry["spec"]["constants"]]
    os.environ["TRITON_CACHE_DIR"] = fresh = os.path.join(tmp, "fresh")
    ahead = CompileAhead(entries, TARGET, workers=2)
    report = ahead.wait(300)
    again = CompileAhead(entries, TARGET, workers=2).wait(300)
    before = cache_files(fresh)
    for kernel in kernels:
        kernel.device_caches.clear()
    t0 = time.perf_counter()
    launch_all()
    print(
        json.dumps(
            {
                "entries": len(entries),
                "refused": dict(recorder.refused),
                "compiled": report.compiled,
                "failed": report.failed,
                "unfinished": report.unfinished,
                "workers": report.workers,
                "files_from_workers": before,
                "files_added_by_launches": cache_files(fresh) - before,
                "compiled_since_wait": ahead.compiled_since_wait(),
                "second_start": [again.workers, again.cached],
                "launch_s": time.perf_counter() - t0,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "match"))
