"""Build the model runner for the engine process. A factory is named "module:function" so it can be imported in a
spawned process; tests inject a fake one the same way."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable

from lightllm.engine.batch import ModelRunnerProtocol
from lightllm.server.args import ServerArgs
from lightllm.server.model_info import ModelInfo
from lightllm.worker.config import RunnerConfig

logger = logging.getLogger(__name__)

DEFAULT_RUNNER_FACTORY = "lightllm.server.runner_factory:create_runner"


def create_runner(args: ServerArgs, info: ModelInfo) -> ModelRunnerProtocol:
    """The real runner, configured by `runner_config`.

    Without --max_total_token_num the runner sizes its KV cache itself, after loading weights and state (one
    load; see `lightllm.worker.kv_sizing`). With --tp N the follower ranks start here and rank 0's runner comes back
    wrapped so that every call changing device state runs on all ranks (`lightllm.worker.tp.lockstep`).
    """
    use_device(args)
    if args.tp == 1:
        return build_rank_runner(args, info)
    from lightllm.worker.tp.group import TPGroup

    group = TPGroup(args.tp, args.device, num_threads=torch_threads(args), base_device=args.base_device or 0)
    try:
        return create_tp_runner(args, info, group, owns_group=True)
    except BaseException:
        # a runner that failed to build must not leave its followers and process group behind (a later LLM in
        # this process could not open another group)
        group.abandon()
        raise


def rank_device(args: ServerArgs, rank: int = 0, size: int = 1) -> str:
    """The torch device of tensor-parallel rank `rank` of `size`: `cuda:{base_device + rank}` on CUDA (a lone rank
    without `base_device` keeps plain "cuda", the current device), else the device flag as is."""
    if args.device != "cuda" or (size == 1 and args.base_device is None):
        return args.device
    return f"cuda:{(args.base_device or 0) + rank}"


def use_device(args: ServerArgs) -> None:
    """Make rank 0's device this process's current CUDA device, before anything allocates on plain "cuda" (CUDA
    graphs, generators and staging buffers use the current device)."""
    if args.device == "cuda" and args.base_device is not None:
        import torch

        torch.cuda.set_device(args.base_device)


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


def runner_config(args: ServerArgs, rank: int = 0, size: int = 1) -> RunnerConfig:
    """The runner options of tensor-parallel rank `rank` of `size`, from resolved server flags (same names).
    Options a flag leaves unset after `resolve` (replay's outside replay mode, the memory share when the KV size
    is given) keep the runner's defaults."""
    device = rank_device(args, rank, size)
    unset = {"replay_capacity", "replay_projection_mode", "mem_fraction"}
    optional = {name: getattr(args, name) for name in unset if getattr(args, name) is not None}
    return RunnerConfig(
        model_dir=args.model_dir,
        data_type=args.data_type,
        load_format=args.load_format,
        quantization=args.quantization,
        device=device,
        ssm_state_mode=args.ssm_state_mode,
        linear_att_ssm_data_type=args.linear_att_ssm_data_type,
        mtp_step=args.mtp_step,
        max_width=args.max_width,
        max_running_requests=args.max_running_requests,
        # None is meaningful here: the runner sizes the KV cache
        max_total_token_num=args.max_total_token_num,
        max_req_total_len=args.max_req_total_len,
        tp_rank=rank,
        tp_size=size,
        graph_max_batch_size=args.graph_max_batch_size,
        prefill_graph_max_tokens=args.prefill_graph_max_tokens,
        disable_cudagraph=args.disable_cudagraph,
        disable_prefix_cache=args.disable_prefix_cache,
        prefix_cache_state_fraction=args.prefix_cache_state_fraction,
        prefix_cache_state_bytes=args.prefix_cache_state_bytes,
        host_tier_name=args.host_tier_name,
        **optional,
    )


def build_rank_runner(args: ServerArgs, info: ModelInfo, rank: int = 0, size: int = 1):
    """This rank's `ModelRunner`, warmed up (and with its decode and short-prefill graphs captured on CUDA)."""
    from lightllm.models.registry import load_model_config
    from lightllm.worker.compile_ahead import WAIT_S, start_compile_ahead
    from lightllm.worker.runner import ModelRunner
    from lightllm.worker.warmup_steps import start_pin_fla

    config = runner_config(args, rank, size)
    # the shipped compile list's kernels build in other processes while this one loads weights (rank 0's workers
    # fill the Triton cache every rank reads)
    ahead = start_compile_ahead(config, load_model_config(config.model_dir)) if rank == 0 else None
    # importing fla takes seconds: done on a thread while this process loads weights and the workers compile
    fla_pinned = start_pin_fla(config.device)
    try:
        runner = ModelRunner(config)
    except BaseException:
        if ahead is not None:
            ahead.close()
        raise
    runner.pin_fla(fla_pinned)
    if ahead is not None:
        with runner.startup.phase("compiles ahead"):
            logger.info("%s", ahead.wait(WAIT_S).summary())
    # fla's chunk kernels autotune on their first call per shape: pay it at start-up, not in a request (CPU: no-op)
    # a step's prefill rows run as one varlen call: its token count reaches the step budget
    runner.warmup(args.max_num_batched_tokens, progress=rank == 0)
    if runner.device.type == "cuda" and not args.disable_cudagraph:
        with runner.startup.phase("CUDA graphs"):
            runner.init_decode_graphs()
            runner.init_prefill_graphs()
    if ahead is not None:
        logger.info(
            "compiled at start-up beyond the compile list: %d Triton cache entries", ahead.compiled_since_wait()
        )
    logger.info("start-up of rank %d: %s", rank, runner.startup.summary())
    return runner


def load_factory(spec: str) -> Callable[[ServerArgs, ModelInfo], ModelRunnerProtocol]:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)
