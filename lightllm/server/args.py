"""Server flags: one frozen `ServerArgs`, parsed once, with every "auto" resolved in `resolve`.

`parse_args(argv)` gives the flags as typed; `load_server_args(argv)` adds the checkpoint (building the demo one
when `--model_dir` is absent), resolves and validates. Nothing below this module reads configuration from the
environment; the resolved `ServerArgs` is passed explicitly.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field

from lightllm.linear_att import REPLAY_CAPACITIES
from lightllm.models.quant_config import QUANTIZATION_CHOICES
from lightllm.server.args_checks import refuse_unsupported, validate
from lightllm.server.chat_template import read_chat_template
from lightllm.server.demo_checkpoint import demo_model
from lightllm.server.dp.balancer import BALANCERS
from lightllm.server.dp.placement import place_replicas, visible_cuda_devices
from lightllm.server.model_info import LOAD_FORMATS, ModelInfo, read_model_info
from lightllm.server.prestart import http_processes_for_host
from lightllm.server.sampling_defaults import read_sampling_defaults


def _flag(default, help: str, choices: tuple | None = None, type=None, shown_default: str | None = None, repr=True):
    """`type=bool` makes a switch (off by default); `shown_default` is what --help prints instead of the value."""
    meta = {"help": help, "choices": choices, "type": type, "shown_default": shown_default}
    return field(default=default, metadata=meta, repr=repr)


@dataclass(frozen=True)
class ServerArgs:
    model_dir: str | None = _flag(
        None, "checkpoint folder (config.json, safetensors, tokenizer); a tiny demo model when absent", type=str
    )
    served_model_name: str | None = _flag(
        None, "model id in the OpenAI API (auto: the checkpoint folder's name)", type=str
    )
    host: str = _flag("127.0.0.1", "HTTP listen address", type=str)
    port: int = _flag(8000, "HTTP listen port", type=int)
    tp: int = _flag(1, "tensor-parallel ranks: one engine process per GPU (head counts must divide)", type=int)
    dp: int = _flag(
        1,
        "data-parallel replicas: independent engines behind this server, one request on one replica for its life "
        "(on CUDA, --dp x --tp devices: replica i takes devices i*tp..i*tp+tp-1; with one visible device and "
        "--tp 1 the replicas share it, each with 1/N of --mem_fraction); on a prefill/decode node, N node "
        "processes, each registered with the pd_master",
        type=int,
    )
    dp_balancer: str = _flag(
        "cache_aware",
        "which replica takes a request: cache_aware (the one that took the longest prefix of it, in blocks of "
        "--prefix_cache_checkpoint_interval tokens, unless it is much busier than the least loaded one), "
        "least_loaded, round_robin",
        BALANCERS,
    )
    dp_restart_attempts: int = _flag(
        3,
        "data-parallel replicas: a replica whose engine process died is started again, up to this many failed or "
        "short-lived starts in a row (0: a dead replica stays down)",
        type=int,
    )
    dp_restart_backoff_s: float = _flag(
        1.0, "data-parallel replicas: seconds before restarting a dead replica, doubled per failed start", type=float
    )
    http_workers: int | None = _flag(
        None,
        "HTTP front-end processes sharing --port (the kernel spreads connections over them): each parses requests, "
        "detokenizes and streams its share; /metrics and the admission limit count all of them (more than one "
        "only with --run_mode normal and --dp 1; auto: there, on a GPU, one per 4 usable CPU cores up to 4, else 1)",
        type=int,
    )
    run_mode: str = _flag(
        "normal",
        "process role: normal, or prefill/decode disaggregation's pd_master (HTTP front), prefill or decode node",
        ("normal", "prefill", "decode", "pd_master"),
    )
    pd_master_ip: str = _flag("127.0.0.1", "prefill/decode nodes: address of the pd_master to register with", type=str)
    pd_master_port: int = _flag(8000, "prefill/decode nodes: HTTP port of the pd_master to register with", type=int)
    pd_transfer_timeout_s: float = _flag(
        30.0, "prefill node: seconds to wait for the decode node to confirm a transfer before failing it", type=float
    )
    pd_transport: str = _flag(
        "auto",
        "prefill/decode nodes: how request state moves between nodes: host (staged in host memory, over TCP; any "
        "hosts), cuda_ipc (device to device between nodes of one host, else host), nixl (NIXL reads of the prefill "
        "node's staging buffer; needs the nixl package), auto (cuda_ipc on cuda, else host)",
        ("auto", "host", "cuda_ipc", "nixl"),
    )
    pd_ipc_buffer_mb: int = _flag(
        1024,
        "CUDA IPC or NIXL, MiB: a prefill node's staging buffer for transfers in flight; a decode node's device "
        "memory for copies of transfers waiting for a slot (beyond it they wait in host memory)",
        type=int,
    )
    pd_node_timeout_s: float = _flag(
        5.0, "pd_master: seconds without a heartbeat after which a node is dropped and its requests fail", type=float
    )
    pd_queue_timeout_s: float = _flag(
        30.0, "pd_master: seconds a request waits for a decode node with room before it fails", type=float
    )
    pd_request_timeout_s: float = _flag(
        120.0,
        "pd_master: seconds a routed request may go without any output from its nodes before it fails (503) and "
        "both nodes are told to abort it",
        type=float,
    )
    pd_secret: str | None = _flag(
        None,
        "pd_master and nodes: the shared secret that authenticates registrations and every control-plane message "
        "(default: the API key; required when the master or a node listens beyond loopback)",
        type=str,
        shown_default="$LIGHTLLM_PD_SECRET, else the API key",
        repr=False,
    )
    device: str = _flag(
        "auto", "where the model runs (auto: cuda when a GPU is visible, else cpu)", ("auto", "cpu", "cuda")
    )
    data_type: str = _flag(
        "auto",
        "weight and activation dtype (auto: the checkpoint's on cuda, float32 on cpu)",
        ("auto", "float32", "bfloat16", "float16"),
    )
    load_format: str = _flag(
        "auto",
        "auto: the checkpoint's safetensors; dummy: deterministic random weights drawn from config.json alone (no "
        "weight file is read; for benchmarks at a model's full size)",
        LOAD_FORMATS,
    )
    quantization: str | None = _flag(
        None,
        "fp8: quantize an unquantized checkpoint's linear layers and experts to block FP8 (128 x 128 weight blocks, "
        "per-token activation groups) while loading; a block-FP8 checkpoint is served as FP8 without it",
        QUANTIZATION_CHOICES,
    )
    ssm_state_mode: str = _flag(
        "native", "linear-attention state under speculation: native, compact or replay", ("native", "compact", "replay")
    )
    linear_att_ssm_data_type: str = _flag(
        "float32", "storage dtype of the recurrent (SSM) state", ("float32", "bfloat16")
    )
    replay_capacity: int | None = _flag(
        None,
        "replay history records per request before a fold (auto: 8, or the smallest capacity covering the verify width)",
        REPLAY_CAPACITIES,
        int,
    )
    replay_projection_mode: str | None = _flag(
        None,
        "replay: project the state per token (inline) or once per window (precompute); auto: inline",
        ("inline", "precompute"),
    )
    mtp_step: int = _flag(0, "MTP draft tokens per step (needs a checkpoint with mtp.* weights)", type=int)
    spec_ngram: int = _flag(0, "n-gram prompt-lookup draft tokens per step", type=int)
    max_running_requests: int | None = _flag(
        None,
        "most requests running at once = linear-state slots (auto: 256 on cuda, 16 on cpu; on cuda, fewer where "
        "their state does not fit beside the weights, with a warning)",
        type=int,
    )
    max_total_token_num: int | None = _flag(
        None,
        "KV cache size in tokens (auto: sized from --mem_fraction on cuda; on cpu --max_running_requests x "
        "--max_req_total_len, at most 65536)",
        type=int,
    )
    mem_fraction: float | None = _flag(
        None,
        "fraction of device memory for weights, state and KV (auto: 0.8; exclusive with --max_total_token_num)",
        type=float,
    )
    chunked_prefill_size: int | None = _flag(
        None,
        "longest prefill chunk of one request in one step; longer prompts are prefilled over several steps (auto: "
        "--max_num_batched_tokens)",
        type=int,
    )
    max_num_batched_tokens: int | None = _flag(
        None,
        "token budget of one engine step: decode windows first, prefill chunks fill the rest (auto: "
        "--chunked_prefill_size when given, else 8192 on cuda, 512 on cpu)",
        type=int,
    )
    max_mixed_prefill_tokens: int | None = _flag(
        None,
        "most prompt tokens of a step that also decodes for requests streaming output: bounds their gap between "
        "two tokens while other prompts prefill, at a cost in throughput under load (auto: a quarter of "
        "--max_num_batched_tokens where prefill graphs run, cuda by default; else the whole budget)",
        type=int,
    )
    max_req_total_len: int | None = _flag(
        None,
        "prompt + output tokens cap per request (auto: min(max_position_embeddings, 32768 cuda / 4096 cpu, KV size))",
        type=int,
    )
    max_request_body_bytes: int = _flag(16 * 2**20, "largest HTTP request body accepted; larger ones get 413", type=int)
    max_request_json_items: int = _flag(
        65536,
        "most JSON values (approximately: commas, arrays and objects) one request body may hold; more gets 413 "
        "before parsing, which runs on the event loop and would stall every client meanwhile",
        type=int,
    )
    http_header_timeout_s: float = _flag(
        10.0, "seconds a connection has to send a complete request head; then it is closed", type=float
    )
    http_body_timeout_s: float = _flag(
        30.0, "seconds a request has to send its whole body; then it gets 408 and the connection is closed", type=float
    )
    http_keep_alive_s: float = _flag(5.0, "seconds an idle keep-alive connection stays open", type=float)
    progress_timeout_s: float = _flag(
        120.0,
        "seconds with sequences in flight and no token produced after which /health answers 503, the log names "
        "the waiting requests and lightllm_progress_stalls_total counts it (0: off)",
        type=float,
    )
    max_queue_len: int = _flag(
        1024,
        "sequences that may wait beyond --max_running_requests; requests past it get 429 with Retry-After",
        type=int,
    )
    scheduling_policy: str = _flag(
        "fcfs",
        "the waiting queue's order: fcfs (arrival), or priority (a request's priority, lower first, then arrival; a "
        "running request of a worse priority is preempted for it); requests may set priority only under priority",
        ("fcfs", "priority"),
    )
    max_sequences_per_request: int = _flag(
        256, "most sequences (prompts x n) one request may ask for; more gets 400", type=int
    )
    trust_request_chat_template: bool = _flag(
        False, "accept a chat template sent by the client (it runs in the server: only for trusted clients)", type=bool
    )
    api_key: str | None = _flag(
        None,
        "clients must send 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize, the OpenAPI pages, /pd/nodes "
        "and /dp/replicas (none: no check)",
        type=str,
        shown_default="$LIGHTLLM_API_KEY",
        repr=False,
    )
    tool_call_parser: str = _flag(
        "auto",
        "how tool calls are read from the output: qwen3_json (<tool_call> JSON blocks), qwen3_xml (<tool_call> "
        "function/parameter XML), kimi (tool-call section tokens), none (tool calling off), auto (the model "
        "family's own format)",
        ("auto", "none", "qwen3_json", "qwen3_xml", "kimi"),
    )
    reasoning_parser: str = _flag(
        "none",
        "how reasoning is split from the answer into reasoning_content: think (<think>...</think>), none (left in "
        "the content; what clients that read only content expect), auto (think for every supported model family)",
        ("auto", "none", "think"),
    )
    chat_template: str | None = _flag(
        None, "a Jinja chat template (a file or its text) instead of the checkpoint's", type=str
    )
    generation_config: str = _flag(
        "auto", "sampling defaults for fields a request omits: auto (the checkpoint's generation_config.json), "
        "none (OpenAI's), or a folder holding a generation_config.json", type=str
    )  # fmt: skip
    responses_store_mb: float = _flag(
        512.0,
        "MiB of Responses API responses (and background responses' streams) kept for previous_response_id and GET "
        "/v1/responses/{id} (a request's store: false keeps nothing; past the bound the oldest go first; 0: none kept)",
        type=float,
    )
    responses_store_dir: str | None = _flag(
        None,
        "folder of the stored responses, which outlive the server there (auto: a temporary folder removed at exit)",
        type=str,
    )
    enable_docs: bool = _flag(False, "serve the OpenAPI schema and the /docs and /redoc pages", type=bool)
    keep_serving_after_engine_exit: bool = _flag(
        False,
        "if the engine process dies, keep answering 503 instead of exiting non-zero (for debugging)",
        type=bool,
    )
    log_stats_interval: float = _flag(
        10.0, "seconds between throughput log lines while requests are in flight (0: off)", type=float
    )

    disable_prefix_cache: bool = _flag(
        False, "recompute every prompt instead of resuming repeated prefixes from cached KV + state", type=bool
    )
    prefix_cache_checkpoint_interval: int = _flag(
        2048,
        "tokens between linear-state checkpoints along a prompt (prefill chunks end on these boundaries)",
        type=int,
    )
    prefix_cache_state_fraction: float | None = _flag(
        None,
        "checkpoint pool size as a fraction of the KV cache's bytes (auto: 0.1; exclusive with --prefix_cache_state_bytes)",
        type=float,
    )
    prefix_cache_state_bytes: int | None = _flag(
        None, "checkpoint pool size in bytes (auto: from --prefix_cache_state_fraction)", type=int
    )

    host_tier_gb: float | None = _flag(
        None,
        "host (CPU shared-memory) tier of prefix state shared by this server's engines and data-parallel replicas, "
        "in GiB (0: off; auto: 16, at most half of the free space of /dev/shm; needs the prefix cache)",
        type=float,
    )
    host_tier_name: str | None = _flag(
        None, "the host tier's file in /dev/shm; set by the server for its engine processes, not a user flag", type=str
    )
    base_device: int | None = _flag(
        None,
        "CUDA device of this engine's tensor-parallel rank 0 (rank r on base_device + r); set by the data-parallel "
        "launcher for each replica, not a user flag (auto: the current device, or cuda:r for rank r)",
        type=int,
    )

    disable_cudagraph: bool = _flag(
        False, "run decode and short prefill steps eagerly instead of replaying CUDA graphs", type=bool
    )
    disable_overlap_schedule: bool = _flag(
        False, "read each decode step's tokens back before launching the next (no host/GPU overlap)", type=bool
    )
    graph_max_batch_size: int = _flag(
        256, "decode steps of up to this many requests replay CUDA graphs (one per batch bucket)", type=int
    )
    prefill_graph_max_tokens: int = _flag(
        1024,
        "a prefill of at most this many new tokens (a prefix-cache hit's suffix, a short prompt), one of at most four "
        "in its step, replays a CUDA graph (one per token bucket 16, 32, ...); 0 runs every prefill eagerly",
        type=int,
    )

    @property
    def max_width(self) -> int:
        """Largest verify window: the last accepted token plus the drafts."""
        return max(self.mtp_step, self.spec_ngram) + 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lightllm.server.api_server", description="OpenAI-compatible server"
    )
    for f in dataclasses.fields(ServerArgs):
        meta = f.metadata
        shown = meta.get("shown_default") or ("auto" if f.default is None else f.default)
        # argparse reads "%" in help as a format directive
        text = f"{meta['help']} (default: {shown})".replace("%", "%%")
        if meta["type"] is bool:
            parser.add_argument(f"--{f.name}", action="store_true", default=f.default, help=text)
            continue
        kwargs = {"default": f.default, "help": text}
        if meta["choices"] is not None:
            kwargs["choices"] = meta["choices"]
        kwargs["type"] = meta["type"] or str
        parser.add_argument(f"--{f.name}", **kwargs)
    return parser


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    return ServerArgs(**vars(build_parser().parse_args(argv)))


def _auto_http_workers(args: ServerArgs, on_cuda: bool) -> int:
    if not on_cuda or args.run_mode != "normal" or args.dp > 1:
        return 1
    return http_processes_for_host()


def resolve(args: ServerArgs, info: ModelInfo) -> ServerArgs:
    """The one place where "auto" becomes a value; refuses invalid combinations with what to change (ValueError)."""
    refuse_unsupported(args)
    device = args.device
    if device == "auto":
        device = "cuda" if _cuda_available() else "cpu"
    elif device == "cuda" and not _cuda_available():
        raise ValueError("--device cuda: no CUDA device is visible; use --device cpu (or auto)")
    on_cuda = device == "cuda"
    if on_cuda and args.base_device is None:
        # refuse at start-up a --dp x --tp that the visible devices cannot hold
        place_replicas(args.dp, args.tp, visible_cuda_devices())
    # a step's tokens bound the time decode rows wait for a mixed step's prefill chunks (inter-token latency); on a
    # GPU each step also pays a fixed host cost, which steps below a few thousand tokens cannot hide
    step_tokens = 8192 if on_cuda else 512
    data_type = args.data_type
    if data_type == "auto":
        saved = info.torch_dtype if info.torch_dtype in ("bfloat16", "float16") else "bfloat16"
        data_type = saved if on_cuda else "float32"
    replay = args.ssm_state_mode == "replay"
    cache_len, projection = args.replay_capacity, args.replay_projection_mode
    if replay:
        cache_len = cache_len or min(c for c in REPLAY_CAPACITIES if c >= max(8, args.max_width))
        projection = projection or "inline"
    max_req_total_len = args.max_req_total_len
    if max_req_total_len is None:
        caps = [32768 if on_cuda else 4096, info.max_position_embeddings, args.max_total_token_num]
        max_req_total_len = min(c for c in caps if c)
    step_budget = _auto(args.max_num_batched_tokens, _auto(args.chunked_prefill_size, step_tokens))
    api_key = args.api_key if args.api_key is not None else (os.environ.get("LIGHTLLM_API_KEY") or None)
    resolved = dataclasses.replace(
        args,
        served_model_name=args.served_model_name or os.path.basename(os.path.normpath(info.model_dir)),
        device=device,
        data_type=data_type,
        replay_capacity=cache_len,
        replay_projection_mode=projection,
        max_running_requests=_auto(args.max_running_requests, 256 if on_cuda else 16),
        mem_fraction=args.mem_fraction if args.mem_fraction is not None or args.max_total_token_num else 0.8,
        chunked_prefill_size=_auto(args.chunked_prefill_size, _auto(args.max_num_batched_tokens, step_tokens)),
        max_num_batched_tokens=step_budget,
        max_mixed_prefill_tokens=_auto(args.max_mixed_prefill_tokens, _auto_mixed_cap(args, step_budget, on_cuda)),
        http_workers=_auto(args.http_workers, _auto_http_workers(args, on_cuda)),
        max_req_total_len=max_req_total_len,
        api_key=api_key,
        pd_secret=args.pd_secret or os.environ.get("LIGHTLLM_PD_SECRET") or api_key,
    )
    validate(resolved, info)
    return resolved


# the share of a step's budget that prompts may take beside streaming requests on a GPU: there a step of a few
# prompts replays their prefill graphs beside the decode graph, so a quarter of the default 8192 keeps decode
# rows near their pace (ITL p99 under 4x the median TPOT) for about a sixth of the uncapped output rate
MIXED_CAP_SHARE = 4


def _auto_mixed_cap(args: ServerArgs, step_budget: int, on_cuda: bool) -> int:
    """A quarter of the budget where capped steps replay prefill graphs; the whole budget (no cap) where they run
    eagerly (CPU, graphs off): there a cap multiplies the eager steps without shortening them."""
    graphs = on_cuda and not args.disable_cudagraph and args.prefill_graph_max_tokens > 0
    return max(1, step_budget // MIXED_CAP_SHARE) if graphs else step_budget


def _auto(value, default):
    return default if value is None else value


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def load_server_args(argv: list[str] | None = None, **overrides) -> tuple[ServerArgs, ModelInfo]:
    """Parse `argv` (flags given as `overrides` win), locate the checkpoint, resolve and validate."""
    args = dataclasses.replace(parse_args(argv), **overrides)
    model_dir = args.model_dir
    if model_dir is None:
        model_dir, demo_name = demo_model()
        if args.served_model_name is None:
            args = dataclasses.replace(args, served_model_name=demo_name)
    info = read_model_info(model_dir, args.load_format)
    defaults = read_sampling_defaults(args.generation_config, model_dir)
    template = read_chat_template(args.chat_template) if args.chat_template is not None else None
    info = dataclasses.replace(info, sampling_defaults=tuple(defaults.items()), chat_template=template)
    return resolve(dataclasses.replace(args, model_dir=model_dir), info), info
