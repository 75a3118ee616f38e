"""attend(): rows of width W over gathered KV attend causally to their prefix and to each other."""

from __future__ import annotations

import math

import pytest
import torch

from lightllm.cache.kv_cache import KVCache
from lightllm.models.context import build_context, padded_token_index
from lightllm.models.layers.paged_attention import attend
from unit_tests.helpers.asserts import assert_rel_close


def naive(q, k, v, scale):
    """One query row `q [H, D]` against `k, v [L, Hk, D]` (all visible)."""
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    w = torch.softmax(torch.einsum("hd,lhd->hl", q, k) * scale, dim=-1)
    return torch.einsum("hl,lhd->hd", w, v)


@pytest.mark.parametrize("num_prefill_rows", [0, 1, 2], ids=lambda n: f"prefill{n}")
def test_mixed_rows_attend_causally_over_scattered_slots(num_prefill_rows):
    torch.manual_seed(num_prefill_rows)
    heads, kv_heads, d = 4, 2, 8
    kv = KVCache(1, ((kv_heads, d), (kv_heads, d)), 64, 4, 32, torch.float32, "cpu")
    cached, q_lens = [5, 0, 3, 7], [3, 6, 2, 4]
    q_lens[:num_prefill_rows] = [6, 4][:num_prefill_rows]
    rows = [kv.alloc_row() for _ in q_lens]
    # interleave allocations so each row's slots are scattered
    for step in range(max(c + q for c, q in zip(cached, q_lens))):
        for r, (c, q) in zip(rows, zip(cached, q_lens)):
            if step < c + q:
                kv.extend(r, 1)
    ctx = build_context(q_lens, cached, num_prefill_rows, rows, kv)
    total = [c + q for c, q in zip(cached, q_lens)]
    keys = [torch.randn(n, kv_heads, d) for n in total]
    values = [torch.randn(n, kv_heads, d) for n in total]
    for r, k, v in zip(rows, keys, values):
        kv.write(0, kv.slots(r), k, v)
    layout = torch.from_numpy(padded_token_index(q_lens, num_prefill_rows, max(q_lens[num_prefill_rows:], default=0)))
    q = torch.randn(ctx.num_tokens, heads, d)
    out = attend(q, ctx.groups, lambda table: tuple(kv.gather(0, table)), 1 / math.sqrt(d))[layout]
    q = q[layout]
    start = 0
    expected = torch.empty_like(out)
    for i, (c, n) in enumerate(zip(cached, q_lens)):
        for j in range(n):
            visible = c + j + 1
            expected[start + j] = naive(q[start + j], keys[i][:visible], values[i][:visible], 1 / math.sqrt(d))
        start += n
    assert_rel_close("attention output", out, expected, 1e-6)


def _windows_over_a_worst_case_tail(backend: str, nan_at: int):
    """Verify windows of width 3 whose KV rows hold 3 more slots past their context (allocated for the worst case
    of a step still in flight, never written: NaN), attended with `backend`; the NaN also at context position
    `cached + nan_at` of the second row when `nan_at` < 3. Returns the output and attention over the keys each
    query sees (from finite copies of the written keys)."""
    torch.manual_seed(5)
    heads, kv_heads, d, w = 4, 2, 8, 3
    kv = KVCache(1, ((kv_heads, d), (kv_heads, d)), 64, 3, 32, torch.float32, "cpu")
    cached = [5, 2, 7]
    rows = [kv.alloc_row() for _ in cached]
    for r, c in zip(rows, cached):
        kv.extend(r, c + 2 * w)
    keys = [torch.randn(c + w, kv_heads, d) for c in cached]
    values = [torch.randn(c + w, kv_heads, d) for c in cached]
    for r, c, k, v in zip(rows, cached, keys, values):
        slots = kv.slots(r)
        kv.write(0, slots[: c + w], k, v)
        nan = torch.full((w, kv_heads, d), float("nan"))
        kv.write(0, slots[c + w :], nan, nan)
    if nan_at < w:
        slot = kv.slots(rows[1])[cached[1] + nan_at : cached[1] + nan_at + 1]
        kv.write(0, slot, torch.full((1, kv_heads, d), float("nan")), torch.full((1, kv_heads, d), float("nan")))
    ctx = build_context([w] * 3, cached, 0, rows, kv)
    q = torch.randn(ctx.num_tokens, heads, d)
    pool = (kv.buffers[0][0], kv.buffers[1][0]) if backend == "triton" else None
    out = attend(q, ctx.groups, lambda table: tuple(kv.gather(0, table)), 1 / math.sqrt(d), pool, backend)
    expected = torch.empty_like(out)
    for i, c in enumerate(cached):
        for j in range(w):
            t = i * w + j
            expected[t] = naive(q[t], keys[i][: c + j + 1], values[i][: c + j + 1], 1 / math.sqrt(d))
    return out, expected


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_kv_slots_past_a_rows_context_never_reach_its_output(backend):
    """A row's KV slots past its context, allocated for a verify step launched before its predecessor's counts
    were read, keep whatever their last owner left there, NaN included: no output reads them."""
    out, expected = _windows_over_a_worst_case_tail(backend, nan_at=3)
    assert torch.isfinite(out).all()
    assert_rel_close("attention output", out, expected, 1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_twin_a_nan_key_inside_the_context_reaches_the_output(backend):
    """Twin: the NaN in the last key of the second row's context reaches that row's last query (queries 3 .. 5),
    and no other row."""
    out, _ = _windows_over_a_worst_case_tail(backend, nan_at=2)
    assert not torch.isfinite(out[5]).all()
    assert torch.isfinite(out[:3]).all() and torch.isfinite(out[6:]).all()
