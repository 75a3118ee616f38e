"""Compile a list's entries in worker processes while the caller goes on (`CompileAhead`)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget

from lightllm.kernels.compile_ahead.worker import CLAIMS

# the folder holding the `lightllm` package, so that workers import this copy of it
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])


def default_workers(num_entries: int) -> int:
    """One process per core the caller may use but one (left to the caller), at most 16, at most one per entry."""
    return max(0, min(num_entries, len(os.sched_getaffinity(0)) - 1, 16))


@dataclass
class AheadReport:
    entries: int
    workers: int
    compiled: int = 0
    failed: list[str] = field(default_factory=list)
    unfinished: int = 0
    seconds: float = 0.0
    # an earlier start compiled these entries into this Triton cache: no worker ran
    cached: bool = False

    def summary(self) -> str:
        if self.cached:
            return f"the {self.entries} kernels of the compile list are in the Triton cache already"
        text = f"{self.compiled} of {self.entries} kernels compiled ahead"
        text += f" on {self.workers} processes in {self.seconds:.1f} s"
        if self.failed:
            text += f"; failed: {', '.join(sorted(set(self.failed)))}"
        if self.unfinished:
            text += f"; {self.unfinished} not reached"
        return text


class CompileAhead:
    """Worker processes compiling `entries` (compile-list entries, in the order they are needed) for `target`
    into the Triton cache this process uses. `wait` waits for them (bounded) and reports; `close` stops any left.
    With no entries or no spare core it starts nothing, nor when a marker in the Triton cache says an earlier start
    compiled the same entries into it (a warm machine starts no worker)."""

    def __init__(self, entries: list[dict], target: GPUTarget, workers: int | None = None) -> None:
        self.started = time.perf_counter()
        self.workers = default_workers(len(entries)) if workers is None else min(workers, len(entries))
        self.report = AheadReport(entries=len(entries), workers=self.workers)
        self._procs: list[subprocess.Popen] = []
        self._dir = None
        self._cached_after_wait: set[str] = set()
        self._marker = _marker_path(entries, target)
        if os.path.exists(self._marker):
            self.workers = self.report.workers = 0
            self.report.cached = True
        if self.workers == 0:
            return
        # the job and each worker's lines in files (a pipe nobody reads until `wait` could fill and stall a worker)
        self._dir = tempfile.mkdtemp(prefix="lightllm-compile-ahead-")
        job = os.path.join(self._dir, "job.json")
        os.mkdir(os.path.join(self._dir, CLAIMS))
        with open(job, "w") as f:
            json.dump({"target": [target.backend, target.arch, target.warp_size], "entries": entries}, f)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")])))
        command = [sys.executable, "-m", "lightllm.kernels.compile_ahead.worker", job]
        for index in range(self.workers):
            with open(self._output(index), "w") as out:
                self._procs.append(
                    subprocess.Popen(
                        command,
                        stdout=out,
                        stderr=subprocess.DEVNULL,
                        stdin=subprocess.DEVNULL,
                        env=env,
                    )
                )

    def wait(self, timeout_s: float) -> AheadReport:
        """Wait up to `timeout_s` for every worker, then stop the rest; the report counts each entry's outcome."""
        if not self._procs:
            self.report.seconds = time.perf_counter() - self.started
            self._cached_after_wait = _cache_entries()
            return self.report
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        done = 0
        for index in range(len(self._procs)):
            with open(self._output(index)) as f:
                for line in f.read().splitlines():
                    status, _, rest = line.partition(" ")
                    kernel = rest.split(" ")[1] if rest.count(" ") else ""
                    if status == "ok":
                        self.report.compiled += 1
                    elif status == "failed":
                        self.report.failed.append(kernel)
                    else:
                        continue
                    done += 1
        self.report.unfinished = self.report.entries - done
        self.report.seconds = time.perf_counter() - self.started
        if done == self.report.entries:
            # failed entries would fail again: the next start on this cache need not try
            os.makedirs(os.path.dirname(self._marker), exist_ok=True)
            open(self._marker, "w").close()
        self._cached_after_wait = _cache_entries()
        self.close()
        return self.report

    def compiled_since_wait(self) -> int:
        """Triton cache entries written since `wait` returned: what this process compiled that the list lacked
        (kernels and their launcher modules)."""
        return len(_cache_entries() - self._cached_after_wait)

    def close(self) -> None:
        """Stop any worker left and remove the job's files."""
        for proc in self._procs:
            proc.kill()
            proc.wait()
        self._procs = []
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def _output(self, index: int) -> str:
        return os.path.join(self._dir, f"worker-{index}.txt")


def _marker_path(entries: list[dict], target: GPUTarget) -> str:
    """Where a finished compile of `entries` for `target` leaves its marker: inside the Triton cache, so that a cache
    wiped or moved takes it along."""
    identity = json.dumps(
        [triton.__version__, [target.backend, target.arch, target.warp_size], entries], sort_keys=True
    )
    name = hashlib.sha256(identity.encode()).hexdigest()[:32]
    return os.path.join(knobs.cache.dir, "lightllm_compile_ahead", name)


def _cache_entries() -> set[str]:
    """The entries (one folder per compiled kernel or module) of the Triton cache this process writes."""
    try:
        return set(os.listdir(knobs.cache.dir))
    except FileNotFoundError:
        return set()
