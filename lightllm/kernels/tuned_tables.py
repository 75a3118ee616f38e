"""Tuned launch tables shared by the kernels that have them (fused MoE, block-FP8 GEMM, MLA attention).

A table is one JSON file per device name, `<dir>/<device>.json`:
`{triton_version: {shape_key: {token_bucket: config}}}`. A tuning script measures configurations on the GPU and
merges its entries into the file (`write_entries`); a kernel reads the entries of the running Triton version
(`read_table`) and takes the entry of the token count's power-of-two bucket or the nearest tuned one
(`nearest_entry`), else its own heuristic. Lookups depend on host shapes only, so a CUDA graph captured per batch
bucket keeps its choice.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from pathlib import Path

import torch
import triton


def batch_bucket(num_tokens: int) -> int:
    """The power of two at or above `num_tokens` (tables are tuned per bucket)."""
    return 1 << max(0, math.ceil(math.log2(max(1, num_tokens))))


@functools.cache
def device_name(device: torch.device) -> str:
    """A file-name-safe device name: `NVIDIA_H200` for CUDA, `cpu` otherwise."""
    if device.type != "cuda":
        return device.type
    return re.sub(r"[^A-Za-z0-9]+", "_", torch.cuda.get_device_name(device)).strip("_")


def read_table(path: Path) -> dict:
    """`{shape_key: {bucket: config}}` of this Triton version in the table file `path` ({} when absent)."""
    if not path.is_file():
        return {}
    return json.loads(path.read_text()).get(triton.__version__, {})


def nearest_entry(entries: dict, num_tokens: int, max_log2_gap: float = math.inf):
    """The config of `num_tokens`' bucket, else of the nearest tuned bucket (ties: the smaller) at most
    `max_log2_gap` powers of two away, else of the largest bucket when `num_tokens` is above every tuned one;
    None when nothing qualifies."""
    if not entries:
        return None
    want = math.log2(batch_bucket(num_tokens))
    nearest = min(entries, key=lambda b: (abs(math.log2(int(b)) - want), int(b)))
    if abs(math.log2(int(nearest)) - want) <= max_log2_gap or want > max(math.log2(int(b)) for b in entries):
        return entries[nearest]
    return None


def write_entries(path: str | os.PathLike, key: str, buckets: dict) -> None:
    """Merge `{bucket: config}` of `key` into the table file `path` under this Triton version (other versions,
    keys and buckets are kept); the folder is created when missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = json.loads(path.read_text()) if path.is_file() else {}
    entries = table.setdefault(triton.__version__, {}).setdefault(key, {})
    entries.update({str(b): c for b, c in buckets.items()})
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
