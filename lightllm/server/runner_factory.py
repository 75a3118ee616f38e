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


# KV tokens on CPU when --max_total_token_num is not given (no device memory to size it from)
CPU_MAX_KV_TOKENS = 1 << 16
# device memory kept free for activations when sizing the KV cache from --mem_fraction
ACTIVATION_RESERVE_BYTES = 1 << 30


def create_runner(args: ServerArgs, info: ModelInfo) -> ModelRunnerProtocol:
    """The real runner: `RunnerConfig` fields are named like the server flags, so they are copied by name.

    Without --max_total_token_num the KV cache is sized here: on CPU to every slot at full length (capped); on
    CUDA from the memory left after weights and state, within --mem_fraction (the runner is built once small to
    measure, then rebuilt at the measured size).
    """
    from lightllm.models.runner import ModelRunner, RunnerConfig

    names = {f.name for f in dataclasses.fields(RunnerConfig)}
    flags = {k: v for k, v in dataclasses.asdict(args).items() if k in names and v is not None}
    flags["max_width"] = args.max_width
    if args.max_total_token_num is None and args.device == "cpu":
        flags["max_total_token_num"] = min(args.max_running_requests * args.max_req_total_len, CPU_MAX_KV_TOKENS)
    elif args.max_total_token_num is None:
        flags["max_total_token_num"] = _kv_tokens_for_memory(ModelRunner, RunnerConfig, flags, args)
    runner = ModelRunner(RunnerConfig(**flags))
    # fla's chunk kernels autotune on their first call per shape: pay it at start-up, not in a request (CPU: no-op)
    runner.warmup(args.chunked_prefill_size, progress=True)
    return runner


def _kv_tokens_for_memory(runner_cls, config_cls, flags: dict, args: ServerArgs) -> int:
    import torch

    probe = runner_cls(config_cls(**{**flags, "max_total_token_num": args.max_req_total_len}))
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    used_by_others = total - free - torch.cuda.memory_allocated()
    budget = total * args.mem_fraction - used_by_others - torch.cuda.memory_allocated() - ACTIVATION_RESERVE_BYTES
    bytes_per_token = probe.kv_bytes_per_token()
    del probe
    torch.cuda.empty_cache()
    tokens = int(budget // bytes_per_token) + args.max_req_total_len
    if tokens < args.max_req_total_len:
        raise ValueError(
            f"--mem_fraction {args.mem_fraction} leaves no room for a {args.max_req_total_len}-token KV cache: "
            "raise --mem_fraction or lower --max_req_total_len / --max_running_requests"
        )
    return tokens


def load_factory(spec: str) -> Callable[[ServerArgs, ModelInfo], ModelRunnerProtocol]:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)
