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
    load; see `lightllm.worker.kv_sizing`). With --tp N the follower ranks start here and rank 0's runner comes back
    wrapped so that every call changing device state runs on all ranks (`lightllm.worker.tp.lockstep`).
    """
    if args.tp == 1:
        return build_rank_runner(args, info)
    from lightllm.worker.tp.group import TPGroup

    group = TPGroup(args.tp, args.device, num_threads=torch_threads(args))
    return create_tp_runner(args, info, group, owns_group=True)


def torch_threads(args: ServerArgs) -> int | None:
    """CPU ranks share the machine's cores: each gets its share (None on CUDA: the default)."""
    if args.device != "cpu":
        return None
    import torch

    return max(torch.get_num_threads() // args.tp, 1)


def create_tp_runner(args: ServerArgs, info: ModelInfo, group, owns_group: bool = False) -> ModelRunnerProtocol:
    """Rank 0's runner on an existing `TPGroup` (its followers build theirs from the same args); with
    `owns_group` closing the runner also stops the followers."""
    from lightllm.worker.tp.group import Plan
    from lightllm.worker.tp.lockstep import LockstepRunner

    group.send(Plan("build", (args, info)))
    return LockstepRunner(build_rank_runner(args, info, 0, group.size), group, owns_group)


def build_rank_runner(args: ServerArgs, info: ModelInfo, rank: int = 0, size: int = 1):
    """This rank's `ModelRunner`, warmed up (and with its decode and short-prefill graphs captured on CUDA)."""
    from lightllm.worker.runner import ModelRunner, RunnerConfig

    names = {f.name for f in dataclasses.fields(RunnerConfig)}
    flags = {k: v for k, v in dataclasses.asdict(args).items() if k in names and v is not None}
    flags["max_width"] = args.max_width
    # None is meaningful here: the runner sizes the KV cache
    flags["max_total_token_num"] = args.max_total_token_num
    flags.update(tp_rank=rank, tp_size=size)
    if size > 1 and args.device == "cuda":
        flags["device"] = f"cuda:{rank}"
    runner = ModelRunner(RunnerConfig(**flags))
    # fla's chunk kernels autotune on their first call per shape: pay it at start-up, not in a request (CPU: no-op)
    runner.warmup(args.chunked_prefill_size, progress=rank == 0)
    if runner.device.type == "cuda" and not args.disable_cudagraph:
        runner.init_decode_graphs()
        runner.init_prefill_graphs()
    return runner


def load_factory(spec: str) -> Callable[[ServerArgs, ModelInfo], ModelRunnerProtocol]:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)
