"""Memory-safety check for Triton kernels on the CPU: every element a kernel loads or stores (mask applied) must
lie inside one of the tensors passed to that launch.

Triton's interpreter runs kernels on the tensors' real host storage and loads masked-in addresses without
looking at bounds, so a read just past a tensor passes silently on the CPU, and on the GPU hides inside the caching
allocator's segment. This patches the interpreter's memory operations to check each address against the byte
extent of the launch's tensor arguments (the view's extent, not its storage's: a kernel given a slice must not read
its neighbours). Use `bounds_checked()` as a context manager or through the `bounds_checked` fixture.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch
from triton.runtime import interpreter as interp
from triton.tools.tensor_descriptor import TensorDescriptor

_active_ranges: list[list[tuple[int, int, str]]] = []


class OutOfBoundsAccess(AssertionError):
    pass


def _extent(name: str, t: torch.Tensor) -> tuple[int, int, str]:
    """`[lo, hi)` bytes of a strided view (negative strides included)."""
    lo = hi = t.data_ptr()
    for size, stride in zip(t.shape, t.stride()):
        if size == 0:
            return (t.data_ptr(), t.data_ptr(), name)
        span = (size - 1) * stride * t.element_size()
        lo, hi = (lo + span, hi) if span < 0 else (lo, hi + span)
    return (lo, hi + t.element_size(), name)


def _tensor_args(arg_names, args, kwargs) -> list[tuple[int, int, str]]:
    """Extents of the tensor arguments, those inside tuple arguments and the tensors of tensor descriptors
    included (named `arg[i]`, `arg.base`)."""
    pairs = list(zip(arg_names, args)) + list(kwargs.items())
    flat = []
    for name, arg in pairs:
        items = enumerate(arg) if isinstance(arg, tuple) else [(None, arg)]
        flat += [(name if i is None else f"{name}[{i}]", a) for i, a in items]
    flat += [(f"{n}.base", a.base) for n, a in flat if isinstance(a, TensorDescriptor)]
    return [_extent(n, a) for n, a in flat if isinstance(a, torch.Tensor)]


def _check(ptrs, mask, element_bytes: int, what: str) -> None:
    if not _active_ranges:
        return
    ranges = _active_ranges[-1]
    # tensor-descriptor loads pass their mask as a bare array, other loads as a TensorHandle
    mask = mask if isinstance(mask, np.ndarray) else mask.data
    addr = np.broadcast_to(ptrs.data, np.broadcast_shapes(ptrs.data.shape, mask.shape))
    addr = addr[np.broadcast_to(mask.astype(bool), addr.shape)].astype(np.int64)
    if addr.size == 0:
        return
    inside = np.zeros(addr.shape, dtype=bool)
    for lo, hi, _ in ranges:
        inside |= (addr >= lo) & (addr + element_bytes <= hi)
    if inside.all():
        return
    bad = addr[~inside]
    nearest = min(ranges, key=lambda r: min(abs(int(bad[0]) - r[0]), abs(int(bad[0]) - r[1])))
    lo, hi, name = nearest
    raise OutOfBoundsAccess(
        f"{what} of {bad.size} element(s) outside every tensor argument; first at byte {int(bad[0]) - lo} of "
        f"{name!r} (its extent is {hi - lo} bytes)"
    )


def _element_bytes(ptrs) -> int:
    return np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize


@contextlib.contextmanager
def bounds_checked() -> Iterator[None]:
    """Within the block, every interpreted kernel launch checks its loads and stores (raises OutOfBoundsAccess)."""
    real_call = interp.GridExecutor.__call__
    real_load = interp.InterpreterBuilder.create_masked_load
    real_store = interp.InterpreterBuilder.create_masked_store

    def call(self, *args, **kwargs):
        _active_ranges.append(_tensor_args(self.arg_names, args, kwargs))
        try:
            return real_call(self, *args, **kwargs)
        finally:
            _active_ranges.pop()

    # tensor-descriptor loads reach these with keyword arguments
    def load(self, ptrs, mask, other, *rest, **kwargs):
        _check(ptrs, mask, _element_bytes(ptrs), "load")
        return real_load(self, ptrs, mask, other, *rest, **kwargs)

    def store(self, ptrs, value, mask, *rest, **kwargs):
        _check(ptrs, mask, _element_bytes(ptrs), "store")
        return real_store(self, ptrs, value, mask, *rest, **kwargs)

    interp.GridExecutor.__call__ = call
    interp.InterpreterBuilder.create_masked_load = load
    interp.InterpreterBuilder.create_masked_store = store
    try:
        yield
    finally:
        interp.GridExecutor.__call__ = real_call
        interp.InterpreterBuilder.create_masked_load = real_load
        interp.InterpreterBuilder.create_masked_store = real_store
