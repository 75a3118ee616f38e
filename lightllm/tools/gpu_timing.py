"""Kernel timing for the benchmarks: the median time of one call over replays of a CUDA graph, so launch overhead
from the host does not count."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def graph_us(
    fn: Callable[[], object], iters: int = 10, launches: int = 10, device: torch.device | str = "cuda"
) -> float:
    """Median µs of one `fn()` over `iters` replays of a CUDA graph of `launches` calls (`fn` runs once first, to
    compile); off CUDA (dry runs on the CPU) the wall-clock time of one call."""
    if torch.device(device).type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / launches)
    return statistics.median(times)


def copy_bandwidth(device: torch.device | str = "cuda") -> float:
    """Bytes per second of a large device-to-device copy (read + write counted), the benchmarks' floor bandwidth;
    NaN off CUDA."""
    if torch.device(device).type != "cuda":
        return float("nan")
    n = 1 << 31
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = graph_us(lambda: dst.copy_(src), iters=7, launches=2, device=device)
    return 2 * n / (us * 1e-6)
