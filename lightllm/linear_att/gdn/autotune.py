"""GDN's launch configurations: the shapes its shipped table is tuned at, and that table (`tuned/*.json`).

The search is shared (`lightllm.linear_att.tuning`); `test/benchmark/bench_linear_att.py --tune` and
`sweep_linear_att.py` wrote the shipped table on the GPU its file is named after.
"""

from __future__ import annotations

from lightllm.linear_att import autotune, tuning
from lightllm.linear_att.gdn.algorithm import GDN

# the served heads per tensor-parallel rank 1: Qwen3-Next (16 key / 32 value heads) and Qwen3.5 (16 / 64), head dims 128
SERVED_HEADS = ((16, 32), (16, 64))
HEAD_DIM = 128


def tune_cases(**kwargs) -> list[tuning.TuneCase]:
    """The cases of the shipped table (keywords: `tuning.served_cases`)."""
    return tuning.served_cases(GDN, SERVED_HEADS, HEAD_DIM, **kwargs)


def shipped_table() -> autotune.ConfigTable:
    """The entries of `tuned/*.json` as shipped (what launches use is `GDN.table`: these plus start-up tuning)."""
    return autotune.load_table(GDN.tuned_tables())
