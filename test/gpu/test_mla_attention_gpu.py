"""MLA in latent space on a CUDA device at Kimi-Linear's TP1 shapes (32 heads, kv_lora_rank 512, rope 64): the
compiled kernel vs fp64 softmax (split and unsplit), the latent layer vs the expanded layer, and the decode step
as a CUDA graph over fixed buffers: no host sync, replays for other context lengths equal to eager steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightllm.cache.kv_cache import KVCache
from lightllm.kernels.mla_attention import launch_splits, mla_attention
from lightllm.models.config import AttentionConfig
from lightllm.models.context import AttentionGroup, StepContext, build_context
from lightllm.models.layers.mla import LatentAttention
from unit_tests.helpers.asserts import assert_rel_close
from unit_tests.kernels.test_mla_attention import expected_rows, scattered

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

KIMI = AttentionConfig(
    kind="mla",
    num_heads=32,
    num_kv_heads=32,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
)
HIDDEN = 2304
MAX_REL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
ROWS = {"decode-verify": ([700, 0, 1500, 33], [1, 4, 2, 3]), "long-split": ([8000, 20, 900], [1, 4, 1])}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", list(ROWS), ids=list(ROWS))
def test_kernel_on_gpu_matches_reference(rows, dtype):
    cached, q_lens = ROWS[rows]
    c, r, heads = KIMI.kv_lora_rank, KIMI.qk_rope_head_dim, KIMI.num_heads
    latent, table, table_rows, slots, q = scattered(cached, q_lens, heads, c, r, dtype, seed=3)
    longest = max(a + b for a, b in zip(cached, q_lens))
    if rows == "long-split":
        assert launch_splits(heads, len(q_lens), max(q_lens), longest, torch.device("cuda")) > 1
    dev = "cuda"
    out = torch.full((q.shape[0], heads, c), float("nan"), dtype=dtype, device=dev)
    starts = torch.tensor([0] + q_lens[:-1]).cumsum(0).to(torch.int32)
    args = [t.to(dev) for t in (q, latent, table, starts, torch.tensor(q_lens).int(), torch.tensor(cached).int())]
    mla_attention(
        *args, KIMI.qk_head_dim**-0.5, max(q_lens), out, table_rows=table_rows.to(dev), max_context_len=longest
    )
    expected = expected_rows(q, latent, slots, cached, q_lens, KIMI.qk_head_dim**-0.5, c)
    assert_rel_close(f"mla {rows} {dtype}", out.cpu(), expected, MAX_REL[dtype])


def _layer(dtype) -> LatentAttention:
    gen = torch.Generator().manual_seed(0)
    c, h = KIMI, KIMI.num_heads
    layer = LatentAttention(c, kv_layer=0)

    def w(*dims):
        return (torch.randn(*dims, generator=gen) * dims[-1] ** -0.5).to(dtype).cuda()

    layer.set_weights(
        q_proj=w(h * c.qk_head_dim, HIDDEN),
        kv_a=w(c.kv_lora_rank + c.qk_rope_head_dim, HIDDEN),
        kv_norm=torch.ones(c.kv_lora_rank, dtype=dtype, device="cuda"),
        kv_b=w(h * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
        o_proj=w(HIDDEN, h * c.v_head_dim),
    )
    return layer


def _cache(totals: list[int], dtype, max_req_len: int) -> tuple[KVCache, list[int]]:
    kv = KVCache(1, KIMI.kv_cache_shapes, sum(totals) + 64, len(totals) + 1, max_req_len, dtype, "cuda")
    kv.allocator.free(np.random.default_rng(1).permutation(kv.allocator.alloc(sum(totals) + 64)))
    rows = [kv.alloc_row() for _ in totals]
    kv.extend_many(np.array(rows), np.array(totals))
    kv.buffers[0].normal_()
    return kv, rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_latent_layer_equals_expanded_layer(dtype):
    cached, q_lens = [1900, 3, 700, 64, 0], [1, 4, 2, 4, 3]
    layer = _layer(dtype)
    kv, rows = _cache([a + b for a, b in zip(cached, q_lens)], dtype, 2048)
    ctx = build_context(q_lens, cached, 0, rows, kv, decode_width=4)
    x = torch.randn(ctx.num_tokens, HIDDEN, dtype=dtype, device="cuda")
    real = ctx.groups[0].valid.reshape(-1)
    layer.latent_max_query_len = 0
    expanded = layer(x, ctx)[real]
    layer.latent_max_query_len = 64
    latent = layer(x, ctx)[real]
    assert_rel_close(f"latent vs expanded {dtype}", latent.float(), expanded.float(), MAX_REL[dtype] * 2)


def test_decode_graph_replays_for_other_lengths_without_host_sync():
    """A decode group over fixed buffers (context bound = the cache's row length) captured once: eager under
    `set_sync_debug_mode("error")` (no host sync), then replays after the per-row lengths, table rows and inputs
    change equal eager steps on the same buffers."""
    dtype, width, n = torch.bfloat16, 2, 6
    layer = _layer(dtype)
    totals = [3000, 12, 900, 2, 4000, 77]
    kv, rows = _cache(totals, dtype, 4096)
    i32 = dict(dtype=torch.int32, device="cuda")
    x = torch.zeros(n * width, HIDDEN, dtype=dtype, device="cuda")
    group = AttentionGroup(
        token_index=torch.arange(n * width, device="cuda").view(n, width),
        valid=torch.ones(n, width, dtype=torch.bool, device="cuda"),
        table=kv.req_to_slot,
        table_rows=torch.zeros(n, dtype=torch.int64, device="cuda"),
        context_len=kv.max_req_len,
        query_start=torch.arange(0, n * width, width, **i32),
        query_len=torch.zeros(n, **i32),
        num_cached=torch.zeros(n, **i32),
    )
    write_slots = torch.full((n * width,), kv.hold_slot, dtype=torch.int64, device="cuda")
    ctx = StepContext(
        positions=torch.zeros(n * width, dtype=torch.int64, device="cuda"),
        num_prefill_tokens=0,
        write_slots=write_slots,
        groups=[group],
        kv=kv,
    )

    def fill(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        order = torch.randperm(n, generator=gen)
        q_lens = torch.randint(0, width + 1, (n,), generator=gen)
        cached = torch.tensor(totals)[order] - width
        group.table_rows.copy_(torch.tensor(rows)[order])
        group.query_len.copy_(q_lens)
        group.num_cached.copy_(cached)
        x.copy_(torch.randn(n * width, HIDDEN, generator=gen))

    layer.latent_max_query_len = 64
    fill(0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x, ctx)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out = torch.empty(n * width, HIDDEN, dtype=dtype, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(layer(x, ctx))
    for seed in (1, 2, 3):
        fill(seed)
        graph.replay()
        eager = layer(x, ctx)
        torch.cuda.synchronize()
        assert torch.equal(out, eager), f"replay {seed} differs from eager"
        # a replay over other lengths really computed something new
        assert out.abs().amax() > 0
