"""fla-core's prefill kernels imported without the rest of the package.

`import fla.ops.gated_delta_rule` first runs `fla/ops/__init__.py`, which imports every op family fla-core ships
(thirty-odd, most of them never served here), and the chunk kernels' `fla.modules.norm.l2norm` runs
`fla/modules/__init__.py` and `fla/modules/norm/__init__.py`, which import the fused norm and activation layers and
with them torch's compiler stack: most of the import's seconds at a server's start-up go to code serving never
calls.

`import_entry_modules` imports the modules serving needs with those package bodies deferred: each package is
registered as a module of its own search path whose body runs on first use of a name it defines (a module
`__getattr__`, PEP 562). Submodules load as usual through the path, so `from fla.ops.kda import chunk_kda` never runs
the body; `from fla.ops import chunk_gla` (a name the body defines) runs it then, in the same module object, and
gets what a plain import gives.

fla also marks its entry points with `torch.compiler.disable`, whose first use imports torch's compiler stack
(`torch._dynamo`: over a second of Python in the engine process, beside its start-up). Nothing here runs under
`torch.compile`, so while the entry modules import, that decorator leaves functions as they are (restored after).

The import takes seconds, so a process that will need it starts it early on a thread of its own
(`import_in_background`); calls are serialized, and a later one returns once the earlier one's modules are in.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import sys
import threading
import types
from collections.abc import Iterator

logger = logging.getLogger(__name__)

# the package bodies deferred, parents first
DEFERRED_PACKAGES = ("fla.ops", "fla.modules", "fla.modules.norm")
# one import at a time: two threads registering the deferred packages at once would each register their own
_IMPORTING = threading.Lock()


def import_entry_modules(entry_modules: tuple[str, ...]) -> None:
    """Import `entry_modules` (fla modules) with `DEFERRED_PACKAGES`' bodies deferred (those already imported are
    left as they are)."""
    with _IMPORTING, _compiler_disable_leaves_functions():
        for name in DEFERRED_PACKAGES:
            if name not in sys.modules:
                _register_deferred(name)
        for name in entry_modules:
            importlib.import_module(name)


@contextlib.contextmanager
def _compiler_disable_leaves_functions() -> Iterator[None]:
    import torch.compiler

    disable = torch.compiler.disable
    torch.compiler.disable = _leave_as_is
    try:
        yield
    finally:
        torch.compiler.disable = disable


def _leave_as_is(fn=None, recursive=True, *, reason=None):
    """`torch.compiler.disable`'s signature, without the compiler: the function itself (or, as `@disable(...)`, a
    decorator giving it)."""
    return (lambda f: f) if fn is None else fn


def import_in_background(entry_modules: tuple[str, ...]) -> threading.Thread:
    """`import_entry_modules` on a daemon thread, started; a failure is logged and left for the next import of
    these modules to raise where it is needed."""

    def run() -> None:
        try:
            import_entry_modules(entry_modules)
        except Exception as exc:
            logger.debug("background import of %s failed: %s", entry_modules, exc)

    thread = threading.Thread(target=run, name="fla-import", daemon=True)
    thread.start()
    return thread


def is_deferred(module: types.ModuleType) -> bool:
    """Whether `module` is a deferred package whose body has not run yet."""
    return getattr(module, "__lightllm_deferred__", False)


def _register_deferred(name: str) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = importlib.import_module(parent_name)
    spec = importlib.util.find_spec(name)
    if spec is None or spec.submodule_search_locations is None:
        raise ImportError(f"{name} is not a package of the installed fla")
    module = types.ModuleType(name)
    module.__spec__, module.__loader__, module.__file__ = spec, spec.loader, spec.origin
    module.__path__, module.__package__ = list(spec.submodule_search_locations), name
    module.__lightllm_deferred__ = True

    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        # a submodule loads by itself (`from fla.ops import kda` asks for the attribute first)
        if importlib.util.find_spec(f"{name}.{attr}") is not None:
            return importlib.import_module(f"{name}.{attr}")
        if module.__dict__.get("__lightllm_deferred__"):
            module.__lightllm_deferred__ = False
            spec.loader.exec_module(module)
        try:
            return module.__dict__[attr]
        except KeyError:
            raise AttributeError(f"module {name!r} has no attribute {attr!r}") from None

    module.__getattr__ = __getattr__
    sys.modules[name] = module
    setattr(parent, child, module)
