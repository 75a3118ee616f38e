"""Launch configurations of the linear-attention kernels: tuned tables, lookup, and the search that fills them.

A configuration (`KernelConfig`: BV, num_warps, num_stages) is chosen per kernel family and shape. Lookup is a
dict access keyed by `TuneKey` (GPU name, Triton version, state and activation dtypes, heads, head dims, gate
width, verify width, replay capacity, projection mode); a missing entry falls back to `default_config`.

Tables are JSON files (`gdn/tuned/*.json`, `kda/tuned/*.json` ship with the package). `load_tables()` reads them
into the process-wide `TABLE` once at start-up, before any CUDA-graph capture, so every later launch (and every
captured graph) uses one fixed layout. Native verify, compact verify and compact commit share the family
"serial": they must run with the same tiling to stay bitwise equal.

`tune(...)` searches the candidates on disposable scratch state (fresh buffers it allocates; never serving state)
and returns the table entries; the benchmark script's `--tune` mode writes them to a file.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

FAMILIES = ("serial", "replay", "replay_fold")
TABLE_VERSION = 1


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of one kernel: V tile width, warps per program, software-pipelining stages."""

    block_v: int
    num_warps: int
    num_stages: int

    @classmethod
    def from_dict(cls, d: dict) -> KernelConfig:
        return cls(int(d["block_v"]), int(d["num_warps"]), int(d["num_stages"]))


@dataclass(frozen=True)
class TuneKey:
    """What a tuned configuration depends on. `width` is the padded verify width Wmax; `capacity` is 0 outside
    replay; `projection` is "" outside replay verify."""

    family: str
    gpu: str
    triton: str
    state_dtype: str
    act_dtype: str
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    gate_dim: int
    width: int
    capacity: int = 0
    projection: str = ""

    def to_str(self) -> str:
        return "|".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))

    @classmethod
    def from_str(cls, s: str) -> TuneKey:
        raw = dict(item.split("=", 1) for item in s.split("|"))
        kw = {}
        for f in fields(cls):
            kw[f.name] = int(raw[f.name]) if f.type in ("int", int) else raw[f.name]
        return cls(**kw)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def triton_version() -> str:
    import triton

    return triton.__version__


@functools.lru_cache(maxsize=16)
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_name(device: torch.device | str) -> str:
    """The GPU model of `device` ("NVIDIA H200", ...), or "cpu" for the Triton interpreter."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())


def make_key(
    family: str,
    device: torch.device | str,
    state_dtype: torch.dtype,
    act_dtype: torch.dtype,
    H: int,
    HV: int,
    K: int,
    V: int,
    GK: int,
    width: int,
    capacity: int = 0,
    projection: str = "",
) -> TuneKey:
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; expected one of {FAMILIES}")
    return TuneKey(
        family,
        device_name(device),
        triton_version(),
        dtype_name(state_dtype),
        dtype_name(act_dtype),
        H,
        HV,
        K,
        V,
        GK,
        width,
        capacity,
        projection,
    )


def default_config(key: TuneKey) -> KernelConfig:
    """Untuned fallback. On the CPU interpreter BV is half of V so tests always cover two or more V tiles."""
    if key.gpu == "cpu":
        return KernelConfig(block_v=max(4, _pow2(key.head_v_dim) // 2), num_warps=1, num_stages=1)
    if key.family == "serial":
        return KernelConfig(block_v=16, num_warps=2, num_stages=2)
    if key.family == "replay":
        return KernelConfig(block_v=32, num_warps=4, num_stages=2)
    return KernelConfig(block_v=32, num_warps=4, num_stages=2)


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


class ConfigTable:
    """Tuned configurations by `TuneKey` string; JSON round-trip; `lookup` falls back to the default."""

    def __init__(self) -> None:
        self.entries: dict[str, KernelConfig] = {}

    def put(self, key: TuneKey, config: KernelConfig) -> None:
        self.entries[key.to_str()] = config

    def get(self, key: TuneKey) -> KernelConfig | None:
        return self.entries.get(key.to_str())

    def lookup(self, key: TuneKey) -> KernelConfig:
        return self.entries.get(key.to_str()) or default_config(key)

    def update(self, other: ConfigTable) -> None:
        self.entries.update(other.entries)

    def to_json(self, extra: dict[str, dict] | None = None) -> dict:
        out = {}
        for k, cfg in sorted(self.entries.items()):
            out[k] = {**asdict(cfg), **((extra or {}).get(k, {}))}
        return {"version": TABLE_VERSION, "entries": out}

    @classmethod
    def from_json(cls, data: dict) -> ConfigTable:
        if data.get("version") != TABLE_VERSION:
            raise ValueError(f"tuned table version {data.get('version')!r} != {TABLE_VERSION}")
        table = cls()
        for k, d in data["entries"].items():
            TuneKey.from_str(k)  # validates the key format
            table.entries[k] = KernelConfig.from_dict(d)
        return table

    def save(self, path: str | Path, extra: dict[str, dict] | None = None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(extra), indent=1, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ConfigTable:
        return cls.from_json(json.loads(Path(path).read_text()))


# The process-wide table every kernel launch consults; empty until `load_tables` runs at start-up.
TABLE = ConfigTable()


def shipped_table_paths() -> list[Path]:
    pkg = Path(__file__).resolve().parent
    return sorted([*(pkg / "gdn" / "tuned").glob("*.json"), *(pkg / "kda" / "tuned").glob("*.json")])


def load_tables(paths: list[str | Path] | None = None) -> ConfigTable:
    """Merge the shipped tables (and `paths`, later ones winning) into `TABLE`. Call once at start-up."""
    for path in [*shipped_table_paths(), *(paths or [])]:
        TABLE.update(ConfigTable.load(path))
    return TABLE


def lookup(key: TuneKey) -> KernelConfig:
    return TABLE.lookup(key)


@contextlib.contextmanager
def using(configs: dict[TuneKey, KernelConfig]) -> Iterator[None]:
    """Temporarily pin configurations (tests, the tuner's own trials); restores the table afterwards."""
    saved = dict(TABLE.entries)
    try:
        for key, cfg in configs.items():
            TABLE.put(key, cfg)
        yield
    finally:
        TABLE.entries = saved


__all__ = [
    "FAMILIES",
    "TABLE",
    "ConfigTable",
    "KernelConfig",
    "TuneKey",
    "default_config",
    "device_name",
    "load_tables",
    "lookup",
    "make_key",
    "using",
]
