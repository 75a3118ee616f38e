"""Launch configurations of the linear-attention kernels: keys, tuned tables and their lookup.

A configuration (`KernelConfig`: BV, num_warps, num_stages) is chosen per kernel family and shape. Lookup is a
dict access keyed by `TuneKey` (GPU name, Triton version, state and activation dtypes, heads, head dims, gate
width, verify width, replay replay_capacity, projection mode); a missing entry borrows the nearest entry that differs only in
width, replay_capacity or head counts (`ConfigTable.lookup`), else falls back to `default_config`.

Tables are JSON files (`gdn/tuned/*.json`, `kda/tuned/*.json` ship with the package). Each algorithm owns its
table (`Algorithm.table`, read on first use; start-up tuning adds to it before any CUDA-graph capture, so every
captured graph uses one fixed layout); a launch looks its configuration up through its algorithm unless the caller
passes one (`config=`). Native verify is the family "serial"; compact verify and compact commit run the same
kernel body under the family "compact", which has its own entries because compact is bound by its per-token work
where native is bound by its W state writes. Compact equals native bitwise under the same tiling, and a compact key
with no entry at its width borrows the serial one, so an untuned compact launch runs native's tiling.

The search that fills the tables (it launches the kernels) is `tuning.py`; this module is data only, so the
algorithm descriptors and the kernel launchers can read their tables without importing the kernels.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch

FAMILIES = ("serial", "compact", "replay", "replay_fold")
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
    """What a tuned configuration depends on. `width` is the padded verify width Wmax; `replay_capacity` is 0 outside
    replay; `projection` is "" outside replay verify; `lower_bound` is KDA's bounded-gate bound (it changes the
    gate's instructions), "" for the softplus gate and for the fold (which reads activated gates). A field at its
    default is left out of the string form, so keys written before a field existed still parse and match."""

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
    replay_capacity: int = 0
    projection: str = ""
    lower_bound: str = ""

    def to_str(self) -> str:
        return "|".join(
            f"{f.name}={getattr(self, f.name)}"
            for f in fields(self)
            if f.name not in _OMITTED_AT_DEFAULT or getattr(self, f.name) != f.default
        )

    @classmethod
    def from_str(cls, s: str) -> TuneKey:
        raw = dict(item.split("=", 1) for item in s.split("|"))
        kw = {}
        for f in fields(cls):
            if f.name in _OMITTED_AT_DEFAULT and f.name not in raw:
                continue
            kw[f.name] = int(raw[f.name]) if f.type in ("int", int) else raw[f.name]
        return cls(**kw)


# fields added after tables were shipped: written only when set
_OMITTED_AT_DEFAULT = ("lower_bound",)


def bound_name(lower_bound: float | None) -> str:
    """The `TuneKey.lower_bound` of a gate: "" for the softplus gate, else the bound as `repr(float)`."""
    return "" if lower_bound is None else repr(float(lower_bound))


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
    replay_capacity: int = 0,
    projection: str = "",
    lower_bound: float | None = None,
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
        replay_capacity,
        projection,
        bound_name(lower_bound),
    )


def default_config(key: TuneKey) -> KernelConfig:
    """Untuned fallback. On the CPU interpreter BV is half of V so tests always cover two or more V tiles."""
    if key.gpu == "cpu":
        return KernelConfig(block_v=max(4, _pow2(key.head_v_dim) // 2), num_warps=1, num_stages=1)
    if key.family in ("serial", "compact"):
        return KernelConfig(block_v=16, num_warps=2, num_stages=2)
    if key.family == "replay" and key.width > 1 and key.projection == "precompute":
        # the tf32x3 tensor-core products hold hi/lo copies of both operands: 255 registers at [128, 64] x 8 warps
        # with no spills for GDN and KDA on sm_90 (`test/benchmark/registers_linear_att.py`); 32 x 4 spills for KDA
        return KernelConfig(block_v=64, num_warps=8, num_stages=1)
    return KernelConfig(block_v=32, num_warps=4, num_stages=2)


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


class ConfigTable:
    """Tuned configurations by `TuneKey` string; JSON round-trip; `lookup` falls back to the default."""

    def __init__(self) -> None:
        self.entries: dict[str, KernelConfig] = {}
        # lookups resolved so far (launch wrappers call `lookup` on every launch); cleared on every change
        self._resolved: dict[TuneKey, KernelConfig] = {}

    def put(self, key: TuneKey, config: KernelConfig) -> None:
        self.entries[key.to_str()] = config
        self._resolved.clear()

    def get(self, key: TuneKey) -> KernelConfig | None:
        return self.entries.get(key.to_str())

    def lookup(self, key: TuneKey) -> KernelConfig:
        """Exact entry, else the nearest entry that differs only in verify width, replay replay_capacity, head counts or
        gate lower bound (nearest width first, then replay_capacity, then the same heads before other heads, then the same
        bound; for replay only among W = 1 or only among W > 1 entries; for compact only at its own width, else the
        serial entry for the key), else default.

        Head counts only set the grid: a program's work (its `[K, BV]` tile, the window, the records) depends on
        the head dims, gate width and dtypes, which must match. The H200 sweep ranks the window kernel's tiles the
        same at 32 and 64 value heads (`test/benchmark/results/h200_window_kernel.md` §2), so a shape with other
        head counts (Qwen3.5 against Qwen3-Next) starts from the tuned tile rather than the untuned default."""
        hit = self._resolved.get(key) or self.entries.get(key.to_str())
        if hit is not None:
            return hit
        best, best_dist = None, None
        for k, cfg in self.entries.items():
            other = TuneKey.from_str(k)
            free = dict(
                width=key.width,
                replay_capacity=key.replay_capacity,
                num_k_heads=key.num_k_heads,
                num_v_heads=key.num_v_heads,
                lower_bound=key.lower_bound,
            )
            if replace(other, **free) != key:
                continue
            if key.family == "replay" and (other.width == 1) != (key.width == 1):
                continue  # plain decode and window verify are different replay kernels: never borrow a tile
            if key.family == "compact" and other.width != key.width:
                continue  # another width's compact tile is no better a guess than native's tile at this width
            heads = (other.num_k_heads, other.num_v_heads) != (key.num_k_heads, key.num_v_heads)
            dist = (
                abs(other.width - key.width),
                abs(other.replay_capacity - key.replay_capacity),
                heads,
                abs(other.num_v_heads - key.num_v_heads),
                abs(other.num_k_heads - key.num_k_heads),
                other.lower_bound != key.lower_bound,
            )
            if best_dist is None or dist < best_dist:
                best, best_dist = cfg, dist
        if best is None and key.family == "compact":
            best = self.lookup(replace(key, family="serial"))
        self._resolved[key] = best or default_config(key)
        return self._resolved[key]

    def update(self, other: ConfigTable) -> None:
        self.entries.update(other.entries)
        self._resolved.clear()

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


def load_table(paths) -> ConfigTable:
    """The entries of the table files `paths` merged, later files winning."""
    table = ConfigTable()
    for path in paths:
        table.update(ConfigTable.load(path))
    return table


def candidates(family: str) -> list[KernelConfig]:
    """The search space. BV >= 16 for the replay families (tensor-core dots); the serial family also tries the
    narrow tiles that give small batches more programs. On the H200 the W = 1 kernels ran fastest at BV = 64 with
    2 warps (a [128, 64] fp32 tile held by 64 threads), so wide tiles on few warps stay in the grid."""
    serial = family in ("serial", "compact")
    block_vs = (8, 16, 32, 64) if serial else (16, 32, 64)
    warps = (1, 2, 4) if serial else (2, 4, 8)
    # the fold has no loop to pipeline: one stage
    stages = (1,) if family == "replay_fold" else (1, 2)
    return [KernelConfig(bv, nw, ns) for bv in block_vs for nw in warps for ns in stages]


__all__ = [
    "FAMILIES",
    "ConfigTable",
    "KernelConfig",
    "TuneKey",
    "candidates",
    "default_config",
    "device_name",
    "load_table",
    "make_key",
]
