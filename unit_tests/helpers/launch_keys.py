"""The compile key of every Triton launch, recorded from interpreted launches on the CPU.

On a GPU, Triton compiles one binary per kernel and key: the constexpr values and launch options, and for every
other argument its type and, unless the kernel lists it in `do_not_specialize`, whether an integer is 1 or a
multiple of 16 and whether a pointer is 16-byte aligned. A key first met in a serving step compiles inside that
step (seconds on a large kernel). Under `launch_keys()` each interpreted launch records the key a compiled launch
would have, computed with Triton's own specialisation function, so a CPU test can assert that the keys of a
serving step do not depend on the batch (its row and token counts, where its metadata sits in a buffer).
"""

from __future__ import annotations

import contextlib
import inspect
from collections import defaultdict
from collections.abc import Iterator

import torch
from triton.backends.compiler import BaseBackend
from triton.runtime import interpreter as interp
from triton.runtime.jit import native_specialize_impl

# launch options that select a binary as constexprs do
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


class LaunchKeys:
    """kernel name -> constexpr part of the key -> the set of runtime parts met with it."""

    def __init__(self):
        self.by_kernel: dict[str, dict[tuple, set[tuple]]] = defaultdict(lambda: defaultdict(set))

    def record(self, fn: interp.InterpretedFunction, args: tuple, kwargs: dict) -> None:
        names = set(fn.kwargs.get("do_not_specialize") or ())
        unaligned = set(fn.kwargs.get("do_not_specialize_on_alignment") or ())
        bound = dict(zip(fn.arg_names, args)) | kwargs
        const, runtime = [], []
        for i, (name, param) in enumerate(inspect.signature(fn.fn).parameters.items()):
            value = bound.get(name, param.default)
            if "constexpr" in str(param.annotation):
                const.append((name, _hashable(value)))
                continue
            specialise = name not in names and i not in names
            align = name not in unaligned and i not in unaligned
            runtime.append((name, _specialise(value, specialise, align)))
        const += [(k, kwargs[k]) for k in _OPTIONS if k in kwargs]
        self.by_kernel[fn.fn.__name__][tuple(const)].add(tuple(runtime))

    def varying(self) -> dict[str, list[str]]:
        """Kernels that met more than one runtime key under one constexpr key, with the arguments that differ."""
        out = {}
        for kernel, by_const in self.by_kernel.items():
            for keys in by_const.values():
                if len(keys) > 1:
                    keys = list(keys)
                    differ = sorted({n for k in keys[1:] for (n, a), (_, b) in zip(keys[0], k) if a != b})
                    out[kernel] = sorted(set(out.get(kernel, [])) | set(differ))
        return out


def _specialise(value, specialise: bool, align: bool):
    if isinstance(value, tuple):
        return tuple(_specialise(v, specialise, align) for v in value)
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float, torch.Tensor)):
        return native_specialize_impl(BaseBackend, value, False, specialise, align)
    return type(value).__name__


def _hashable(value):
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, (int, float, bool, str, type(None))):
        return value
    return repr(value)


@contextlib.contextmanager
def launch_keys() -> Iterator[LaunchKeys]:
    """Within the block, every interpreted launch records its compile key in the yielded `LaunchKeys`."""
    keys = LaunchKeys()
    real_run = interp.InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        keys.record(self, args, kwargs)
        return real_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    interp.InterpretedFunction.run = run
    try:
        yield keys
    finally:
        interp.InterpretedFunction.run = real_run
