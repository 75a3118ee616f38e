"""Gated DeltaNet as an `Algorithm`: one decay per value head (gate width 1), softplus gate only."""

from __future__ import annotations

from pathlib import Path

from lightllm.linear_att.algorithm import Algorithm


def fla_chunk():
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule


GDN = Algorithm(
    name="gdn",
    per_channel_gate=False,
    allows_lower_bound=False,
    load_fla_chunk=fla_chunk,
    package_dir=Path(__file__).resolve().parent,
    # Qwen3-Next (16 key / 32 value heads) and Qwen3.5 (16 / 64), head dims 128
    served_heads=((16, 32), (16, 64)),
)
