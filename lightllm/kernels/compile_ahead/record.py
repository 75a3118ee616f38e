"""Record the kernel variants a process compiles (Triton's post-compile hook), as compile-list entries."""

from __future__ import annotations

import json
from collections import Counter

from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend

from lightllm.kernels.compile_ahead.spec import NotRecordable, check_round_trip, kernel_name, to_spec, tuples_from_json


class CompileRecorder:
    """While active (`with CompileRecorder() as rec:`), every kernel variant the JIT compiles in this process is
    kept in `rec.entries` (`kernel`, `spec`), first compile first, each once; variants that cannot be rebuilt in
    another process (see `spec.NotRecordable`) are counted in `rec.refused` by kernel and left out. `target`
    overrides the compiling device's target (tests)."""

    def __init__(self, target: GPUTarget | None = None) -> None:
        self.target = target
        self.entries: list[dict] = []
        self.refused: Counter[str] = Counter()
        self._seen: set[str] = set()
        self._previous = None

    def __enter__(self) -> CompileRecorder:
        self._previous = knobs.runtime.jit_post_compile_hook
        knobs.runtime.jit_post_compile_hook = self.hook
        return self

    def __exit__(self, *exc) -> None:
        knobs.runtime.jit_post_compile_hook = self._previous

    def hook(self, *, fn, compile, **kwargs) -> bool | None:
        """Triton's `jit_post_compile_hook` (`fn`: the kernel's `JitFunctionInfo`, `compile`: what it compiled)."""
        jit = fn.jit_function
        try:
            self.record(jit, compile)
        except NotRecordable:
            self.refused[kernel_name(jit)] += 1
        if self._previous is not None:
            return self._previous(fn=fn, compile=compile, **kwargs)
        return None

    def record(self, jit, compile: dict) -> None:
        target = self.target or jit.device_caches[compile["device"]][2]
        raw_options = json.loads(compile["specialization_data"])["options"]
        options = make_backend(target).parse_options({k: tuples_from_json(v) for k, v in raw_options.items()})
        attrs = compile["configs"][0]
        spec = to_spec(compile["signature"], compile["constants"], attrs, options, target)
        original = ASTSource(jit, compile["signature"], compile["constants"], attrs)
        check_round_trip(jit, spec, original, options, target)
        entry = {"kernel": kernel_name(jit), "spec": spec}
        identity = json.dumps(entry, sort_keys=True)
        if identity not in self._seen:
            self._seen.add(identity)
            self.entries.append(entry)
