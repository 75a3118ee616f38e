"""`graph_us` off CUDA: the wall-clock time of one call, in microseconds (the CUDA-graph path runs in
test/gpu/kernel_speed.py on a GPU)."""

from __future__ import annotations

import time

from lightllm.tools.gpu_timing import graph_us

SLEEP_S = 0.02


def test_off_cuda_one_call_is_timed_in_microseconds():
    calls = []
    us = graph_us(lambda: (calls.append(1), time.sleep(SLEEP_S)), iters=5, launches=3, device="cpu")
    assert calls == [1]
    assert us >= SLEEP_S * 1e6


def test_twin_a_call_that_does_not_sleep_is_below_the_sleep():
    assert graph_us(lambda: None, device="cpu") < SLEEP_S * 1e6
