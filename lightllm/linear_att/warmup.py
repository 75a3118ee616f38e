"""Prefill warm-up: run the prefill kernels once per serving shape at start-up, so no request pays for autotuning.

fla-core's chunk kernels (`chunk_gated_delta_rule`, `chunk_kda`) autotune on their first call per tuning key,
which takes tens of seconds to minutes on an H200. Their keys hold the head counts and dims, the dtypes of every
tensor argument and, for the l2norm inside, a token-count bucket (`ceil(T * H / 65536)` in fla-core 0.6.0);
Triton also compiles a variant per integer specialisation (T == 1, T % 16 == 0). `warmup_prefill` covers those
with disposable scratch tensors of the serving shapes and dtype; it never touches the serving state.

Across restarts (fla-core 0.6.0): fla passes `cache_results=FLA_CACHE_RESULTS` (default "1") to
`triton.autotune`, so Triton keeps each autotune choice in its on-disk cache (`TRITON_CACHE_DIR`, default
`~/.triton/cache`) next to the compiled kernels; a later start with the same cache directory, GPU, Triton and fla
versions skips the benchmark. Keep that directory on a persistent volume (containers!). `FLA_CACHE_MODE`
(default "disabled") with `FLA_CONFIG_DIR` makes fla read pre-tuned JSON tables instead; fla-core 0.6.0 ships
none for our kernels. fla and Triton read these variables when they are imported, so they belong in the
environment of the server process: this module sets none of them.
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from lightllm.linear_att import ops

# fla-core 0.6.0 buckets its l2norm autotuning by ceil(rows / 65536), rows = tokens * heads
_L2NORM_BUCKET_ROWS = 65536
# small counts: single-token chunks, one partial and one full 64-token chunk
_SMALL_TOKEN_COUNTS = (1, 63, 64)


def warmup_token_counts(max_num_tokens: int, num_k_heads: int) -> list[int]:
    """Token counts that reach every tuning key a prefill of up to `max_num_tokens` tokens can hit."""
    if max_num_tokens < 1:
        raise ValueError(f"max_num_tokens must be >= 1, got {max_num_tokens}")
    counts = {min(t, max_num_tokens) for t in _SMALL_TOKEN_COUNTS}
    counts.add(max_num_tokens)
    per_bucket = max(1, _L2NORM_BUCKET_ROWS // num_k_heads)
    # the largest token count of every l2norm bucket below max_num_tokens
    counts.update(range(per_bucket, max_num_tokens, per_bucket))
    return sorted(counts)


def prefill_warmup_calls(
    max_num_tokens: int, num_k_heads: int, one_sequence_counts=(), token_counts: list[int] | None = None
) -> list[tuple[list[int], bool]]:
    """The warm-up's prefills as (row lengths, one sequence): each count of `warmup_token_counts` (or
    `token_counts`) as one row, one call with three rows (varlen), each of `one_sequence_counts` as one sequence."""
    counts = warmup_token_counts(max_num_tokens, num_k_heads) if token_counts is None else sorted(token_counts)
    calls = [([t], False) for t in counts] + [([1, 2, max(1, min(max_num_tokens, 192) - 3)], False)]
    return calls + [([t], True) for t in one_sequence_counts]


def warmup_prefill(
    state,
    spec,
    *,
    max_num_tokens: int = 8192,
    token_counts: list[int] | None = None,
    one_sequence_counts: list[int] = (),
    progress: bool = True,
) -> int:
    """Run the prefill kernels (conv + fla chunk) on scratch tensors at the serving shapes; returns the call count.

    state: the serving `LinearAttState` (only its device, activation dtype and backend are read; its tensors are
    never written). spec: its `LinearAttSpec` (per tensor-parallel rank). max_num_tokens: the most prefill
    tokens of one engine step (`max_num_batched_tokens`: a step's prefill rows run as one varlen call). token_counts: override the counts from
    `warmup_token_counts`. Each count runs as one row, plus one call with three rows (varlen).
    one_sequence_counts: token counts that also run as one sequence without offsets (the padded prefills that
    replay as CUDA graphs: fla compiles and tunes that variant apart). Blocks until the device is done. On a CPU state this returns 0 at once: the torch path has nothing to tune.
    """
    if state.device.type != "cuda":
        return 0
    calls = prefill_warmup_calls(max_num_tokens, spec.num_k_heads, one_sequence_counts, token_counts)
    with torch.no_grad():
        for lengths, one_sequence in tqdm(calls, desc="prefill warm-up", unit="shape", disable=not progress):
            run_prefill_once(
                spec, lengths, state.conv.dtype, state.device, state.backend, state.conv.shape[-1], one_sequence
            )
    torch.cuda.synchronize(state.device)
    return len(calls)


def run_prefill_once(
    spec,
    lengths: list[int],
    act_dtype: torch.dtype,
    device,
    backend: str | None = None,
    conv_cols: int | None = None,
    one_sequence: bool = False,
) -> None:
    """One prefill of rows of `lengths` tokens through the serving ops, on fresh scratch tensors.

    The same calls `StateCommon.prefill` makes (conv with a slot history, gate activation, chunk with an initial
    state), so the tuning keys (shapes, dtypes, optional arguments present) are the serving ones. `conv_cols`: the
    column count of the serving conv buffer (its stride selects the compiled conv variant); the conv has no bias,
    like the GDN and KDA layers of the supported models. `one_sequence`: the chunk runs without `cu_seqlens`, as
    for a padded prefill (one row).
    """
    num_rows, total = len(lengths), sum(lengths)
    hv, gk, kc = spec.num_v_heads, spec.gate_dim, spec.conv_kernel_size
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    slots = torch.arange(num_rows, dtype=torch.int32, device=device)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, device=device).to(dtype)

    conv = torch.zeros(num_rows, spec.conv_dim, conv_cols or kc - 1, dtype=act_dtype, device=device)
    y = ops.causal_conv_prefill(
        randn(total, spec.conv_dim, dtype=act_dtype),
        conv,
        torch.zeros(num_rows, dtype=torch.int32, device=device),
        slots,
        cu,
        randn(spec.conv_dim, kc, dtype=act_dtype),
        None,
        torch.ones(num_rows, dtype=torch.bool, device=device),
        backend=backend,
    )
    key_dim = spec.num_k_heads * spec.head_k_dim
    q, k, v = torch.split(y, [key_dim, key_dim, hv * spec.head_v_dim], dim=-1)
    g, beta = ops.activate_gates(
        randn(total, hv, gk), randn(total, hv), randn(hv), randn(hv, gk), spec.gate_lower_bound
    )
    init = torch.zeros(num_rows, hv, spec.head_k_dim, spec.head_v_dim, device=device)
    ops.chunk_delta_rule(
        q.reshape(total, spec.num_k_heads, spec.head_k_dim),
        k.reshape(total, spec.num_k_heads, spec.head_k_dim),
        v.reshape(total, hv, spec.head_v_dim),
        g,
        beta,
        init,
        None if one_sequence else cu,
        algorithm=spec.algorithm,
    )
