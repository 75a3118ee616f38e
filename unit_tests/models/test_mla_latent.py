"""LatentAttention: attention in latent space (kv_b_proj absorbed into the query and output projections, the
paged latents attended directly) equals the expanded form (latents decompressed per head, then attended), in fp32,
for decode and verify windows of ragged contexts at scattered KV slots, beside prefill rows of either form; the
Triton kernel (interpreted) equals the torch path; a corrupted cached latent or swapped table rows must show."""

from __future__ import annotations

import pytest
import torch

from lightllm.cache.kv_cache import KVCache
from lightllm.models.config import AttentionConfig
from lightllm.models.context import AttentionGroup, StepContext, build_context, padded_token_index
from lightllm.models.layers.mla import LatentAttention
from unit_tests.helpers.asserts import assert_rel_close

CFG = AttentionConfig(
    kind="mla", num_heads=5, num_kv_heads=5, kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=20
)
HIDDEN = 40
MAX_REQ_LEN = 96


def make_layer(seed: int) -> LatentAttention:
    gen = torch.Generator().manual_seed(seed)
    c, h = CFG, CFG.num_heads
    layer = LatentAttention(CFG, kv_layer=0)

    def w(*shape):
        return torch.randn(*shape, generator=gen) * shape[-1] ** -0.5

    layer.set_weights(
        q_proj=w(h * c.qk_head_dim, HIDDEN),
        kv_a=w(c.kv_lora_rank + c.qk_rope_head_dim, HIDDEN),
        kv_norm=1 + 0.1 * torch.randn(c.kv_lora_rank, generator=gen),
        kv_b=w(h * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
        o_proj=w(HIDDEN, h * c.v_head_dim),
    )
    return layer


def scattered_cache(cached: list[int], q_lens: list[int], seed: int) -> tuple[KVCache, list[int]]:
    """A cache whose rows' slots interleave (no row contiguous) and whose table has unused rows around the
    batch's, with random latents at every cached position."""
    gen = torch.Generator().manual_seed(seed)
    kv = KVCache(1, CFG.kv_cache_shapes, 320, len(cached) + 3, MAX_REQ_LEN, torch.float32, "cpu")
    kv.alloc_row(), kv.alloc_row()
    rows = [kv.alloc_row() for _ in cached][::-1]
    for step in range(max(c + q for c, q in zip(cached, q_lens))):
        for r, total in zip(rows, [c + q for c, q in zip(cached, q_lens)]):
            if step < total:
                kv.extend(r, 1)
    for r, c in zip(rows, cached):
        kv.write(0, kv.slots(r)[:c], torch.randn(c, CFG.kv_lora_rank + CFG.qk_rope_head_dim, generator=gen))
    return kv, rows


def forward(layer, x, ctx, latent_max_query_len: int, backend: str) -> torch.Tensor:
    layer.latent_max_query_len = latent_max_query_len
    layer.attention_backend = backend
    return layer(x, ctx)


# (cached prefixes, new tokens, prefill rows, decode width): decode, MTP verify widths 2..4 with ragged windows,
# long contexts beside short ones, prefill rows of both forms (70 tokens expanded, 5 latent) beside decode rows
STEPS = {
    "decode": ([13, 70, 1, 40], [1, 1, 1, 1], 0, 1),
    "verify-w2": ([9, 33, 0], [2, 1, 2], 0, 2),
    "verify-w4-ragged": ([9, 0, 60, 21, 4], [1, 4, 3, 2, 4], 0, 4),
    "mixed-prefill": ([0, 7, 30, 11, 50], [70, 5, 3, 1, 2], 2, 3),
}


@pytest.mark.parametrize("step", list(STEPS.values()), ids=list(STEPS))
def test_latent_form_equals_expanded_form(step):
    cached, q_lens, num_prefill, width = step
    layer = make_layer(len(cached))
    kv, rows = scattered_cache(cached, q_lens, len(q_lens))
    ctx = build_context(q_lens, cached, num_prefill, rows, kv, decode_width=width)
    x = torch.randn(ctx.num_tokens, HIDDEN, generator=torch.Generator().manual_seed(7))
    real = torch.from_numpy(padded_token_index(q_lens, num_prefill, width))
    expanded = forward(layer, x, ctx, 0, "torch")[real]
    latent_torch = forward(layer, x, ctx, 64, "torch")[real]
    latent_triton = forward(layer, x, ctx, 64, "triton")[real]
    assert_rel_close("latent (torch) vs expanded", latent_torch, expanded, 1e-5)
    assert_rel_close("latent (triton) vs latent (torch)", latent_triton, latent_torch, 1e-5)
    if num_prefill:
        # the default threshold: the 70-token row expanded, the rest latent, in one step
        assert_rel_close("mixed forms", forward(layer, x, ctx, 64, "triton")[real], expanded, 1e-5)


def test_a_corrupted_latent_page_fails():
    """Twin: one cached latent of row 2 changed after the expanded reference was taken changes row 2's output in
    latent form, and only row 2's."""
    cached, q_lens, _, width = STEPS["verify-w4-ragged"]
    layer = make_layer(3)
    kv, rows = scattered_cache(cached, q_lens, 3)
    ctx = build_context(q_lens, cached, 0, rows, kv, decode_width=width)
    x = torch.randn(ctx.num_tokens, HIDDEN, generator=torch.Generator().manual_seed(8))
    expanded = forward(layer, x, ctx, 0, "torch").view(len(q_lens), width, HIDDEN)
    kv.buffers[0][0, kv.slots(rows[2])[17]] += 2.0
    for backend in ("torch", "triton"):
        latent = forward(layer, x, ctx, 64, backend).view(len(q_lens), width, HIDDEN)
        assert (latent[2, : q_lens[2]] - expanded[2, : q_lens[2]]).abs().amax() > 1e-2
        others = [0, 1, 3, 4]
        mask = torch.arange(width)[None, :] < torch.tensor(q_lens)[others, None]
        assert_rel_close(f"other rows ({backend})", latent[others][mask], expanded[others][mask], 1e-5)


def test_swapped_rows_fail():
    """Twin: the decode group reading two rows' table entries swapped gives outputs far from the expanded form."""
    cached, q_lens, _, width = STEPS["decode"]
    layer = make_layer(4)
    kv, rows = scattered_cache(cached, q_lens, 4)
    ctx = build_context(q_lens, cached, 0, rows, kv, decode_width=width)
    x = torch.randn(ctx.num_tokens, HIDDEN, generator=torch.Generator().manual_seed(9))
    expanded = forward(layer, x, ctx, 0, "torch")
    g = ctx.groups[0]
    ctx.groups[0] = AttentionGroup(
        g.token_index,
        g.valid,
        g.table,
        g.table_rows[[1, 0, 2, 3]],
        g.context_len,
        g.query_start,
        g.query_len,
        g.num_cached,
    )
    for backend in ("torch", "triton"):
        latent = forward(layer, x, ctx, 64, backend)
        assert (latent[:2] - expanded[:2]).abs().amax() > 1e-2


def test_decode_over_fixed_buffers_with_hold_rows():
    """The decode group as the fixed-buffer (CUDA graph) step builds it: the context bound is the cache's row
    length (not the batch's longest context), two HOLD rows (no query) pad the bucket; the real rows equal the
    expanded form of the ordinary step and the HOLD rows' outputs are zero."""
    cached, q_lens, _, width = STEPS["verify-w2"]
    layer = make_layer(5)
    kv, rows = scattered_cache(cached, q_lens, 5)
    ctx = build_context(q_lens, cached, 0, rows, kv, decode_width=width)
    x = torch.randn(ctx.num_tokens, HIDDEN, generator=torch.Generator().manual_seed(10))
    expanded = forward(layer, x, ctx, 0, "torch")
    g, n = ctx.groups[0], len(q_lens) + 2
    i32 = dict(dtype=torch.int32)
    group = AttentionGroup(
        token_index=torch.arange(n * width).view(n, width),
        valid=torch.arange(width)[None, :] < torch.tensor(q_lens + [0, 0])[:, None],
        table=kv.req_to_slot,
        table_rows=torch.cat([g.table_rows, torch.zeros(2, dtype=torch.int64)]),
        context_len=kv.max_req_len,
        query_start=torch.arange(0, n * width, width, **i32),
        query_len=torch.tensor(q_lens + [0, 0], **i32),
        num_cached=torch.tensor(cached + [0, 0], **i32),
    )
    x_bucket = torch.cat([x, torch.randn(2 * width, HIDDEN)])
    write_slots = torch.cat([ctx.write_slots, torch.full((2 * width,), kv.hold_slot)])
    bucket = StepContext(
        positions=torch.zeros(n * width, dtype=torch.int64),
        num_prefill_tokens=0,
        write_slots=write_slots,
        groups=[group],
        kv=kv,
    )
    for backend in ("torch", "triton"):
        out = forward(layer, x_bucket, bucket, 64, backend)
        real = group.valid[: len(q_lens)].reshape(-1)
        assert_rel_close(f"real rows ({backend})", out[: ctx.num_tokens][real], expanded[real], 1e-5)
        assert torch.equal(out[ctx.num_tokens :], torch.zeros(2 * width, HIDDEN))


def test_a_group_bounded_by_the_whole_row_attends_in_latent_space(monkeypatch):
    """A 70-token prefill chunk is expanded in an eager step; the same chunk in a fixed-buffer step (context bound =
    the cache's row length, as prefill graphs build it) attends in latent space (the expanded path would
    decompress the whole row) and gives the same output."""
    import dataclasses

    from lightllm.models.layers import mla

    layer = make_layer(6)
    kv, rows = scattered_cache([10], [70], 6)
    ctx = build_context([70], [10], 1, rows, kv)
    x = torch.randn(ctx.num_tokens, HIDDEN, generator=torch.Generator().manual_seed(11))
    expanded = forward(layer, x, ctx, 64, "torch")
    ctx.groups[0] = dataclasses.replace(ctx.groups[0], context_len=kv.max_req_len)

    def no_expansion(*args, **kwargs):
        raise AssertionError("the expanded form ran")

    monkeypatch.setattr(mla, "attend", no_expansion)
    for backend in ("torch", "triton"):
        assert_rel_close(f"whole-row bound ({backend})", forward(layer, x, ctx, 64, backend), expanded, 1e-5)
