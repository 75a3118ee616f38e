"""The dense FP8 linear-layer shapes of the served checkpoints at TP1 (N outputs, K inputs): what the tuning script
and the GEMM benchmarks run. Qwen3-Next-80B-A3B and Qwen3.5-35B-A3B share hidden 2048, 16 x 256 gated attention
heads, 2 KV heads, GDN 16 key / 32 value heads of 128 and a 512-wide shared expert. The engine runs attention's
q (with its gate), k and v as one projection; GDN's b / a projections stay unquantized (as in Qwen's FP8 releases),
so the FP8 GDN input GEMM is q|k|v|z in both, whether the checkpoint stores it as one tensor (Qwen3-Next's
in_proj_qkvz) or two (Qwen3.5's in_proj_qkv and in_proj_z, stacked at load)."""

from __future__ import annotations

# the layers both checkpoints share
_SHARED_GEMMS = {
    "gdn in_proj (q|k|v|z)": (12288, 2048),
    "gdn out_proj": (2048, 4096),
    "attn qkv_proj (q+gate | k | v)": (9216, 2048),
    "attn o_proj": (2048, 4096),
    "shared expert gate_up": (1024, 2048),
    "shared expert down": (2048, 512),
}
SERVED_GEMMS = {
    "qwen3-next-80b-a3b": _SHARED_GEMMS,
    "qwen3.5-35b-a3b": _SHARED_GEMMS,
}


def unique_gemms(models: list[str]) -> dict[tuple[int, int], str]:
    """(N, K) -> the first `model: layer` name with that shape, over `models` in order (each shape tuned once)."""
    out: dict[tuple[int, int], str] = {}
    for model in models:
        for layer, nk in SERVED_GEMMS[model].items():
            out.setdefault(nk, f"{model}: {layer}")
    return out
