"""A kernel variant as plain JSON and back: what Triton's JIT hands its compiler (signature, constexpr values,
alignment attributes, options), enough to compile the same variant in another process, for an explicit target and
without a CUDA context. Options equal to the target's defaults are left out (the defaults include machine paths)."""

from __future__ import annotations

import importlib

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.cache import get_cache_key
from triton.runtime.jit import JITFunction, get_cache_invalidating_env_vars


class NotRecordable(ValueError):
    """A variant whose values have no JSON form here, or whose rebuilt form would not hit the same cache entry."""


def find_kernel(name: str) -> JITFunction:
    """The `JITFunction` named `module:qualname` (through `triton.autotune` / `triton.heuristics` wrappers)."""
    module, _, qualname = name.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    for _ in range(4):
        if isinstance(obj, JITFunction):
            return obj
        obj = getattr(obj, "fn", None)
    raise LookupError(f"{name} is not a Triton kernel")


def kernel_name(fn: JITFunction) -> str:
    return f"{fn.fn.__module__}:{fn.fn.__qualname__}"


def to_spec(signature: dict, constants: dict, attrs: dict, options, target: GPUTarget) -> dict:
    """The JSON form of one variant (the arguments `JITFunction._do_compile` received)."""
    defaults = make_backend(target).parse_options({}).__dict__
    return {
        "signature": {k: _plain(v) for k, v in signature.items()},
        "constants": [[list(path), _constant(v)] for path, v in constants.items()],
        "attrs": [[list(path), _plain(v)] for path, v in attrs.items()],
        "options": {k: _plain(v) for k, v in options.__dict__.items() if _plain(v) != _plain(defaults.get(k))},
    }


def to_source(fn: JITFunction, spec: dict, target: GPUTarget) -> tuple[ASTSource, object]:
    """`(source, options)` of a spec for `triton.compile` on `target`."""
    backend = make_backend(target)
    signature = {k: tuples_from_json(v) for k, v in spec["signature"].items()}
    constants = {tuple(path): _unconstant(v) for path, v in spec["constants"]}
    attrs = {tuple(path): v for path, v in spec["attrs"]}
    options = backend.parse_options({k: tuples_from_json(v) for k, v in spec["options"].items()})
    return ASTSource(fn, signature, constants, attrs), options


def cache_key(src: ASTSource, options, target: GPUTarget) -> str:
    """The key Triton files a compile of `src` under (what two compiles must share to hit one cache entry)."""
    return get_cache_key(src, make_backend(target), options, get_cache_invalidating_env_vars())


def check_round_trip(fn: JITFunction, spec: dict, original: ASTSource, options, target: GPUTarget) -> None:
    """Raise `NotRecordable` unless the spec rebuilds a source and options with the original's cache key."""
    rebuilt, rebuilt_options = to_source(fn, spec, target)
    if cache_key(rebuilt, rebuilt_options, target) != cache_key(original, options, target):
        raise NotRecordable(f"{kernel_name(fn)}: the rebuilt variant has another cache key")


def compile_spec(name: str, spec: dict, target: GPUTarget):
    """Compile one variant into the Triton cache (a cache hit when it is there already); returns the kernel."""
    src, options = to_source(find_kernel(name), spec, target)
    return triton.compile(src, target=target, options=options.__dict__)


def _plain(value):
    """Tuples as lists, recursively (JSON's form); anything not JSON-able is refused."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise NotRecordable(f"no JSON form for {value!r}")


def tuples_from_json(value):
    """Lists back to tuples, recursively (Triton's signatures and options hold tuples)."""
    return tuple(tuples_from_json(v) for v in value) if isinstance(value, list) else value


def _constant(value):
    if isinstance(value, tl.dtype):
        return {"dtype": str(value)}
    if isinstance(value, tl.constexpr):
        return {"constexpr": _plain(value.value)}
    if isinstance(value, (tuple, list)):
        return {"tuple": [_constant(v) for v in value]}
    return _plain(value)


def _unconstant(value):
    if isinstance(value, dict):
        if "dtype" in value:
            return tl.dtype(value["dtype"])
        if "constexpr" in value:
            return tl.constexpr(tuples_from_json(value["constexpr"]))
        return tuple(_unconstant(v) for v in value["tuple"])
    return value
