"""Refusals of flag combinations that cannot work: each message names the flag to change. `resolve` runs them on
the resolved flags."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightllm.cache.host_tier.arena import MAX_SHARDS
from lightllm.linear_att import REPLAY_CAPACITIES
from lightllm.server.model_info import ModelInfo

if TYPE_CHECKING:
    from lightllm.server.args import ServerArgs


def check_host_tier_flags(args: ServerArgs) -> None:
    """`--host_tier_gb` against the flags it depends on."""
    if args.host_tier_gb is not None and args.host_tier_gb < 0:
        raise ValueError(f"--host_tier_gb must be >= 0, got {args.host_tier_gb}")
    if args.host_tier_gb and (args.disable_prefix_cache or args.run_mode != "normal"):
        raise ValueError("--host_tier_gb backs the prefix cache of --run_mode normal: drop it, or the other flag")
    if args.host_tier_gb and args.tp > MAX_SHARDS:
        raise ValueError(f"--host_tier_gb: the host tier holds entries of at most {MAX_SHARDS} tensor-parallel ranks")


def validate(args: ServerArgs, info: ModelInfo) -> None:
    """Refuse combinations that cannot work; every message says which flag to change."""
    _refuse_open_control_plane(args)
    if args.pd_transport == "cuda_ipc" and args.device == "cpu":
        raise ValueError("--pd_transport cuda_ipc moves device memory: use --device cuda, or --pd_transport host")
    if args.pd_transport == "nixl":
        from lightllm.server.pd.nixl import nixl_module_name

        if nixl_module_name() is None:
            raise ValueError("--pd_transport nixl: no NIXL package is installed (pip install nixl-cu13); or use auto")
    if not args.responses_store_mb >= 0:
        raise ValueError(f"--responses_store_mb must be >= 0, got {args.responses_store_mb}")
    if args.mtp_step < 0 or args.spec_ngram < 0:
        raise ValueError("--mtp_step and --spec_ngram must be >= 0")
    if args.mtp_step and args.spec_ngram:
        raise ValueError("--mtp_step and --spec_ngram are exclusive: pick one speculation method")
    if args.mtp_step and not info.has_mtp:
        raise ValueError(
            f"--mtp_step {args.mtp_step}: {info.model_dir} has no MTP weights (mtp.*); use --spec_ngram K instead"
        )
    if args.ssm_state_mode == "compact" and args.max_width == 1:
        raise ValueError(
            "--ssm_state_mode compact only differs from native under speculation: add --mtp_step N or --spec_ngram K, "
            "or use --ssm_state_mode native"
        )
    if args.ssm_state_mode != "replay":
        for name in ("replay_capacity", "replay_projection_mode"):
            if getattr(args, name) is not None:
                raise ValueError(f"--{name} applies to --ssm_state_mode replay only; drop it or switch the mode")
    elif args.replay_capacity < args.max_width:
        raise ValueError(
            f"--replay_capacity {args.replay_capacity} is below the verify width {args.max_width} "
            f"(drafts + 1): raise it to at least {min(c for c in REPLAY_CAPACITIES if c >= args.max_width)} "
            "or draft fewer tokens"
            if args.max_width <= REPLAY_CAPACITIES[-1]
            else f"verify width {args.max_width} exceeds the largest replay capacity {REPLAY_CAPACITIES[-1]}: draft fewer tokens"
        )
    if args.tp != 1:
        from lightllm.models.registry import load_model_config
        from lightllm.models.tp import tp_size_problem

        problem = tp_size_problem(load_model_config(info.model_dir), args.tp)
        if problem is not None:
            raise ValueError(problem)
    if args.dp < 1:
        raise ValueError(f"--dp must be at least 1, got {args.dp}")
    if args.dp_restart_attempts < 0 or args.dp_restart_backoff_s < 0:
        raise ValueError(
            f"--dp_restart_attempts and --dp_restart_backoff_s must be non-negative, got {args.dp_restart_attempts} "
            f"and {args.dp_restart_backoff_s}"
        )
    if args.dp > 1 and args.run_mode == "pd_master":
        raise ValueError(
            f"--dp {args.dp}: the pd_master runs no engine; give --dp to the prefill or decode nodes (each replica "
            "registers as a node)"
        )
    if args.http_workers < 1:
        raise ValueError(f"--http_workers must be at least 1, got {args.http_workers}")
    if args.http_workers > 1 and (args.run_mode != "normal" or args.dp > 1):
        raise ValueError(
            f"--http_workers {args.http_workers}: more than one HTTP process only with --run_mode normal and --dp 1 "
            f"(got --run_mode {args.run_mode} --dp {args.dp})"
        )
    if not 1 <= args.port <= 65535:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    positive = (
        "graph_max_batch_size",
        "max_running_requests",
        "chunked_prefill_size",
        "max_num_batched_tokens",
        "max_req_total_len",
        "max_total_token_num",
    )
    for name in positive:
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name} must be positive, got {value}")
    if not 1 <= args.max_mixed_prefill_tokens <= args.max_num_batched_tokens:
        raise ValueError(
            f"--max_mixed_prefill_tokens {args.max_mixed_prefill_tokens} must be in 1..--max_num_batched_tokens "
            f"{args.max_num_batched_tokens}: the prompt tokens of a step are part of its budget"
        )
    if args.chunked_prefill_size > args.max_num_batched_tokens:
        raise ValueError(
            f"--chunked_prefill_size {args.chunked_prefill_size} exceeds --max_num_batched_tokens "
            f"{args.max_num_batched_tokens}: a prefill chunk is part of one step's tokens"
        )
    for name, low in (
        ("max_request_body_bytes", 1),
        ("max_request_json_items", 1),
        ("max_queue_len", 0),
        ("max_sequences_per_request", 1),
        ("prefill_graph_max_tokens", 0),
    ):
        if getattr(args, name) < low:
            raise ValueError(f"--{name} must be at least {low}, got {getattr(args, name)}")
    for name in ("http_header_timeout_s", "http_body_timeout_s", "http_keep_alive_s"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name} must be positive, got {getattr(args, name)}")
    if args.progress_timeout_s < 0:
        raise ValueError(f"--progress_timeout_s must be >= 0 (0 turns it off), got {args.progress_timeout_s}")
    if args.log_stats_interval < 0:
        raise ValueError(f"--log_stats_interval must be >= 0 (0 turns it off), got {args.log_stats_interval}")
    if args.prefix_cache_checkpoint_interval <= 0:
        raise ValueError(
            f"--prefix_cache_checkpoint_interval must be positive, got {args.prefix_cache_checkpoint_interval}"
        )
    if args.prefix_cache_state_fraction is not None and args.prefix_cache_state_bytes is not None:
        raise ValueError("--prefix_cache_state_fraction and --prefix_cache_state_bytes both size the pool: give one")
    for name in ("prefix_cache_state_fraction", "prefix_cache_state_bytes"):
        if (getattr(args, name) or 0) < 0:
            raise ValueError(f"--{name} must be >= 0, got {getattr(args, name)}")
    check_host_tier_flags(args)
    if args.max_total_token_num is not None and args.mem_fraction is not None:
        raise ValueError("--max_total_token_num and --mem_fraction both size the KV cache: give only one")
    if args.mem_fraction is not None and not 0.0 < args.mem_fraction <= 1.0:
        raise ValueError(f"--mem_fraction must be in (0, 1], got {args.mem_fraction}")
    if info.max_position_embeddings and args.max_req_total_len > info.max_position_embeddings:
        raise ValueError(
            f"--max_req_total_len {args.max_req_total_len} exceeds the model's max_position_embeddings "
            f"({info.max_position_embeddings}): lower it"
        )
    if args.max_total_token_num is not None and args.max_req_total_len > args.max_total_token_num:
        raise ValueError(
            f"--max_req_total_len {args.max_req_total_len} exceeds --max_total_token_num {args.max_total_token_num}: "
            "one request must fit in the KV cache"
        )


def refuse_unsupported(args: ServerArgs) -> None:
    if args.run_mode != "normal":
        if not 1 <= args.pd_master_port <= 65535:
            raise ValueError(f"--pd_master_port must be in 1..65535, got {args.pd_master_port}")
        for name in ("pd_transfer_timeout_s", "pd_node_timeout_s", "pd_queue_timeout_s", "pd_request_timeout_s"):
            if not getattr(args, name) > 0:
                raise ValueError(f"--{name} must be positive, got {getattr(args, name)}")
    if args.pd_ipc_buffer_mb < 0:
        raise ValueError(f"--pd_ipc_buffer_mb must be >= 0, got {args.pd_ipc_buffer_mb}")


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def _refuse_open_control_plane(args: ServerArgs) -> None:
    """Without a secret anyone who reaches the master or a node's sockets can register nodes and forge messages:
    allowed only when every PD socket stays on loopback."""
    if args.run_mode == "normal" or args.pd_secret:
        return
    exposed = [args.host] if args.run_mode == "pd_master" else [args.host, args.pd_master_ip]
    if any(host not in LOOPBACK_HOSTS for host in exposed):
        raise ValueError(
            f"--run_mode {args.run_mode} beyond loopback needs a shared secret: give the same --pd_secret (or "
            "LIGHTLLM_PD_SECRET, or --api_key) to the pd_master and every node"
        )
