"""The device waiting for the host: a stream's later work held until a counter the host writes into pinned memory
reaches a target.

A one-program kernel re-reads an int64 in pinned host memory (which the device reads through unified addressing)
until it reaches `target`, or gives up after `MAX_SPINS` reads (tens of seconds): a host that never writes it
costs a stalled stream, never a hung device. Work queued behind it on the stream (a copy from pinned memory that
the host fills before it writes the counter, the kernels reading that copy) runs once the host is done, while the
host has gone on queueing more work. CUDA only: on a CPU there is no device to hold back, and callers order the
work on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# reads of the counter before the kernel gives up (each crosses PCIe: about a microsecond)
MAX_SPINS = 1 << 25


@triton.jit(do_not_specialize=["target", "max_spins"])
def wait_host_flag_kernel(flag, target, max_spins):
    value = tl.load(flag, volatile=True)
    spins = 0
    while (value < target) & (spins < max_spins):
        value = tl.load(flag, volatile=True)
        spins += 1


class HostFlag:
    """A counter in pinned host memory that a device stream can wait on. `wait_on_device(t)` queues the wait for
    the value `t`; `set(t)` (any thread) releases it; targets only grow (`next_target`)."""

    def __init__(self):
        self.value = torch.zeros(1, dtype=torch.int64, pin_memory=torch.cuda.is_available())
        self._last = 0

    def next_target(self) -> int:
        self._last += 1
        return self._last

    def set(self, target: int) -> None:
        # callers store the data the device reads first; the threads that wrote it were joined by this one, so
        # they are visible to every observer before this store is
        self.value.numpy()[0] = target

    def wait_on_device(self, target: int, max_spins: int = MAX_SPINS) -> None:
        """Hold the current CUDA stream's later work until the counter reaches `target`."""
        wait_host_flag_kernel[(1,)](self.value, target, max_spins, num_warps=1)
