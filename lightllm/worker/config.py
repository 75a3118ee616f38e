"""Start-up options of a ModelRunner, named like the server flags they come from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RunnerConfig:
    model_dir: str
    # activations and weights: "bfloat16" | "float16" | "float32" | "auto" (the checkpoint's dtype)
    data_type: str = "auto"
    # "auto": the checkpoint's weights; "dummy": random weights from config.json alone
    load_format: str = "auto"
    # "fp8": quantize an unquantized checkpoint to block FP8 while loading; None: as the checkpoint is
    quantization: str | None = None
    device: str = "cuda"
    # linear-attention state: "native" | "compact" | "replay"
    ssm_state_mode: str = "native"
    linear_att_ssm_data_type: str = "float32"
    # replay history capacity (tokens) and projection mode ("inline" | "precompute")
    replay_capacity: int = 8
    replay_projection_mode: str = "inline"
    # MTP draft steps per verify (0 = no MTP); the verify width is mtp_step + 1
    mtp_step: int = 0
    # largest verify width of any step; 0 = mtp_step + 1 (n-gram speculation sets it explicitly)
    max_width: int = 0
    max_running_requests: int = 8
    # KV token slots of the full-attention layers (all requests together); None = sized by the runner after
    # weights and state are loaded (CUDA: from mem_fraction; CPU: every request slot at full length, capped)
    max_total_token_num: int | None = 4096
    # fraction of device memory for weights, state and KV when max_total_token_num is None
    mem_fraction: float = 0.8
    # longest request (prompt + output), sizes the per-request slot table
    max_req_total_len: int = 4096
    tp_rank: int = 0
    tp_size: int = 1
    # force the state operator backend ("torch" | "triton"); None = by device
    state_backend: str | None = None
    show_progress: bool = False
    # decode-only steps of up to this many rows replay CUDA graphs (captured per batch bucket at start-up)
    graph_max_batch_size: int = 256
    # a prefill row of at most this many tokens (of a few in its step) replays a CUDA graph (buckets 16, 32, ...);
    # 0: never
    prefill_graph_max_tokens: int = 1024
    disable_cudagraph: bool = False
    # prefix cache: shared KV of committed prefixes + a pool of linear-state checkpoints, sized by bytes or as a
    # fraction of the KV cache's bytes (None and None: 0.1)
    disable_prefix_cache: bool = False
    prefix_cache_state_fraction: float | None = None
    prefix_cache_state_bytes: int | None = None
    # the server's host tier (a shared-memory file in /dev/shm) to attach by name; None: no host tier
    host_tier_name: str | None = None

    @property
    def verify_width(self) -> int:
        return self.max_width or self.mtp_step + 1

    def torch_dtype(self, checkpoint_dtype: str) -> torch.dtype:
        name = checkpoint_dtype if self.data_type == "auto" else self.data_type
        if name not in DTYPES:
            raise ValueError(f"data_type must be one of {tuple(DTYPES)} or 'auto', got {name!r}")
        return DTYPES[name]

    def state_dtype(self) -> torch.dtype:
        if self.linear_att_ssm_data_type not in DTYPES:
            raise ValueError(
                f"linear_att_ssm_data_type must be one of {tuple(DTYPES)}, got {self.linear_att_ssm_data_type!r}"
            )
        return DTYPES[self.linear_att_ssm_data_type]
