"""Build the model runner for the engine process. A factory is named "module:function" so it can be imported in a
spawned process; tests inject a fake one the same way."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

from lightllm.engine.batch import ModelRunnerProtocol
from lightllm.server.args import ServerArgs
from lightllm.server.model_info import ModelInfo

DEFAULT_RUNNER_FACTORY = "lightllm.server.runner_factory:create_runner"


def create_runner(args: ServerArgs, info: ModelInfo) -> ModelRunnerProtocol:
    """The real runner: `RunnerConfig` fields are named like the server flags, so they are copied by name.

    Without --max_total_token_num the runner sizes its KV cache itself, after loading weights and state (one
    load; see `lightllm.models.memory`).
    """
    from lightllm.models.runner import ModelRunner, RunnerConfig

    names = {f.name for f in dataclasses.fields(RunnerConfig)}
    flags = {k: v for k, v in dataclasses.asdict(args).items() if k in names and v is not None}
    flags["max_width"] = args.max_width
    # None is meaningful here: the runner sizes the KV cache
    flags["max_total_token_num"] = args.max_total_token_num
    runner = ModelRunner(RunnerConfig(**flags))
    # fla's chunk kernels autotune on their first call per shape: pay it at start-up, not in a request (CPU: no-op)
    runner.warmup(args.chunked_prefill_size, progress=True)
    if runner.device.type == "cuda" and not args.disable_cudagraph:
        runner.init_decode_graphs()
    return runner


def load_factory(spec: str) -> Callable[[ServerArgs, ModelInfo], ModelRunnerProtocol]:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)
