"""Launch configurations of the block-FP8 GEMM: tuned tables (JSON under `configs/`) with a heuristic fallback.

A configuration is `{"BLOCK_M", "BLOCK_N", "GROUP_M", "num_warps", "num_stages", "TMA"}` (the K step is always
one scale group, `block_k`); `TMA` loads the operand tiles through tensor descriptors (Hopper's bulk copies)
where the operands' strides allow it. `CUBLAS` instead runs cuBLASLt's block-scaled GEMM (only from a tuned
table: the tuner checks it on the device, and a borrowed entry stays within whole weight blocks of the shape the
tuner checked). Tables follow `lightllm.kernels.tuned_tables`: one file per device,
entries per Triton version, keyed by `N=..,K=..,block=..x..` and the token count's power-of-two bucket;
`lightllm/tools/tune_fp8_gemm.py` writes them. A lookup takes the tuned bucket within one power of two of the
token count (or the largest tuned bucket above all of them: a taller M keeps the tall tile), else the
heuristic: decode-sized M keeps short tiles that no prefill-tuned entry would give.
"""

from __future__ import annotations

import functools
import math
import re
from pathlib import Path

import torch

from lightllm.kernels.tuned_tables import batch_bucket, device_name, nearest_entry, read_table

CONFIG_DIR = Path(__file__).parent / "configs"
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "GROUP_M", "num_warps", "num_stages", "TMA")
# not a Triton launch: cuBLASLt's block-scaled FP8 GEMM through torch (CUDA 12.9+, 128 x 128 blocks), where the
# tuner found it faster and matching the reference on that device
CUBLAS = {"BACKEND": "cublas"}
# (largest M, BM, widest BN, num_warps, num_stages, TMA): the first row whose bound covers M (None: any M); tall
# tiles for prefill-sized M, short ones for decode batches. Each lowers for sm_90 without spills and with its
# operand loads pipelined (wgmma from shared memory, 3 stages in flight)
HEURISTIC_ROWS = ((16, 16, 64, 4, 3, False), (64, 64, 128, 4, 3, False), (None, 128, 128, 8, 3, True))
# the largest token count a start-up warm-up covers (one chunked prefill)
WARMUP_MAX_TOKENS = 1 << 15
# an untuned weight shape borrows the entries of the tuned shape with its K and block whose N is nearest, at most
# this many powers of two away (a projection fused from tuned parts, a checkpoint that leaves one part unquantized)
MAX_N_LOG2_GAP = 0.5


def shape_key(n: int, k: int, block: tuple[int, int]) -> str:
    return f"N={n},K={k},block={block[0]}x{block[1]}"


def config_path(device: str) -> Path:
    return CONFIG_DIR / f"{device}.json"


@functools.cache
def _table(device: str) -> dict:
    return read_table(config_path(device))


def shape_entries(table: dict, n: int, k: int, block: tuple[int, int]) -> dict:
    """`{bucket: config}` tuned for `[N, K]` weights in `table`, else those of the nearest tuned N with the same K
    and block (within `MAX_N_LOG2_GAP`, ties: the smaller N) when N is whole blocks, else {}."""
    exact = table.get(shape_key(n, k, block))
    if exact is not None or n % block[0]:
        return exact or {}
    pattern = re.compile(rf"N=(\d+),K={k},block={block[0]}x{block[1]}")
    tuned = [int(m.group(1)) for key in table if (m := pattern.fullmatch(key))]
    if not tuned:
        return {}
    nearest = min(tuned, key=lambda t: (abs(math.log2(t / n)), t))
    return table[shape_key(nearest, k, block)] if abs(math.log2(nearest / n)) <= MAX_N_LOG2_GAP else {}


def check_config(config: dict) -> dict:
    """Raise ValueError unless `config` is `CUBLAS` or has every key, power-of-two tiles >= 16 and a positive
    group."""
    if config == CUBLAS:
        return config
    if set(config) != set(CONFIG_KEYS):
        raise ValueError(f"FP8 GEMM config needs exactly {CONFIG_KEYS}, got {config}")
    for b in (config["BLOCK_M"], config["BLOCK_N"]):
        if b < 16 or b & (b - 1):
            raise ValueError(f"FP8 GEMM tiles must be powers of two >= 16, got {config}")
    if config["GROUP_M"] < 1:
        raise ValueError(f"FP8 GEMM GROUP_M must be >= 1, got {config}")
    return config


def heuristic_config(m: int, block: tuple[int, int]) -> dict:
    for max_m, bm, bn, warps, stages, tma in HEURISTIC_ROWS:
        if max_m is None or m <= max_m:
            return {
                "BLOCK_M": bm,
                "BLOCK_N": min(block[0], bn),
                "GROUP_M": 8,
                "num_warps": warps,
                "num_stages": stages,
                "TMA": tma,
            }
    raise AssertionError("HEURISTIC_ROWS ends with an unbounded row")


# every FP8 projection of every step asks: cached, so an eager step pays one dict lookup per projection
@functools.lru_cache(maxsize=4096)
def get_config(m: int, n: int, k: int, block: tuple[int, int], device: torch.device) -> dict:
    """The tuned configuration of `[M, K] x [N, K]ᵀ` on this device (`shape_entries`), else the heuristic one (by
    M bucket)."""
    tuned = nearest_entry(shape_entries(_table(device_name(device)), n, k, block), m, max_log2_gap=1)
    if tuned is not None:
        return check_config(tuned)
    return heuristic_config(batch_bucket(m), block)


def warmup_token_counts(n: int, k: int, block: tuple[int, int], device: torch.device) -> tuple[int, ...]:
    """The smallest token count of each distinct configuration up to `WARMUP_MAX_TOKENS`: a start-up warm-up that
    runs each once compiles every variant a serving step can launch for this weight shape."""
    counts, seen = [], []
    bucket = 1
    while bucket <= WARMUP_MAX_TOKENS:
        config = get_config(bucket, n, k, block, device)
        if config not in seen:
            seen.append(config)
            counts.append(bucket // 2 + 1)
        bucket *= 2
    return tuple(counts)
