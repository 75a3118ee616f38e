"""Kimi Delta Attention as an `Algorithm`: one decay per key channel (gate width K), optional bounded gate."""

from __future__ import annotations

from pathlib import Path

from lightllm.linear_att.algorithm import Algorithm


def fla_chunk():
    from fla.ops.kda import chunk_kda

    return chunk_kda


KDA = Algorithm(
    name="kda",
    per_channel_gate=True,
    allows_lower_bound=True,
    load_fla_chunk=fla_chunk,
    package_dir=Path(__file__).resolve().parent,
    # Kimi-Linear (32 key / 32 value heads), head dims 128
    served_heads=((32, 32),),
)
