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
