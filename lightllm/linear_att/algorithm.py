"""The algorithm descriptor: everything that differs between GDN and KDA, in one value per algorithm.

GDN is KDA with one gate channel, so the state classes, the kernel bodies and the torch twins are shared; what an
algorithm adds is its gate kind (one decay per value head, or one per key channel), whether the bounded KDA gate
is allowed, its fla-core prefill entry point, the heads its shipped launch table is tuned at and that table
(`table`: the shipped `tuned/*.json`, plus what start-up tuning adds). `gdn/algorithm.py` and `kda/algorithm.py`
hold the two instances; `registry.py` looks them up by name, `states.py` binds each to the three modes. A kernel
launch looks its configuration up through its algorithm; a caller that wants another one passes it (`config=`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lightllm.linear_att.autotune import ConfigTable, KernelConfig, TuneKey, load_table


@dataclass(frozen=True)
class Algorithm:
    # the name models and `LinearAttSpec.algo` use
    name: str
    # True: one decay per key channel (gate width K); False: one per value head (gate width 1)
    per_channel_gate: bool
    # the bounded gate `lower_bound * sigmoid(...)` is a KDA option
    allows_lower_bound: bool
    # returns the fla-core chunk kernel that runs this algorithm's prefill on CUDA (imported on first use: fla is
    # a CUDA-only dependency)
    load_fla_chunk: Callable
    # the algorithm's package folder (holds `tuned/*.json`)
    package_dir: Path
    # (key heads, value heads) per tensor-parallel rank of the served models its shipped table is tuned at
    served_heads: tuple[tuple[int, int], ...] = ()

    def gate_dim(self, head_k_dim: int) -> int:
        """Gate channels per value head: K for a per-channel gate, else 1."""
        return head_k_dim if self.per_channel_gate else 1

    def fla_chunk_fn(self):
        return self.load_fla_chunk()

    def fla_gate(self, g):
        """The activated gate `[T, HV, GK]` in the layout the fla-core chunk kernel takes."""
        return g if self.per_channel_gate else g[..., 0]

    def tuned_tables(self) -> list[Path]:
        return sorted((self.package_dir / "tuned").glob("*.json"))

    @functools.cached_property
    def kernels(self):
        """This algorithm's operator entry points (`kernels.bound.bind_kernels`), which its state classes call."""
        from lightllm.linear_att.kernels.bound import bind_kernels

        return bind_kernels(self)

    @functools.cached_property
    def table(self) -> ConfigTable:
        """This algorithm's launch configurations: its shipped tables, read on first use (so every process, server,
        test or benchmark, launches with the tuned tiles without loading anything), later files winning."""
        return load_table(self.tuned_tables())

    def add_tables(self, paths) -> None:
        """Merge more tuned table files into `table` (later files winning over earlier and shipped entries)."""
        self.table.update(load_table(paths))

    def lookup(self, key: TuneKey) -> KernelConfig:
        """The configuration a launch of this algorithm uses for `key` (`ConfigTable.lookup`: exact, nearest, or
        the default)."""
        return self.table.lookup(key)
