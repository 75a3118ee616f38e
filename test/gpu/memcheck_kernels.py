"""Memory-safety check of every Triton kernel of the project, meant to run under compute-sanitizer:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \\
        python test/gpu/memcheck_kernels.py
    python test/gpu/memcheck_kernels.py --list                     # the cases and the kernels each launches
    python test/gpu/memcheck_kernels.py --tiny-only --device cpu   # the tiny cases under Triton's interpreter
    python test/gpu/memcheck_kernels.py --cases conv,paged         # only cases whose id holds one of these

Every kernel launched by lightllm (each `@triton.jit` function that some host code launches with `kernel[grid]`,
found by scanning the sources) runs once or a few times, through its public entry point (`lightllm.linear_att.ops`,
the state classes, `lightllm.kernels.paged_attention`; the native accept kernel has no other caller than its own
wrapper), at the served head shapes (Qwen3-Next TP1: GDN H=16 HV=32 K=V=128; Qwen3.5: GDN H=16 HV=64; Kimi-Linear
TP1: KDA H=HV=32) and at odd tiny ones (H=3, non-power-of-two head dims, the bounded KDA gate), verify widths 1, 2
and 4, batches of 3 and 7 rows (the highest real slot, slot 0, the HOLD slot and padding rows in each), in every
state mode: native, compact (a merge of pending tokens inside the verify, the all-layer commit, the export on
gathered copies) and replay (a fold inside the verify, both projections, the standalone fold in place and into an
export buffer). The state classes then run the server's own call sequence (prefill, verify/accept rounds through a
fold, a second prefill chunk on top of pending tokens, checkpoint export/import), driven by
`unit_tests/linear_att/scenarios.py`. The prefill conv runs on packed rows whose last row ends exactly at the end
of `x` with a length that is not a multiple of the 16-token tile (the shape of the start-up crash on the H200).

Every tensor a kernel sees is allocated at its exact size (inputs one by one, outputs by the wrappers); with
PYTORCH_NO_CUDA_MEMORY_CACHING=1 each is its own cudaMalloc, so memcheck reports a read or write just past one.
The per-layer storage has two layers and layer 1 runs too, so a launch on the last layer ends at its allocation.
After every launch the device is synchronized (a launch hook), so a fault is reported at the kernel that made it.

fla-core's chunk kernels (the prefill recurrence) are not this project's and autotune for minutes: the state cases
run that step with the torch form (`ops.chunk_delta_rule(backend="torch")`); everything else is the Triton path.

With `--device cpu` the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here) and every launch checks
each load and store against the extents of its tensor arguments (`unit_tests/helpers/bounds_check.py`): the CPU
version of the same check, on the same case code. Prints one line per case, then a table per case and per kernel;
exits 1 if a case raised, launched none of a kernel it names, or a project kernel was launched by no case. The
cases are built in `memcheck_cases.py`; this file finds the project's kernels, runs the cases and reports.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]
# the repository (lightllm, unit_tests) and this folder (the case list) are importable however the script is loaded
for _path in (ROOT, Path(__file__).resolve().parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from memcheck_cases import Case, Ctx, build_cases  # noqa: E402

# ---------------------------------------------------------------------------------------------------------------
# the project's kernels


def project_kernels(root: Path = ROOT) -> dict[str, str]:
    """{kernel name: file} for every `@triton.jit` function under lightllm/ that its module launches (`name[grid]`);
    jitted helpers called from other kernels are not launches."""
    found = {}
    for path in sorted((root / "lightllm").rglob("*.py")):
        src = path.read_text()
        for name in re.findall(r"@triton\.jit(?:\([^)]*\))?\s*\n\s*def (\w+)", src):
            if re.search(rf"\b{name}\[", src):
                found[name] = str(path.relative_to(root))
    return found


# ---------------------------------------------------------------------------------------------------------------
# running


class LaunchLog:
    """Counts the launches of every jitted kernel (compiled or interpreted) and synchronizes after each one."""

    def __init__(self, sync: bool):
        self.counts: Counter[str] = Counter()
        self.sync = sync

    @contextlib.contextmanager
    def installed(self):
        import torch
        from triton.runtime import interpreter, jit

        patches = []
        for cls in (jit.JITFunction, interpreter.InterpretedFunction):
            real = cls.run

            def run(kernel, *args, _real=real, **kwargs):
                launch = not kwargs.get("warmup", False)
                if launch:  # counted before it runs: a launch that faults is named in its case's line
                    self.counts[kernel.fn.__name__] += 1
                out = _real(kernel, *args, **kwargs)
                if launch and self.sync:
                    torch.cuda.synchronize()
                return out

            patches.append(mock.patch.object(cls, "run", run))
        with contextlib.ExitStack() as stack:
            for p in patches:
                stack.enter_context(p)
            yield


def _print_list(cases: list[Case], kernels: dict[str, str]) -> int:
    for c in cases:
        print(f"{c.id:<72} {' '.join(c.kernels)}")
    covered = {k for c in cases for k in c.kernels}
    missing = sorted(set(kernels) - covered)
    print(f"\n{len(cases)} cases; project kernels ({len(kernels)}):")
    for name, path in sorted(kernels.items()):
        n = sum(name in c.kernels for c in cases)
        print(f"  {name:<28} {path:<48} {n} cases")
    if missing:
        print(f"kernels no case launches: {', '.join(missing)}")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--list", action="store_true", help="print the cases and exit (nothing runs, no device needed)")
    p.add_argument("--tiny-only", action="store_true", help="only the tiny shapes (and the shape-free cases)")
    p.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu"),
        help="cpu: Triton's interpreter with a per-launch bounds check (the case code itself, on the CPU)",
    )
    p.add_argument("--cases", default="", help="comma-separated substrings: run only cases whose id holds one")
    args = p.parse_args(argv)
    if args.device == "cpu":
        # the interpreter is chosen when a kernel is defined: before any lightllm kernel module is imported
        os.environ["TRITON_INTERPRET"] = "1"
    kernels = project_kernels()
    cases = [c for c in build_cases() if c.tiny or not args.tiny_only]
    wanted = [s for s in args.cases.split(",") if s]
    if wanted:
        cases = [c for c in cases if any(s in c.id for s in wanted)]
    if args.list:
        return _print_list(cases, kernels)

    import torch

    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("no CUDA device is visible (use --device cpu for the interpreter run)")
            return 2
        if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") != "1":
            print(
                "note: PYTORCH_NO_CUDA_MEMORY_CACHING=1 is not set: the caching allocator hides reads just past a "
                "tensor from memcheck"
            )
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    bounds = contextlib.nullcontext()
    if args.device == "cpu":
        from unit_tests.helpers.bounds_check import bounds_checked

        bounds = bounds_checked()

    log = LaunchLog(sync=args.device == "cuda")
    results = []
    with log.installed(), bounds, torch.no_grad():
        for i, case in enumerate(cases):
            print(f"-> {case.id}", flush=True)
            before = Counter(log.counts)
            start = time.perf_counter()
            try:
                note = case.run(Ctx(args.device, seed=i)) or ""
                if args.device == "cuda":
                    torch.cuda.synchronize()
                launched = log.counts - before
                absent = [k for k in case.kernels if not launched[k]]
                status = f"FAIL: launched no {', '.join(absent)}" if absent else "ok"
            except Exception as exc:  # noqa: BLE001 - report every case, exit 1 at the end
                launched = log.counts - before
                traceback.print_exc()
                status, note = f"ERROR {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160], ""
            seconds = time.perf_counter() - start
            what = ", ".join(f"{k} x{v}" for k, v in sorted(launched.items()))
            results.append((case, what, seconds, status, note))
            print(f"   {status:<4} {seconds:6.2f}s  {what}" + (f"  ({note})" if note else ""), flush=True)

    failures = sum(r[3] != "ok" for r in results)
    print("\n| case | kernels launched | s | status |")
    print("|---|---|---|---|")
    for case, what, seconds, status, note in results:
        print(f"| {case.id} | {what} | {seconds:.2f} | {status}{f' ({note})' if note else ''} |")
    print("\n| kernel | file | launches | cases | shapes |")
    print("|---|---|---|---|---|")
    never = []
    for name, path in sorted(kernels.items()):
        shapes = sorted({c.shape for c, what, *_ in results if f"{name} x" in what})
        ncases = sum(f"{name} x" in what for _, what, *_ in results)
        print(f"| {name} | {path} | {log.counts[name]} | {ncases} | {', '.join(shapes)} |")
        if not log.counts[name]:
            never.append(name)
    if never and not wanted:
        print(f"\nproject kernels no case launched: {', '.join(never)}")
        failures += len(never)
    total = sum(r[2] for r in results)
    print(f"\n{len(results)} cases, {sum(log.counts.values())} launches, {total:.0f} s; failures: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
