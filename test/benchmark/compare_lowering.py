"""Lower every kernel launch of the memcheck cases for sm_90 on the CPU and compare two trees' PTX, without a GPU.

    python test/benchmark/compare_lowering.py --out /tmp/ptx/after                         # this checkout
    git archive REV lightllm test unit_tests | (mkdir -p /tmp/rev && tar -x -C /tmp/rev)
    (cd /tmp/rev && python test/benchmark/compare_lowering.py --out /tmp/ptx/before)     # another revision
    python test/benchmark/compare_lowering.py --compare /tmp/ptx/before /tmp/ptx/after

The cases of `test/gpu/memcheck_cases.py` run on CPU tensors with every Triton launch intercepted: the launch's
arguments are specialised as a CUDA launch would specialise them and the kernel is compiled for sm_90 (Triton and
the `ptxas` bundled with it need no GPU); nothing runs. Launches are numbered in order, so two trees whose cases
launch the same kernels compare launch by launch. `--compare` prints, per kernel, how many launches lower to the
same PTX (debug labels aside), to the same instructions in another order, or to different instructions. A change
that leaves every launch identical needs no device time to show it is as fast as before; anything else does.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import Counter
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "test" / "gpu"))


def _normalised_ptx(ptx: str) -> str:
    """PTX without debug information: `.loc` / `.file` lines, comments, the inlining labels and debug sections."""
    lines = [line for line in ptx.splitlines() if not re.match(r"\s*(\.loc|\.file|//|\$L__tmp\d+:$)", line)]
    return re.sub(r"\.section\s+\.debug.*", "", "\n".join(lines), flags=re.S)


def lower_all(out_dir: Path, only: str) -> int:
    import torch
    from memcheck_cases import Ctx, build_cases
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.compiler import compile as triton_compile
    from triton.runtime import jit

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    seen: dict[str, str] = {}

    def lower(kernel, *args, grid=None, warmup=False, **kwargs):
        binder = jit.create_function_from_signature(kernel.signature, kernel.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
        key = repr(
            (
                kernel.fn.__name__,
                sorted(map(repr, constexprs.values())),
                sorted(signature.items()),
                sorted(map(repr, attrs.values())),
                sorted(options.__dict__.items()),
            )
        )
        if key in seen:
            return None
        name = f"{len(seen):03d}_{kernel.fn.__name__}"
        seen[key] = name
        compiled = triton_compile(
            ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__
        )
        (out_dir / f"{name}.ptx").write_text(_normalised_ptx(compiled.asm["ptx"]))
        return None

    # outputs are allocated zeroed so that a case's checks on them pass and its later launches still happen
    empty, empty_like = torch.empty, torch.empty_like
    zeros = mock.patch.object(torch, "empty", lambda *a, **k: empty(*a, **k).zero_())
    zeros_like = mock.patch.object(torch, "empty_like", lambda *a, **k: empty_like(*a, **k).zero_())
    out_dir.mkdir(parents=True, exist_ok=True)
    failed = 0
    with mock.patch.object(jit.JITFunction, "run", lower), zeros, zeros_like:
        for case in build_cases():
            if only and only not in case.id:
                continue
            try:
                case.run(Ctx("cpu", 0))
            except Exception as err:  # noqa: BLE001 - a case that cannot lower here is reported, the rest go on
                failed += 1
                print(f"{case.id}: {type(err).__name__}: {str(err).strip().splitlines()[-1][:160]}", flush=True)
    print(f"{len(seen)} launches lowered into {out_dir}; {failed} cases stopped early")
    return 0


def compare(before: Path, after: Path) -> int:
    def instructions(text: str) -> list[str]:
        return sorted(re.sub(r"%[a-z]+\d+", "%r", line).strip() for line in text.splitlines() if line.strip())

    rows: dict[str, Counter] = {}
    names = sorted(p.name for p in before.glob("*.ptx"))
    for name in names:
        kernel = name[4:-4]
        other = after / name
        old = (before / name).read_text()
        if not other.exists():
            verdict = "missing"
        elif other.read_text() == old:
            verdict = "identical"
        elif instructions(other.read_text()) == instructions(old):
            verdict = "reordered"
        else:
            verdict = "different"
        rows.setdefault(kernel, Counter())[verdict] += 1
    extra = len(list(after.glob("*.ptx"))) - len(names)
    print("| kernel | identical | reordered | different | missing |\n|---|---|---|---|---|")
    for kernel, c in sorted(rows.items()):
        print(f"| {kernel} | {c['identical']} | {c['reordered']} | {c['different']} | {c['missing']} |")
    if extra:
        print(f"{extra} more launches in {after} than in {before}")
    changed = sum(c["different"] + c["missing"] for c in rows.values()) + abs(extra)
    return 1 if changed else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="lower this tree's launches into this folder")
    p.add_argument("--cases", default="", help="only cases whose id holds this text")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        p.error("run without TRITON_INTERPRET: the interpreter replaces the JIT functions this lowers")
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        p.error("give --out DIR or --compare BEFORE AFTER")
    return lower_all(args.out, args.cases)


if __name__ == "__main__":
    raise SystemExit(main())
