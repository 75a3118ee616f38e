"""Launch configurations of the fused MoE: tuned tables (JSON under `configs/`) with a heuristic fallback.

A configuration is `{"BLOCK_M": m, "gate_up": tile, "down": tile}`, a tile being `BLOCK_N`, `BLOCK_K`,
`num_warps`, `num_stages` of one grouped GEMM (BLOCK_M is shared: it fixes the padded layout both GEMMs read).
Tables are one file per device name, `configs/<device>.json`:
`{triton_version: {"E=..,N=..,K=..,top_k=..,dtype=..": {batch_bucket: config}}}` with N the per-rank expert
intermediate size and K the hidden size; `lightllm/tools/tune_fused_moe.py` writes them. A lookup takes the
entry of the token count's power-of-two bucket, else the nearest tuned bucket of the same key up to one power of
two above the largest, else the heuristic. The choice depends on host shapes only, so a CUDA graph captured per batch bucket keeps it.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import triton

from lightllm.kernels.tuned_tables import batch_bucket, device_name, nearest_entry, read_table

__all__ = [
    "batch_bucket",
    "config_path",
    "device_name",
    "get_config",
    "heuristic_config",
    "shape_key",
    "tuned_entries",
]

CONFIG_DIR = Path(__file__).parent / "configs"
TILE_KEYS = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")


def shape_key(num_experts: int, inter: int, hidden: int, top_k: int, dtype: torch.dtype) -> str:
    return f"E={num_experts},N={inter},K={hidden},top_k={top_k},dtype={str(dtype).removeprefix('torch.')}"


def config_path(device: str) -> Path:
    return CONFIG_DIR / f"{device}.json"


@functools.cache
def _table(device: str) -> dict:
    return read_table(config_path(device))


def check_config(config: dict) -> dict:
    """Raise ValueError unless `config` has BLOCK_M and both tiles with every key, powers of two >= 16 for blocks."""
    tiles = [config.get("gate_up"), config.get("down")]
    if "BLOCK_M" not in config or any(not isinstance(t, dict) or set(t) != set(TILE_KEYS) for t in tiles):
        raise ValueError(f"fused MoE config needs BLOCK_M and gate_up/down tiles with {TILE_KEYS}, got {config}")
    for b in [config["BLOCK_M"]] + [t[k] for t in tiles for k in ("BLOCK_N", "BLOCK_K")]:
        if b < 16 or b & (b - 1):
            raise ValueError(f"fused MoE block sizes must be powers of two >= 16, got {config}")
    return config


# rows per expert above which a batch is a prefill's: tall blocks and wide tiles, the GEMMs compute-bound
PREFILL_ROWS_PER_EXPERT = 96
# the prefill class's tiles (tuned on sm_90 at 4096 and 16384 tokens of the served expert shapes); FP8 experts
# take narrower ones: their scaled K steps hold a second accumulator-sized tile, and the wide ones spill
PREFILL_TILES = {
    False: ({"BLOCK_N": 128, "num_warps": 8, "num_stages": 3}, {"BLOCK_N": 256, "num_warps": 8, "num_stages": 4}),
    True: ({"BLOCK_N": 64, "num_warps": 8, "num_stages": 3}, {"BLOCK_N": 128, "num_warps": 8, "num_stages": 4}),
}


def heuristic_config(
    num_tokens: int, num_experts: int, inter: int, hidden: int, top_k: int, dtype, fp8: bool = False
) -> dict:
    """Blocks sized to the expected rows per expert (decode batches give few rows: BLOCK_M 16 wastes least
    padding), column tiles narrowed when few blocks are busy, all clamped to the matrix dims; fp32 halves BLOCK_K
    to keep the same shared-memory bytes. Prefill batches (more than `PREFILL_ROWS_PER_EXPERT` rows per expert)
    take 128-row blocks and the wide `PREFILL_TILES` (`fp8`: block-FP8 experts, whose K step is their scale
    block whatever BLOCK_K says)."""
    rows_per_expert = num_tokens * top_k / num_experts
    if rows_per_expert > PREFILL_ROWS_PER_EXPERT:
        return _prefill_config(inter, hidden, dtype, fp8)
    block_m = 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 48 else 64
    block_k = 64 if dtype == torch.float32 else 128

    # at most this many experts get rows, so at most this many blocks do work
    busy_blocks = min(num_experts, num_tokens * top_k)

    def tile(n: int, k: int) -> dict:
        # decode batches have few busy blocks: narrower column tiles give more programs to stream the weights
        bn = 64 if busy_blocks * triton.cdiv(n, 64) >= 512 else 32
        bn = min(bn, max(16, triton.next_power_of_2(n)))
        bk = min(block_k, max(16, triton.next_power_of_2(k)))
        # 4 warps holding a 64 x 128 weight tile (gate_up: two) or a 64-row block use 230+ registers or spill on
        # sm_90; 8 warps halve that
        warps = 8 if bn * bk >= 8192 or block_m >= 32 else 4
        return {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": 3 if block_m <= 32 else 2}

    return {"BLOCK_M": block_m, "gate_up": tile(inter, hidden), "down": tile(hidden, inter)}


def _prefill_config(inter: int, hidden: int, dtype, fp8: bool) -> dict:
    block_k = 32 if dtype == torch.float32 else 64
    gate_up, down = PREFILL_TILES[fp8]

    def clamped(tile: dict, n: int, k: int) -> dict:
        bn = min(tile["BLOCK_N"], max(16, triton.next_power_of_2(n)))
        return {**tile, "BLOCK_N": bn, "BLOCK_K": min(block_k, max(16, triton.next_power_of_2(k)))}

    return {"BLOCK_M": 128, "gate_up": clamped(gate_up, inter, hidden), "down": clamped(down, hidden, inter)}


def tuned_entries(num_experts: int, inter: int, hidden: int, top_k: int, dtype, device) -> dict:
    """`{batch_bucket: config}` tuned for this shape on this device (empty when none)."""
    return _table(device_name(device)).get(shape_key(num_experts, inter, hidden, top_k, dtype)) or {}


# every MoE layer of every step asks: the answer is cached so an eager step pays one dict lookup per layer
@functools.lru_cache(maxsize=4096)
def get_config(
    num_tokens: int,
    num_experts: int,
    inter: int,
    hidden: int,
    top_k: int,
    dtype: torch.dtype,
    device: torch.device,
    fp8: bool = False,
) -> dict:
    """The tuned configuration of this shape and batch bucket on this device, else the heuristic one (`fp8`:
    block-FP8 experts). A token count more than one power of two above the largest tuned bucket takes the
    heuristic: tables tuned over decode buckets hold small row blocks (BLOCK_M 16 rereads an expert's weights for
    every 16 of its rows), which a prefill's hundreds of rows per expert would pay many times over."""
    entries = tuned_entries(num_experts, inter, hidden, top_k, dtype, device)
    if entries and batch_bucket(num_tokens) <= 2 * max(int(b) for b in entries):
        return check_config(nearest_entry(entries, num_tokens))
    # by bucket, like the tables: the configurations of 1 .. N tokens are those of the powers of two up to N
    return heuristic_config(batch_bucket(num_tokens), num_experts, inter, hidden, top_k, dtype, fp8)
