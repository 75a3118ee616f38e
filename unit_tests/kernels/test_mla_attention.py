"""mla_attention: the Triton kernel (interpreted on CPU) and the torch path vs an fp64 latent-space softmax, over
latents at scattered pool slots with ragged contexts and verify windows; a corrupted latent must show."""

from __future__ import annotations

import pytest
import torch

from lightllm.kernels.mla_attention import (
    MLATile,
    launch_splits,
    mla_attention,
    tile_query_lengths,
    warmup_mla_attention,
)
from unit_tests.helpers.asserts import assert_rel_close, poison_

MAX_REL = {torch.float32: 1e-5, torch.float16: 2e-3}
# (heads, latent rank C, rope dims R): Kimi-like ratios at tiny sizes; odd head counts and non-power-of-two dims
SHAPES = {"h4-c32-r8": (4, 32, 8), "h3-c24-r12": (3, 24, 12), "h20-c16-r8": (20, 16, 8)}
# (cached prefix, new tokens) per row: decode, verify windows, a row with no query (a HOLD row), a short chunk
ROW_SETS = {
    "decode": ([7, 40, 0, 69], [1, 1, 1, 1]),
    "verify-w1to4": ([9, 0, 33, 70], [1, 2, 3, 4]),
    "hold-row": ([12, 0, 5], [3, 0, 2]),
    "chunk": ([45], [19]),
}


