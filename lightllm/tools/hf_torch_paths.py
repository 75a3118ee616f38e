"""Run transformers' hybrid models on their pure-torch linear-attention paths.

transformers binds fla / causal_conv1d kernels when the modeling module is imported (if `import fla` works), and on
CPU those run only under Triton's interpreter (100-700x slower). Rather than hiding `fla` in `sys.modules` (which
would break other users of it), `torch_paths()` swaps the modeling modules' kernel wrappers for their torch
fallbacks while a load or forward runs, and restores them afterwards.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect

_MODELING_MODULES = (
    "transformers.models.qwen3_next.modeling_qwen3_next",
    "transformers.models.qwen3_5.modeling_qwen3_5",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    "transformers.models.kimi_linear.modeling_kimi_linear",
)


def _kernel_bound(fn) -> bool:
    """True if `fn` is a transformers kernel wrapper that dispatches to an external package (fla, causal_conv1d)."""
    code = getattr(fn, "__code__", None)
    if code is None or fn.__closure__ is None or "is_new_implementation" not in code.co_freevars:
        return False
    return bool(fn.__closure__[code.co_freevars.index("is_new_implementation")].cell_contents)


def _torch_fallback(fn):
    torch_fn = fn.__wrapped__
    params = set(inspect.signature(torch_fn).parameters)

    # The kernel wrappers drop keyword arguments their implementation does not take; keep that contract.
    @functools.wraps(torch_fn)
    def call(*args, **kwargs):
        return torch_fn(*args, **{k: v for k, v in kwargs.items() if k in params})

    return call


@contextlib.contextmanager
def torch_paths():
    """Within the block, transformers' hybrid models run their pure-torch conv / GDN / KDA paths."""
    patched = []
    try:
        for module_name in _MODELING_MODULES:
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
            for name, value in list(vars(module).items()):
                if callable(value) and _kernel_bound(value):
                    patched.append((module, name, value))
                    setattr(module, name, _torch_fallback(value))
        yield
    finally:
        for module, name, value in reversed(patched):
            setattr(module, name, value)
