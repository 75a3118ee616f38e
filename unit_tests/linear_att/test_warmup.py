"""`warmup.warmup_prefill`: a no-op on CPU; the token counts it covers; one scratch prefill through the serving ops."""

from __future__ import annotations

import time

import pytest
import torch

from lightllm.linear_att import ops, warmup
from unit_tests.linear_att import scenarios as sc


def _forbid(*args, **kwargs):
    raise AssertionError("warm-up ran a prefill op on a CPU state")


def test_warmup_prefill_is_a_cpu_noop(monkeypatch):
    spec = sc.make_spec("gdn", num_k_heads=1, ratio=2, head_k_dim=8, head_v_dim=8)
    state = sc.make_state(spec, "native", max_requests=2, max_width=2)
    before = {name: t.clone() for name, t in sc.state_tensors(state).items()}
    monkeypatch.setattr(ops, "chunk_delta_rule", _forbid)
    monkeypatch.setattr(ops, "causal_conv_prefill", _forbid)
    start = time.perf_counter()
    assert warmup.warmup_prefill(state, spec, max_num_tokens=8192, progress=True) == 0
    assert time.perf_counter() - start < 0.5
    for name, t in sc.state_tensors(state).items():
        assert torch.equal(t, before[name]), f"warm-up changed state tensor {name}"


@pytest.mark.parametrize(
    "max_num_tokens,num_k_heads,expected",
    [
        (8192, 16, [1, 63, 64, 4096, 8192]),
        (10, 4, [1, 10]),
        (64, 1, [1, 63, 64]),
        (70000, 1, [1, 63, 64, 65536, 70000]),
    ],
    ids=["qwen3next_tp1", "tiny", "one_chunk", "two_buckets"],
)
def test_warmup_token_counts(max_num_tokens, num_k_heads, expected):
    assert warmup.warmup_token_counts(max_num_tokens, num_k_heads) == expected


def test_warmup_token_counts_rejects_zero():
    with pytest.raises(ValueError, match="max_num_tokens"):
        warmup.warmup_token_counts(0, 4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("algo", ["gdn", "kda"])
def test_run_prefill_once_uses_serving_shapes(algo, backend, monkeypatch):
    """The scratch call reaches the chunk op with the serving shapes and dtypes (so fla tunes the serving keys)."""
    spec = sc.make_spec(algo, num_k_heads=1, ratio=2, head_k_dim=8, head_v_dim=8)
    seen = {}
    real = ops.chunk_delta_rule

    def record(q, k, v, g, beta, initial_state, cu_seqlens, **kwargs):
        seen.update(q=q, v=v, g=g, beta=beta, init=initial_state, cu=cu_seqlens)
        return real(q, k, v, g, beta, initial_state, cu_seqlens, **kwargs)

    monkeypatch.setattr(ops, "chunk_delta_rule", record)
    warmup.run_prefill_once(spec, [1, 2, 7], torch.float16, "cpu", backend, conv_cols=5)
    hv, gk = spec.num_v_heads, spec.gate_dim
    assert seen["q"].shape == (10, spec.num_k_heads, spec.head_k_dim) and seen["q"].dtype == torch.float16
    assert seen["v"].shape == (10, hv, spec.head_v_dim) and seen["v"].dtype == torch.float16
    assert seen["g"].shape == (10, hv, gk) and seen["g"].dtype == torch.float32
    assert seen["beta"].shape == (10, hv) and seen["beta"].dtype == torch.float32
    assert seen["init"].shape == (3, hv, spec.head_k_dim, spec.head_v_dim) and seen["init"].dtype == torch.float32
    assert seen["cu"].tolist() == [0, 1, 3, 10]


def test_run_prefill_once_one_sequence_calls_the_chunk_without_offsets(monkeypatch):
    """The padded prefill's variant: one row, no `cu_seqlens` (what `PrefillGraphs` launches); the varlen twin
    passes them."""
    spec = sc.make_spec("gdn", num_k_heads=1, ratio=2, head_k_dim=8, head_v_dim=8)
    seen = []
    real = ops.chunk_delta_rule

    def record(q, k, v, g, beta, initial_state, cu_seqlens, **kwargs):
        seen.append(cu_seqlens)
        return real(q, k, v, g, beta, initial_state, cu_seqlens, **kwargs)

    monkeypatch.setattr(ops, "chunk_delta_rule", record)
    warmup.run_prefill_once(spec, [16], torch.float32, "cpu", "torch", conv_cols=5, one_sequence=True)
    warmup.run_prefill_once(spec, [16], torch.float32, "cpu", "torch", conv_cols=5)
    assert seen[0] is None and seen[1].tolist() == [0, 16]