def reference(q, latent, cached, scale, c):
    """One row: `q [W, H, C + R]` at positions cached .. cached + W - 1 over `latent [L, C + R]` in fp64."""
    q, latent = q.double(), latent.double()
    scores = torch.einsum("whd,ld->hwl", q, latent) * scale
    visible = torch.arange(latent.shape[0])[None, :] <= (cached + torch.arange(q.shape[0]))[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hwl,lc->whc", torch.softmax(scores, dim=-1), latent[:, :c])


def scattered(cached, q_lens, heads, c, r, dtype, seed):
    """Latents of every row at shuffled pool slots, a request table with unused rows around the batch's (read
    through `table_rows`), and the flat queries."""
    gen = torch.Generator().manual_seed(seed)
    total = [a + b for a, b in zip(cached, q_lens)]
    num_slots = sum(total) + 6
    perm = torch.randperm(num_slots, generator=gen)
    latent = torch.randn(num_slots, c + r, generator=gen).to(dtype)
    width = max(total) + 5
    table = torch.full((len(total) + 2, width), num_slots - 1, dtype=torch.int64)
    table_rows = torch.arange(len(total), dtype=torch.int64).flip(0) + 1
    slots, start = [], 0
    for i, n in enumerate(total):
        slots.append(perm[start : start + n])
        table[table_rows[i], :n] = slots[-1]
        start += n
    q = torch.randn(sum(q_lens), heads, c + r, generator=gen).to(dtype)
    return latent, table, table_rows, slots, q


def expected_rows(q, latent, slots, cached, q_lens, scale, c):
    parts, start = [], 0
    for s, cached_len, n in zip(slots, cached, q_lens):
        parts.append(reference(q[start : start + n], latent[s], cached_len, scale, c))
        start += n
    return torch.cat(parts)


def run(backend, q, latent, table, table_rows, cached, q_lens, scale, c, num_splits=None):
    starts = torch.tensor([0] + q_lens[:-1]).cumsum(0).to(torch.int32)
    out = poison_(q.new_empty(q.shape[0], q.shape[1], c))
    lens, prefix = torch.tensor(q_lens, dtype=torch.int32), torch.tensor(cached, dtype=torch.int32)
    mla_attention(
        q,
        latent,
        table,
        starts,
        lens,
        prefix,
        scale,
        max(q_lens),
        out,
        table_rows=table_rows,
        num_splits=num_splits,
        backend=backend,
    )
    return out


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("rows", list(ROW_SETS.values()), ids=list(ROW_SETS))
def test_mla_attention_matches_latent_softmax(rows, shape, dtype, backend):
    cached, q_lens = rows
    heads, c, r = shape
    seed = 13 * sum(cached) + sum(q_lens) + heads + c
    latent, table, table_rows, slots, q = scattered(cached, q_lens, heads, c, r, dtype, seed)
    scale = (c + r) ** -0.5
    out = run(backend, q, latent, table, table_rows, cached, q_lens, scale, c)
    expected = expected_rows(q, latent, slots, cached, q_lens, scale, c)
    assert_rel_close(f"mla_attention {backend} {dtype}", out, expected, MAX_REL[dtype])


@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("rows", [ROW_SETS["verify-w1to4"], ROW_SETS["hold-row"]], ids=["verify-w1to4", "hold-row"])
def test_split_context_matches_latent_softmax(rows, num_splits):
    """Contexts of 1..74 latents split 2 or 5 ways in 32-key blocks (some splits of short rows empty), merged by
    the combine kernel shared with the GQA kernel."""
    cached, q_lens = rows
    latent, table, table_rows, slots, q = scattered(cached, q_lens, 4, 32, 8, torch.float32, 5 + num_splits)
    out = run("triton", q, latent, table, table_rows, cached, q_lens, 0.2, 32, num_splits)
    expected = expected_rows(q, latent, slots, cached, q_lens, 0.2, 32)
    assert_rel_close(f"split x{num_splits}", out, expected, 1e-5)


TILE_VARIANTS = {
    # `min_tile_rows` above the tile's real rows (4 heads x 1..2 tokens in 32 rows): the padding rows read no query
    # and store nothing
    "padded": MLATile(block_heads=4, max_tile_rows=8, block_keys=16, num_warps=4, num_stages=1, min_tile_rows=32),
    # both dots transposed (keys, then latent dims, as the dot's rows)
    "keys-major": MLATile(block_heads=4, max_tile_rows=8, block_keys=16, num_warps=4, num_stages=1, keys_major=True),
}


@pytest.mark.parametrize("variant", TILE_VARIANTS)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("rows", [ROW_SETS["decode"], ROW_SETS["verify-w1to4"]], ids=["decode", "verify-w1to4"])
def test_tile_variants_match_latent_softmax(rows, num_splits, variant):
    """A padded tile and a keys-major tile give the reference's rows, split or not; a changed latent shows
    (twin)."""
    from lightllm.kernels.mla_attention import mla_attention_triton

    cached, q_lens = rows
    latent, table, table_rows, slots, q = scattered(cached, q_lens, 4, 32, 8, torch.float32, 31 + num_splits)
    tile = TILE_VARIANTS[variant]
    starts = torch.tensor([0] + q_lens[:-1]).cumsum(0).to(torch.int32)
    out = poison_(q.new_empty(q.shape[0], q.shape[1], 32))
    lens, prefix = torch.tensor(q_lens, dtype=torch.int32), torch.tensor(cached, dtype=torch.int32)
    args = (q, latent, table, starts, lens, prefix, 0.2, max(q_lens), out)
    mla_attention_triton(*args, table_rows=table_rows, num_splits=num_splits, tile=tile)
    expected = expected_rows(q, latent, slots, cached, q_lens, 0.2, 32)
    assert_rel_close(f"padded tile split x{num_splits}", out, expected, 1e-5)
    # twin: a latent of row 0 changed after the reference was taken shows in row 0
    latent[slots[0][0]] += 3.0
    mla_attention_triton(*args, table_rows=table_rows, num_splits=num_splits, tile=tile)
    assert (out[: q_lens[0]] - expected[: q_lens[0]]).abs().amax() > 0.1


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_corrupted_latent_changes_its_row_only(backend):
    """Twin: one latent of row 1's context (latent part and rope part) changed after the reference was taken must
    change that row's outputs and leave the other rows' equal."""
    cached, q_lens = ROW_SETS["verify-w1to4"]
    latent, table, table_rows, slots, q = scattered(cached, q_lens, 4, 32, 8, torch.float32, 21)
    expected = expected_rows(q, latent, slots, cached, q_lens, 0.2, 32)
    latent[slots[1][0]] += 3.0
    out = run(backend, q, latent, table, table_rows, cached, q_lens, 0.2, 32, 2 if backend == "triton" else None)
    row1 = slice(q_lens[0], q_lens[0] + q_lens[1])
    assert (out[row1] - expected[row1]).abs().amax() > 0.1
    others = torch.ones(out.shape[0], dtype=torch.bool)
    others[row1] = False
    assert_rel_close("untouched rows", out[others], expected[others], 1e-5)


def test_swapped_table_rows_fail():
    """Twin: rows reading each other's table rows give outputs far from the reference."""
    cached, q_lens = ROW_SETS["decode"]
    latent, table, table_rows, slots, q = scattered(cached, q_lens, 4, 32, 8, torch.float32, 22)
    expected = expected_rows(q, latent, slots, cached, q_lens, 0.2, 32)
    swapped = table_rows[[1, 0, 2, 3]]
    out = run("triton", q, latent, table, swapped, cached, q_lens, 0.2, 32)
    assert (out[:2] - expected[:2]).abs().amax() > 0.1


def test_only_the_rows_tokens_are_written():
    """Tokens outside the described rows keep their values (the caller may own the rest of the buffer)."""
    cached, q_lens = [3, 0], [2, 5]
    latent, table, table_rows, _, q = scattered(cached, q_lens, 4, 16, 8, torch.float32, 4)
    q = torch.cat([q, torch.randn(3, 4, 24)])
    for backend in ("triton", "torch"):
        out = run(backend, q, latent, table, table_rows, cached, q_lens, 0.3, 16)
        assert torch.isnan(out[sum(q_lens) :]).all()
        assert torch.isfinite(out[: sum(q_lens)]).all()


def test_split_count_depends_on_the_bound_not_the_lengths(monkeypatch):
    """The split count is a function of the program count and the host context bound: a CUDA graph captured at a
    batch bucket with the cache's row length as the bound holds for every step replayed on it."""
    from lightllm.kernels import attention_splits

    monkeypatch.setattr(attention_splits, "_sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    # Kimi TP1: 32 heads in one block; batch 64 makes 64 programs -> 4 splits (about two waves of 132 SMs)
    assert launch_splits(32, 64, 1, 32768, cuda) == 4
    assert launch_splits(32, 64, 1, 100, cuda) == 2  # short bound: at least two 32-key blocks per split
    assert launch_splits(32, 1, 1, 32768, cuda) == attention_splits.MAX_SPLITS
    assert launch_splits(32, 256, 1, 32768, cuda) == 1
    assert launch_splits(32, 64, 1, 32768, torch.device("cpu")) == 1


def test_warmup_launches_every_variant():
    launches = warmup_mla_attention(4, 16, 8, torch.float32, "cpu")
    assert launches == 2 * len(tile_query_lengths(4))
    assert tile_query_lengths(32, MLATile()) == [1]
    assert tile_query_lengths(4, MLATile()) == [1, 2, 4, 8]


def test_tuned_tiles_by_device_and_row_bucket(tmp_path, monkeypatch):
    """`get_tile` reads the device's table (nearest row bucket), else the default; the warm-up compiles every tuned
    tile of the shape; a tile's `waves` scales the split count (twin: another shape or dtype keeps the default)."""
    import importlib

    from lightllm.kernels import attention_splits
    from lightllm.kernels.tuned_tables import write_entries

    mla = importlib.import_module("lightllm.kernels.mla_attention")

    monkeypatch.setattr(mla, "CONFIG_DIR", tmp_path)
    mla._table.cache_clear()
    mla.get_tile.cache_clear()
    small = MLATile(block_heads=2, max_tile_rows=4, block_keys=16, num_warps=4, num_stages=2, waves=4)
    wide = MLATile(block_heads=4, max_tile_rows=4, block_keys=16, num_warps=4, num_stages=1, waves=2)
    key = mla.tile_key(4, 16, 8, torch.float32)
    write_entries(tmp_path / "cpu.json", key, {1: small.__dict__, 64: wide.__dict__})
    cpu = torch.device("cpu")
    try:
        assert mla.get_tile(4, 16, 8, torch.float32, cpu, 1) == small
        assert mla.get_tile(4, 16, 8, torch.float32, cpu, 40) == wide
        assert mla.get_tile(4, 16, 8, torch.float16, cpu, 1) == MLATile()
        assert mla.get_tile(8, 16, 8, torch.float32, cpu, 1) == MLATile()
        assert mla.shape_tiles(4, 16, 8, torch.float32, cpu) == [small, wide]
        expected = 2 * (len(tile_query_lengths(4, small)) + len(tile_query_lengths(4, wide)))
        assert warmup_mla_attention(4, 16, 8, torch.float32, "cpu") == expected
    finally:
        mla._table.cache_clear()
        mla.get_tile.cache_clear()
    monkeypatch.setattr(attention_splits, "_sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    assert launch_splits(32, 64, 1, 32768, cuda, MLATile(waves=4)) == 8
    assert launch_splits(32, 64, 1, 32768, cuda, MLATile(block_heads=16, waves=4)) == 4


def test_a_broken_tuned_tile_is_refused_by_name(tmp_path, monkeypatch):
    """A table entry without every tile field (or with another) is a ValueError naming it, not a TypeError at the
    first launch (twin of the valid entries above)."""
    import importlib

    from lightllm.kernels.tuned_tables import write_entries

    mla = importlib.import_module("lightllm.kernels.mla_attention")
    monkeypatch.setattr(mla, "CONFIG_DIR", tmp_path)
    mla._table.cache_clear()
    mla.get_tile.cache_clear()
    broken = {**MLATile().__dict__, "BLOCK_K": 16}
    del broken["waves"]
    write_entries(tmp_path / "cpu.json", mla.tile_key(4, 16, 8, torch.float32), {1: broken})
    try:
        with pytest.raises(ValueError, match="MLA tile entries need exactly"):
            mla.get_tile(4, 16, 8, torch.float32, torch.device("cpu"), 1)
        with pytest.raises(ValueError, match="MLA tile entries need exactly"):
            mla.shape_tiles(4, 16, 8, torch.float32, torch.device("cpu"))
    finally:
        mla._table.cache_clear()
        mla.get_tile.cache_clear()
