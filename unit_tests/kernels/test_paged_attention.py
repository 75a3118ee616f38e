"""paged_attention (Triton, interpreted on CPU) vs an explicit-mask softmax reference and vs the SDPA path."""

from __future__ import annotations

import math
import os

import pytest
import torch

from lightllm.cache.kv_cache import KVCache
from lightllm.kernels.paged_attention import paged_attention
from lightllm.models.context import build_context, padded_decode_width, padded_token_index
from lightllm.models.layers.attention import GatedAttention
from lightllm.models.layers.mla import LatentAttention
from lightllm.models.layers.paged_attention import attend
from unit_tests.helpers.asserts import assert_rel_close, poison_
from unit_tests.helpers.sm90 import PTXAS, run_lowering_module
from unit_tests.models.drive import make_runner, prefill, verify

MAX_REL = {torch.float32: 1e-5, torch.float16: 2e-3}


def reference(q, keys, values, cached, scale):
    """One row: `q [W, H, Dk]` at positions cached .. cached + W - 1 over `keys [L, Hk, Dk]`, `values [L, Hk, Dv]`;
    softmax(q kᵀ · scale + causal mask) v in fp64."""
    q, keys, values = q.double(), keys.double(), values.double()
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("whd,lhd->hwl", q, keys) * scale
    query_pos = cached + torch.arange(q.shape[0])
    visible = torch.arange(keys.shape[0])[None, :] <= query_pos[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hwl,lhd->whd", torch.softmax(scores, dim=-1), values)


def scattered_pool(cached, q_lens, kv_heads, dk, dv, dtype, seed):
    """A pool holding every row's context at shuffled slots; returns (k_pool, v_pool, per-row slot tensors)."""
    gen = torch.Generator().manual_seed(seed)
    total = [c + q for c, q in zip(cached, q_lens)]
    num_slots = sum(total) + 5
    perm = torch.randperm(num_slots, generator=gen)
    k_pool = torch.randn(num_slots, kv_heads, dk, generator=gen).to(dtype)
    v_pool = torch.randn(num_slots, kv_heads, dv, generator=gen).to(dtype)
    slots, start = [], 0
    for n in total:
        slots.append(perm[start : start + n])
        start += n
    return k_pool, v_pool, slots


def run_kernel(q, k_pool, v_pool, slots, cached, q_lens, scale, num_splits=None):
    width = max(s.numel() for s in slots) + 3
    table = torch.full((len(slots), width), -1, dtype=torch.int64)
    for i, s in enumerate(slots):
        table[i, : s.numel()] = s
    starts = torch.tensor([0] + q_lens[:-1]).cumsum(0).to(torch.int32)
    out = poison_(q.new_empty(q.shape[0], q.shape[1], v_pool.shape[-1]))
    lens, prefix = torch.tensor(q_lens, dtype=torch.int32), torch.tensor(cached, dtype=torch.int32)
    paged_attention(q, k_pool, v_pool, table, starts, lens, prefix, scale, max(q_lens), out, num_splits=num_splits)
    return out


def expected_rows(q, k_pool, v_pool, slots, cached, q_lens, scale):
    parts, start = [], 0
    for s, c, n in zip(slots, cached, q_lens):
        parts.append(reference(q[start : start + n], k_pool[s], v_pool[s], c, scale))
        start += n
    return torch.cat(parts)


# (cached prefix, new tokens) per row: prefill chunks 1..37 with and without prefix, verify windows 1..4
ROW_SETS = {
    "prefill-no-prefix": ([0], [37]),
    "prefill-after-prefix": ([19], [13]),
    # contexts over one 64-key block exercise the online-softmax rescaling
    "prefill-after-long-prefix": ([61], [37]),
    "chunk1-after-long-prefix": ([90], [1]),
    "verify-w1to4": ([7, 0, 33, 12], [1, 2, 3, 4]),
    "mixed": ([0, 23, 5, 9, 0], [17, 29, 1, 4, 3]),
}
# (query heads, key heads, Dk, Dv): GQA ratios 1, 2, 4; Dk != Dv; non-power-of-two dims (Kimi-like 24/16)
HEAD_SETS = {
    "gqa1-dk24-dv16": (3, 3, 24, 16),
    "gqa2-dk16-dv16": (4, 2, 16, 16),
    "gqa4-dk12-dv20": (8, 2, 12, 20),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("heads", list(HEAD_SETS.values()), ids=list(HEAD_SETS))
@pytest.mark.parametrize("rows", list(ROW_SETS.values()), ids=list(ROW_SETS))
def test_paged_attention_matches_masked_softmax(rows, heads, dtype):
    cached, q_lens = rows
    h, hk, dk, dv = heads
    seed = sum(cached) * 31 + sum(q_lens) + h + dk
    k_pool, v_pool, slots = scattered_pool(cached, q_lens, hk, dk, dv, dtype, seed)
    q = torch.randn(sum(q_lens), h, dk, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    scale = 1 / math.sqrt(dk)
    out = run_kernel(q, k_pool, v_pool, slots, cached, q_lens, scale)
    expected = expected_rows(q, k_pool, v_pool, slots, cached, q_lens, scale)
    assert_rel_close(f"paged_attention {dtype}", out, expected, MAX_REL[dtype])


@pytest.mark.parametrize("rows", [([0], [40]), ([70], [21]), ([5, 0], [3, 33])], ids=["chunk", "after-prefix", "mixed"])
def test_large_head_prefill_tile_matches_masked_softmax(rows):
    """16-bit heads of 256 dims (Qwen3.5's attention, GQA 8) take the 128-row prefill tile with 64-key blocks:
    chunks longer than one tile, after a prefix longer than one key block, beside a short row."""
    from lightllm.kernels.paged_attention import _tile

    cached, q_lens = rows
    h, hk, dk = 16, 2, 256
    assert _tile(max(q_lens), h // hk, dk, torch.float16.itemsize).bm == 128
    k_pool, v_pool, slots = scattered_pool(cached, q_lens, hk, dk, dk, torch.float16, seed=sum(q_lens))
    q = torch.randn(sum(q_lens), h, dk, generator=torch.Generator().manual_seed(3)).to(torch.float16)
    out = run_kernel(q, k_pool, v_pool, slots, cached, q_lens, 1 / 16)
    expected = expected_rows(q, k_pool, v_pool, slots, cached, q_lens, 1 / 16)
    assert_rel_close("paged_attention 256-dim heads", out, expected, MAX_REL[torch.float16])


def test_mla_expanded_heads_take_the_128_row_prefill_tile():
    """MLA's expanded heads (one query head per key head, keys of 192 dims, values of 128) take the same 128-row
    prefill tile: a chunk longer than one tile after a prefix longer than one key block, beside a short row."""
    from lightllm.kernels.paged_attention import _tile

    cached, q_lens = [70, 5], [150, 3]
    h, dk, dv = 2, 192, 128
    assert _tile(max(q_lens), 1, 256, torch.float16.itemsize).bm == 128
    k_pool, v_pool, slots = scattered_pool(cached, q_lens, h, dk, dv, torch.float16, seed=11)
    q = torch.randn(sum(q_lens), h, dk, generator=torch.Generator().manual_seed(4)).to(torch.float16)
    out = run_kernel(q, k_pool, v_pool, slots, cached, q_lens, dk**-0.5)
    expected = expected_rows(q, k_pool, v_pool, slots, cached, q_lens, dk**-0.5)
    assert_rel_close("paged_attention MLA expanded heads", out, expected, MAX_REL[torch.float16])


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="Triton's bundled ptxas is not installed")
def test_prefill_tiles_lower_for_sm90_within_shared_memory():
    """The largest tile of each served head shape lowers for sm_90 within the 227 KB of shared memory a block may
    take; MLA's expanded heads without a register spill (Qwen3.5's GQA tile, timed fastest, spills ~200 bytes)."""
    out = run_lowering_module("unit_tests.helpers.attention_sm90_lowering")
    # name -> (BT, BM, BN, registers, spill bytes, shared bytes)
    rows = {line.rsplit(" ", 6)[0]: list(map(int, line.rsplit(" ", 6)[1:])) for line in out.splitlines()}
    assert set(rows) == {"qwen3.5 gqa", "kimi mla expanded"}, out
    assert all(r[1] == 128 and r[5] <= 227 * 1024 for r in rows.values()), out
    assert rows["kimi mla expanded"][4] == 0, out


@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "rows",
    [ROW_SETS[k] for k in ("prefill-after-long-prefix", "verify-w1to4", "mixed")],
    ids=["prefill-after-long-prefix", "verify-w1to4", "mixed"],
)
def test_split_context_matches_masked_softmax(rows, dtype, num_splits):
    """Contexts split across programs and merged by the combine kernel: rows of 1..98 keys over 2 or 5 splits of
    whole 64-key blocks, so some splits of short rows hold no key at all and padded tile rows see nothing."""
    cached, q_lens = rows
    h, hk, dk, dv = HEAD_SETS["gqa4-dk12-dv20"]
    seed = 7 * sum(cached) + num_splits
    k_pool, v_pool, slots = scattered_pool(cached, q_lens, hk, dk, dv, dtype, seed)
    q = torch.randn(sum(q_lens), h, dk, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    out = run_kernel(q, k_pool, v_pool, slots, cached, q_lens, 0.3, num_splits)
    expected = expected_rows(q, k_pool, v_pool, slots, cached, q_lens, 0.3)
    assert_rel_close(f"split x{num_splits} {dtype}", out, expected, MAX_REL[dtype])


def test_split_context_reads_every_span():
    """Twin of the split test: keys in the last split's span of a 98-key row perturbed after the reference was
    taken must change that row's output (a combine that dropped a split would pass the equality test otherwise
    only by luck; here it must not)."""
    cached, q_lens = [61], [37]
    k_pool, v_pool, slots = scattered_pool(cached, q_lens, 2, 12, 20, torch.float32, 3)
    q = torch.randn(37, 8, 12, generator=torch.Generator().manual_seed(4))
    expected = expected_rows(q, k_pool, v_pool, slots, cached, q_lens, 0.3)
    v_pool[slots[0][64:]] += 1.0  # positions 64..97: the second of two 64-key spans
    out = run_kernel(q, k_pool, v_pool, slots, cached, q_lens, 0.3, num_splits=2)
    # queries at positions >= 64 (query 3 on) see the perturbed values; earlier ones do not
    assert_rel_close("queries before the span", out[:3], expected[:3], 1e-5)
    assert (out[3:] - expected[3:]).abs().amax() > 0.1


def test_split_count_fills_the_gpu_only_when_needed(monkeypatch):
    from lightllm.kernels import attention_splits
    from lightllm.kernels import paged_attention as kernel

    monkeypatch.setattr(attention_splits, "_sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    assert kernel.num_context_splits(26, 8292, 32, cuda) == 10  # a 100-token chunk after an 8k prefix
    assert kernel.num_context_splits(2, 8292, 32, cuda) == kernel.MAX_SPLITS  # one decode row, long context
    assert kernel.num_context_splits(2, 100, 32, cuda) == 2  # short context: at least two key blocks per split
    assert kernel.num_context_splits(512, 8292, 32, cuda) == 1  # b256 decode fills the GPU already
    assert kernel.num_context_splits(2, 8292, 32, torch.device("cpu")) == 1


def test_paged_attention_leaves_other_tokens_untouched():
    """Only the described rows' tokens are written (the caller may launch once per group into one buffer)."""
    cached, q_lens = [3, 0], [2, 5]
    k_pool, v_pool, slots = scattered_pool(cached, q_lens, 2, 8, 8, torch.float32, 5)
    q = torch.randn(sum(q_lens) + 2, 4, 8)
    out = run_kernel(q, k_pool, v_pool, slots, cached, q_lens, 0.3)
    assert torch.isnan(out[sum(q_lens) :]).all()
    assert torch.isfinite(out[: sum(q_lens)]).all()


@pytest.mark.parametrize("num_prefill_rows", [0, 1, 3], ids=lambda n: f"prefill{n}")
def test_attend_triton_equals_sdpa_path(num_prefill_rows):
    """`attend(backend="triton")` over a KVCache (pool addressing and gathered-KV addressing) == the SDPA path."""
    torch.manual_seed(num_prefill_rows)
    heads, kv_heads, dk, dv = 6, 2, 20, 12
    kv = KVCache(1, ((kv_heads, dk), (kv_heads, dv)), 96, 7, 48, torch.float32, "cpu")
    cached, q_lens = [11, 0, 4, 6], [3, 9, 2, 1]
    q_lens[:num_prefill_rows] = [7, 13, 1][:num_prefill_rows]
    # unused table rows around the batch's: the kernel must read each row's own table row
    kv.alloc_row(), kv.alloc_row()
    rows = [kv.alloc_row() for _ in q_lens][::-1]
    for step in range(max(c + q for c, q in zip(cached, q_lens))):
        for r, (c, q) in zip(rows, zip(cached, q_lens)):
            if step < c + q:
                kv.extend(r, 1)
    ctx = build_context(q_lens, cached, num_prefill_rows, rows, kv, decode_width=5)
    for r in rows:
        n = kv.length(r)
        kv.write(0, kv.slots(r), torch.randn(n, kv_heads, dk), torch.randn(n, kv_heads, dv))
    q = torch.randn(ctx.num_tokens, heads, dk)
    # only the real tokens' outputs are defined (padding tokens of decode rows are left to the caller)
    width = padded_decode_width(q_lens, num_prefill_rows, 5)
    real = torch.from_numpy(padded_token_index(q_lens, num_prefill_rows, width))

    def load_kv(table):
        return tuple(kv.gather(0, table))

    expected = attend(q, ctx.groups, load_kv, 0.2, backend="torch")[real]
    pool = (kv.buffers[0][0], kv.buffers[1][0])
    over_pool = attend(q, ctx.groups, load_kv, 0.2, pool, "triton")[real]
    assert_rel_close("triton over the pool", over_pool, expected, 1e-5)
    over_gathered = attend(q, ctx.groups, load_kv, 0.2, None, "triton")[real]
    assert_rel_close("triton over gathered KV", over_gathered, expected, 1e-5)


def _force_backend(runner, backend: str) -> None:
    for module in runner.model.modules():
        if isinstance(module, (GatedAttention, LatentAttention)):
            module.attention_backend = backend


@pytest.mark.parametrize("arch", ["qwen3_next", "kimi_linear"])
def test_model_forward_triton_attention_equals_torch(tiny_model, arch):
    """A tiny model's chunked prefill (a chunk after a cached prefix) and a verify window of width 3 give the same
    logits with the attention forced to the Triton kernel (interpreted) as with the SDPA path."""
    model_dir = str(tiny_model(arch))
    prompt = [(37 * i + 11) % 450 for i in range(9)]
    logits = {}
    for backend in ("torch", "triton"):
        runner = make_runner(model_dir, max_width=3)
        _force_backend(runner, backend)
        h = runner.add_request()
        last = prefill(runner, h, prompt, chunk=5)
        window = verify(runner, h, [int(last.argmax()), 5, 77])
        runner.accept([h], [3])
        logits[backend] = torch.cat([last[None], window])
    assert_rel_close(f"{arch} logits", logits["triton"], logits["torch"], 1e-5)


@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("bk", [128, 256])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_a_few_tile_variants_serve_every_query_length(group, bk, itemsize):
    """Query lengths 1..2000 map to the tile variants `tile_query_lengths` lists (what the warm-up compiles): the
    powers of two below the largest tile and the largest tile, a handful instead of one per length."""
    from lightllm.kernels.paged_attention import _tile, tile_query_lengths

    variants = {_tile(n, group, bk, itemsize) for n in range(1, 2001)}
    warmed = {_tile(n, group, bk, itemsize) for n in tile_query_lengths(group, bk, itemsize)}
    assert variants == warmed
    assert len(variants) <= ((128 if bk > 128 and itemsize == 2 else 64) // group).bit_length() + 1


@pytest.mark.parametrize("arch", ["qwen3_next", "kimi_linear"])
def test_attention_warmup_runs_each_layer_shape(tiny_model, arch):
    """The start-up attention warm-up at a tiny model's attention shapes (GQA over the pool, MLA over gathered
    KV), under the interpreter: every tile size, split and unsplit, launches."""
    from lightllm.kernels.paged_attention import tile_query_lengths, warmup_paged_attention

    runner = make_runner(str(tiny_model(arch)), max_width=2)
    shapes = {m.attention_kernel_shape() for m in runner.model.modules() if hasattr(m, "attention_kernel_shape")}
    assert shapes, "the model has attention layers"
    for heads, kv_heads, dk, dv, by_row in shapes:
        launches = warmup_paged_attention(heads, kv_heads, dk, dv, torch.float32, "cpu", by_row)
        bk = max(16, 1 << (max(dk, dv) - 1).bit_length())
        assert launches == 2 * len(tile_query_lengths(heads // kv_heads, bk, torch.float32.itemsize))
    assert runner.warmup_attention() == 0  # on the CPU nothing is compiled
