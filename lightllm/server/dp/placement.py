"""Which CUDA devices the ranks of each data-parallel replica run on.

With at least `dp x tp` visible devices, replica i takes devices `i*tp .. i*tp+tp-1` (tensor-parallel rank r of it
runs on device `i*tp + r`), each with the full `--mem_fraction`. With exactly one visible device and `--tp 1`, the
replicas share device 0, each with 1/dp of `--mem_fraction`: one GPU serving several replicas is a deliberate
set-up (make only that GPU visible). Any other shortfall is refused at start-up: quietly stacking replicas on some
of several GPUs would leave the others idle and the stacked ones short of memory.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    # per replica, the CUDA device index of each tensor-parallel rank (rank order)
    devices: tuple[tuple[int, ...], ...]
    # the replicas share one device and split the memory share between them
    shared: bool

    def base_device(self, replica: int) -> int:
        """The device of the replica's rank 0; rank r runs on `base_device + r`."""
        return self.devices[replica][0]

    def mem_fraction(self, mem_fraction: float) -> float:
        """One replica's share of its device(s), from the `--mem_fraction` the user gave."""
        return mem_fraction / len(self.devices) if self.shared else mem_fraction


def place_replicas(dp: int, tp: int, num_devices: int) -> Placement:
    """The devices of `dp` replicas of `tp` ranks each over `num_devices` visible CUDA devices (see the module
    docstring); ValueError, naming what to change, when they do not fit."""
    if dp < 1 or tp < 1:
        raise ValueError(f"--dp and --tp must be at least 1, got --dp {dp} --tp {tp}")
    if dp * tp <= num_devices:
        return Placement(tuple(tuple(range(i * tp, (i + 1) * tp)) for i in range(dp)), shared=False)
    if tp == 1 and num_devices == 1:
        return Placement(((0,),) * dp, shared=True)
    if dp == 1:
        raise ValueError(f"--tp {tp} needs {tp} CUDA devices, {num_devices} visible")
    share = (
        "replicas share a device only with --tp 1 and exactly one device visible (CUDA_VISIBLE_DEVICES)"
        if num_devices != 1
        else "replicas share the one visible device only with --tp 1"
    )
    raise ValueError(
        f"--dp {dp} x --tp {tp} needs {dp * tp} CUDA devices, {num_devices} visible: lower --dp or --tp ({share})"
    )


def visible_cuda_devices() -> int:
    """CUDA devices this process sees (respects CUDA_VISIBLE_DEVICES)."""
    import torch

    return torch.cuda.device_count()
