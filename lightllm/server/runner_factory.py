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
    """The real runner: `RunnerConfig` fields are named like the server flags, so they are copied by name."""
    from lightllm.models.runner import ModelRunner, RunnerConfig

    names = {f.name for f in dataclasses.fields(RunnerConfig)}
    config = RunnerConfig(**{k: v for k, v in dataclasses.asdict(args).items() if k in names})
    return ModelRunner(config)


def load_factory(spec: str) -> Callable[[ServerArgs, ModelInfo], ModelRunnerProtocol]:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)
