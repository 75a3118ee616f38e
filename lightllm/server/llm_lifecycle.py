"""Releasing what an offline `LLM` holds: its runner (device memory, CUDA graphs) and, with --tp N, the follower
processes and the process group, so that another `LLM` can start in the same process."""

from __future__ import annotations

import gc
import sys


class ProcessSettings:
    """What building an engine tunes for the whole process, as it was before, to put back at close: the
    collector's thresholds (`quiet_garbage_collector`), torch's intra-op threads and the GIL's switch interval
    (`quiet_host_threads`)."""

    def __init__(self):
        import torch

        self.threshold = gc.get_threshold()
        self.torch_threads = torch.get_num_threads()
        self.switch_interval = sys.getswitchinterval()

    def restore(self) -> None:
        import torch

        gc.set_threshold(*self.threshold)
        torch.set_num_threads(self.torch_threads)
        sys.setswitchinterval(self.switch_interval)


def release_engine(engine, settings: ProcessSettings) -> None:
    """Close `engine`'s runner (a tensor-parallel runner stops its followers and leaves the process group), then
    collect it. The engine's objects were frozen out of the cyclic collector at start-up (`gc.freeze`), and its
    step loop holds reference cycles, so without unfreezing they would never be freed. Nothing here may hold the
    runner once the device cache is emptied: memory freed after that stays in the caching allocator."""
    try:
        _close_runner(engine)
    finally:
        engine.__dict__.clear()
        gc.unfreeze()
        settings.restore()
        gc.collect()
        release_device_cache()


def _close_runner(engine) -> None:
    # its own frame: the runner it looks up is no longer referenced once it returns
    close = getattr(getattr(engine, "runner", None), "close", None)
    if close is not None:
        close()


def release_device_cache() -> None:
    """Hand the CUDA caching allocator's free blocks back to the driver (nothing to do without CUDA)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
