"""A background thread doing what the host tier's writer does, without the tier, to tell which part of it slows
the engine's step loop (`closed_loop.py --interfere SPEC`):

    python:MS@RATE   pure Python for MS milliseconds, RATE times a second (holds the interpreter's lock, as the
                     writer's claims and commits do)
    copy:MB@RATE     MB of device memory copied to pinned host memory on a stream of its own, RATE times a second,
                     each waited for with the lock released (as the writer's copies of a spilled checkpoint)

Both at once: two specs joined by `+` (`python:2@300+copy:17@300`). On a CPU engine a copy is a host memcpy.
"""

from __future__ import annotations

import threading
import time

import torch


def parse_spec(spec: str) -> list[tuple[str, float, float]]:
    """`KIND:AMOUNT@RATE[+...]` -> [(kind, amount, rate)]; ValueError naming the part it cannot read."""
    parts = []
    for part in spec.split("+"):
        kind, _, rest = part.partition(":")
        amount, _, rate = rest.partition("@")
        try:
            parsed = (kind, float(amount), float(rate))
        except ValueError:
            raise ValueError(f"--interfere {part!r}: expected KIND:AMOUNT@RATE, e.g. python:2@300") from None
        if kind not in ("python", "copy") or parsed[1] <= 0 or parsed[2] <= 0:
            raise ValueError(f"--interfere {part!r}: KIND is python or copy, AMOUNT and RATE positive")
        parts.append(parsed)
    return parts


class Interference:
    """One thread per part of the spec, from `start` to `stop`; `events` counts what each did."""

    def __init__(self, spec: str, device: str):
        self.parts = parse_spec(spec)
        self.device = device
        self.events = [0] * len(self.parts)
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), name=f"interference-{i}", daemon=True)
            for i in range(len(self.parts))
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> str:
        """Stop the threads; a line saying what they did."""
        self._stop.set()
        for thread in self._threads:
            thread.join()
        return ", ".join(f"{n} x {kind}:{amount:g}" for (kind, amount, _), n in zip(self.parts, self.events))

    def _run(self, index: int) -> None:
        kind, amount, rate = self.parts[index]
        work = _python_work(amount) if kind == "python" else _copy_work(amount, self.device)
        period, due = 1.0 / rate, time.perf_counter()
        while not self._stop.is_set():
            work()
            self.events[index] += 1
            due += period
            pause = due - time.perf_counter()
            if pause > 0:
                self._stop.wait(pause)
            else:
                due = time.perf_counter()  # behind: no burst to catch up


def _python_work(ms: float):
    def spin() -> None:
        end, x = time.perf_counter() + ms / 1e3, 0
        while time.perf_counter() < end:
            x += 1

    return spin


def _copy_work(mb: float, device: str):
    src = torch.empty(int(mb * 2**20), dtype=torch.uint8, device=device)
    if device == "cpu":
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src)
    dst = torch.empty(src.shape, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream(src.device)

    def copy() -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        stream.synchronize()

    return copy
