"""The dense FP8 linear-layer shapes of the served checkpoints at TP1 (N outputs, K inputs): what the tuning script
and the GEMM benchmarks run. Qwen3-Next-80B-A3B and Qwen3.5-35B-A3B share hidden 2048, 16 x 256 gated attention
heads, 2 KV heads, GDN 16 key / 32 value heads of 128 and a 512-wide shared expert; Qwen3-Next fuses its GDN input
projections into one (qkvz + ba), Qwen3.5 keeps q|k|v and z apart."""

from __future__ import annotations

# the layers both checkpoints share, after their GDN input projections
_SHARED_GEMMS = {
    "gdn out_proj": (2048, 4096),
    "attn q_proj (q+gate)": (8192, 2048),
    "attn k_proj / v_proj": (512, 2048),
    "attn o_proj": (2048, 4096),
    "shared expert gate_up": (1024, 2048),
    "shared expert down": (2048, 512),
}
SERVED_GEMMS = {
    "qwen3-next-80b-a3b": {"gdn in_proj (qkvz+ba)": (12352, 2048), **_SHARED_GEMMS},
    "qwen3.5-35b-a3b": {"gdn in_proj_qkv": (8192, 2048), "gdn in_proj_z": (4096, 2048), **_SHARED_GEMMS},
}


def unique_gemms(models: list[str]) -> dict[tuple[int, int], str]:
    """(N, K) -> the first `model: layer` name with that shape, over `models` in order (each shape tuned once)."""
    out: dict[tuple[int, int], str] = {}
    for model in models:
        for layer, nk in SERVED_GEMMS[model].items():
            out.setdefault(nk, f"{model}: {layer}")
    return out
