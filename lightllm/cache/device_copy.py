"""Host-to-device copies that never make the host wait for the GPU.

A non-blocking copy from ordinary (pageable) host memory may be staged by the driver in a way that waits for the
stream to drain, which would stall the host behind the step it just launched. Copying through a pinned block of
PyTorch's caching host allocator keeps the copy asynchronous; the allocator does not hand the block out again
before the copy that reads it has run, so the caller may reuse its numpy array at once.
"""

from __future__ import annotations

import numpy as np
import torch


def _pinned(host: torch.Tensor) -> torch.Tensor:
    """A pinned copy of `host`. `Tensor.pin_memory()` would first ask the driver whether `host` is pinned already
    (16-50 us a call on a busy host, several calls a step); a fresh block of the caching host allocator is not."""
    out = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
    out.copy_(host)
    return out


def to_device(values: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """`values` on `device` (the same tensor's data for a CPU device; an asynchronous pinned copy for CUDA)."""
    host = torch.from_numpy(np.ascontiguousarray(values)) if isinstance(values, np.ndarray) else values
    if device.type != "cuda":
        return host.to(device)
    return _pinned(host).to(device, non_blocking=True)


def copy_to_device(dst: torch.Tensor, values: np.ndarray) -> None:
    """`dst.copy_(values)` without making the host wait (see `to_device`)."""
    host = torch.from_numpy(np.ascontiguousarray(values))
    if dst.device.type == "cuda":
        dst.copy_(_pinned(host), non_blocking=True)
    else:
        dst.copy_(host)


def list_to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A list of Python numbers (or nested lists) as a `dtype` tensor on `device`, without making the host wait:
    `torch.tensor(values, device=cuda)` copies from pageable memory and waits for the stream to drain, which in a
    step stalls the host behind the work it has just launched (see `to_device`)."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host
    return _pinned(host).to(device, non_blocking=True)
