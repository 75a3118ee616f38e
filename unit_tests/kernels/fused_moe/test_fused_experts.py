"""fused_experts (Triton grouped GEMMs + combine, interpreted on CPU) vs `run_experts` (the per-expert torch loop)
evaluated in fp64, at odd sizes: idle experts, every token on one expert, top_k = experts, 1 to 300 tokens, with
Qwen's softmax router and Kimi's grouped sigmoid router."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightllm.kernels.fused_moe import fused_experts, heuristic_config, sigmoid_topk, softmax_topk
from lightllm.kernels.fused_moe import fused_moe as fused_moe_module
from lightllm.kernels.fused_moe.align import align_pairs, align_pairs_reference, max_blocks, tile_sizes
from lightllm.models.layers.moe import run_experts
from unit_tests.helpers.asserts import assert_rel_close, relative_error

MAX_REL = {torch.float32: 1e-4, torch.float16: 5e-3}
# small tiles keep the interpreter fast and exercise partial N and K tiles and several blocks per expert
SMALL = {
    "BLOCK_M": 16,
    "gate_up": {"BLOCK_N": 32, "BLOCK_K": 16, "num_warps": 4, "num_stages": 2},
    "down": {"BLOCK_N": 32, "BLOCK_K": 16, "num_warps": 4, "num_stages": 2},
}


def experts(num_experts: int, hidden: int, inter: int, seed: int, dtype):
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    return gate_up.to(dtype), down.to(dtype)


def routed(num_tokens: int, num_experts: int, top_k: int, seed: int, router: str = "softmax"):
    """Qwen's softmax top-k, or Kimi's sigmoid router (correction bias, scaled weights, group-limited where the
    experts split into groups: two of four groups, or one of two)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    if router == "softmax":
        return softmax_topk(logits, top_k, True)
    bias = torch.randn(num_experts, generator=gen) * 0.1
    groups, top_groups = (4, 2) if num_experts % 4 == 0 else (2, 1)
    return sigmoid_topk(logits, bias, top_k, True, 2.5, groups, top_groups)


def reference(x, gate_up, down, weights, ids, shared=None, shared_gate_logit=None):
    out = run_experts(x.double(), gate_up.double(), down.double(), weights.double(), ids.long())
    if shared is not None:
        gate = shared_gate_logit
        out = out + (shared.double() if gate is None else torch.sigmoid(gate.double()) * shared.double())
    return out


def check(x, gate_up, down, weights, ids, config=SMALL, **shared):
    out = fused_experts(x, gate_up, down, weights, ids, config=config, **shared)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert_rel_close("out", out, reference(x, gate_up, down, weights, ids, **shared), MAX_REL[x.dtype])
    return out


CASES = [
    # tokens, hidden, inter, experts, top_k
    (1, 24, 20, 8, 2),
    (5, 40, 24, 12, 2),
    (33, 48, 40, 6, 3),
    (300, 32, 24, 8, 2),
]


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("num_tokens,hidden,inter,num_experts,top_k", CASES, ids=["T1", "T5-idle", "T33", "T300"])
def test_fused_experts_matches_loop(num_tokens, hidden, inter, num_experts, top_k, dtype, router):
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    gate_up, down = experts(num_experts, hidden, inter, seed=1, dtype=dtype)
    weights, ids = routed(num_tokens, num_experts, top_k, seed=2, router=router)
    check(x, gate_up, down, weights, ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_every_token_on_one_expert(dtype):
    """Expert 3 takes all 70 tokens (five blocks of 16, a partial last one); the other choices spread out."""
    num_tokens, num_experts = 70, 7
    x = torch.randn(num_tokens, 40, generator=torch.Generator().manual_seed(4)).to(dtype)
    gate_up, down = experts(num_experts, 40, 24, seed=5, dtype=dtype)
    ids = torch.stack([torch.full((num_tokens,), 3), torch.arange(num_tokens) % 3 + 4], dim=1)
    weights = torch.rand(num_tokens, 2, generator=torch.Generator().manual_seed(6))
    check(x, gate_up, down, weights, ids)


def test_top_k_is_the_number_of_experts():
    num_tokens, num_experts = 9, 5
    x = torch.randn(num_tokens, 24, generator=torch.Generator().manual_seed(7))
    gate_up, down = experts(num_experts, 24, 16, seed=8, dtype=torch.float32)
    weights, ids = routed(num_tokens, num_experts, num_experts, seed=9)
    check(x, gate_up, down, weights, ids)


@pytest.mark.parametrize("gated", [False, True], ids=["shared", "gated-shared"])
def test_shared_expert_is_added_in_the_combine(gated):
    num_tokens, hidden = 11, 24
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(num_tokens, hidden, generator=gen)
    gate_up, down = experts(6, hidden, 16, seed=11, dtype=torch.float32)
    weights, ids = routed(num_tokens, 6, 2, seed=12)
    shared = torch.randn(num_tokens, hidden, generator=gen)
    gate = torch.randn(num_tokens, 1, generator=gen) if gated else None
    check(x, gate_up, down, weights, ids, shared=shared, shared_gate_logit=gate)


def test_long_inputs_run_in_chunks(monkeypatch):
    """37 tokens in chunks of 16 (the last one partial), each chunk with its own layout and its own rows of the
    shared expert and gate: the same result as one launch sequence."""
    monkeypatch.setattr(fused_moe_module, "MAX_CHUNK_TOKENS", 16)
    chunks = []
    real_align = fused_moe_module.align_pairs
    monkeypatch.setattr(fused_moe_module, "align_pairs", lambda ids, *a: chunks.append(len(ids)) or real_align(ids, *a))
    gen = torch.Generator().manual_seed(22)
    x = torch.randn(37, 24, generator=gen)
    gate_up, down = experts(5, 24, 16, seed=23, dtype=torch.float32)
    weights, ids = routed(37, 5, 2, seed=24)
    shared, gate = torch.randn(37, 24, generator=gen), torch.randn(37, 1, generator=gen)
    check(x, gate_up, down, weights, ids, shared=shared, shared_gate_logit=gate)
    assert chunks == [16, 16, 5]


def test_heuristic_config_and_deterministic_bits():
    """The default (heuristic) tiles also match, and two runs give the same bits."""
    x = torch.randn(45, 56, generator=torch.Generator().manual_seed(13))
    gate_up, down = experts(10, 56, 36, seed=14, dtype=torch.float32)
    weights, ids = routed(45, 10, 3, seed=15)
    assert heuristic_config(45, 10, 36, 56, 3, torch.float32)["BLOCK_M"] == 16
    first = check(x, gate_up, down, weights, ids, config=None)
    assert torch.equal(first, fused_experts(x, gate_up, down, weights, ids))


def test_prefill_heuristic_tiles_match():
    """A prefill-sized batch (over 96 rows per expert) takes the heuristic's 128-row blocks and wide tiles,
    clamped to tiny matrices: still the reference, with partial blocks (expert row counts no multiple of 128)."""
    x = torch.randn(203, 40, generator=torch.Generator().manual_seed(25))
    gate_up, down = experts(4, 40, 24, seed=26, dtype=torch.float32)
    weights, ids = routed(203, 4, 2, seed=27)
    assert heuristic_config(203, 4, 24, 40, 2, torch.float32)["BLOCK_M"] == 128
    check(x, gate_up, down, weights, ids, config=None)


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_swapped_experts_fail(router):
    """Twin: the kernel run on weights with two used experts swapped must not match the reference."""
    x = torch.randn(33, 40, generator=torch.Generator().manual_seed(16))
    gate_up, down = experts(6, 40, 24, seed=17, dtype=torch.float32)
    weights, ids = routed(33, 6, 2, seed=18, router=router)
    used = ids.flatten().unique()
    a, b = used[0].item(), used[1].item()
    perm = torch.arange(6)
    perm[a], perm[b] = b, a
    out = fused_experts(x, gate_up[perm].contiguous(), down[perm].contiguous(), weights, ids, config=SMALL)
    assert relative_error(out, reference(x, gate_up, down, weights, ids)) > 1e-2


def test_align_pairs_layout():
    """Pairs grouped by expert in pair order, each expert padded to whole blocks, blocks past the end skipped."""
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    blocks = align_pairs(ids, num_experts=4, block_m=2)
    sentinel = 6
    # worst case: 6 pairs + 4 experts x 1 padding row = 10 rows = 5 blocks
    assert blocks.num_blocks == max_blocks(6, 4, 2) == 5
    assert blocks.sorted_pairs.tolist() == [1, 4, 3, sentinel, 0, 2, 5, sentinel, sentinel, sentinel]
    assert blocks.block_expert.tolist() == [0, 1, 2, 2, 4]


POISON = -(2**30)


def align_ids(num_tokens: int, num_experts: int, top_k: int, pattern: str) -> torch.Tensor:
    """Seeded random expert ids [T, top_k]: `spread` top_k distinct experts per token; `hot` the same but over two
    hot experts for 9 in 10 choices (the others mostly idle); `one` every choice on one expert."""
    gen = torch.Generator().manual_seed(num_tokens * 1009 + num_experts * 31 + top_k)
    if pattern == "one":
        return torch.full((num_tokens, top_k), int(torch.randint(num_experts, (1,), generator=gen)))
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    if pattern == "hot":
        hot = torch.randperm(num_experts, generator=gen)[:2]
        ids = torch.where(
            torch.rand(ids.shape, generator=gen) < 0.9, hot[torch.randint(2, ids.shape, generator=gen)], ids
        )
    return ids


# (tokens, experts, top_k, block_m, pattern): idle experts (1 token of 8 experts, 3 of 256), top_k = experts,
# experts not a power of two, every pair on one expert, two hot experts, 1 to 300 tokens, 256 and 512 experts at
# small counts and over many chunks (chunks of 64 and 32 pairs), several block tiles with a partial last one
# (200 x 8 of 256 at BLOCK_M 16: 340 blocks in tiles of 64; 50 x 10 of 512: 500 blocks in tiles of 32)
ALIGN_CASES = [
    (1, 8, 2, 16, "spread"),
    (37, 12, 3, 16, "spread"),
    (9, 5, 5, 16, "spread"),
    (300, 6, 1, 32, "one"),
    (3, 5, 2, 64, "one"),
    (129, 7, 2, 16, "hot"),
    (300, 24, 4, 16, "hot"),
    (2, 256, 8, 16, "spread"),
    (3, 256, 8, 128, "spread"),
    (200, 256, 8, 16, "spread"),
    (64, 256, 8, 32, "hot"),
    (1, 512, 10, 16, "spread"),
    (5, 512, 10, 32, "spread"),
    (50, 512, 10, 64, "spread"),
    (17, 384, 6, 16, "spread"),
]


@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m,pattern", ALIGN_CASES, ids=lambda v: str(v))
def test_align_pairs_matches_the_sort_reference(monkeypatch, num_tokens, num_experts, top_k, block_m, pattern):
    """The three-launch Triton layout equals the stable-sort one into buffers poisoned beforehand (every
    `torch.empty` of the call comes back filled with POISON), so each padding row and block past the end must be
    written."""
    ids = align_ids(num_tokens, num_experts, top_k, pattern)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(POISON))
    got = align_pairs(ids, num_experts, block_m)
    monkeypatch.undo()
    ref = align_pairs_reference(ids, num_experts, block_m)
    assert torch.equal(got.sorted_pairs, ref.sorted_pairs), (got.sorted_pairs, ref.sorted_pairs)
    assert torch.equal(got.block_expert, ref.block_expert), (got.block_expert, ref.block_expert)
    # twin: the reference of ids with a used expert's label traded for another's differs (its pairs or its
    # blocks move), so the comparison above sees a misplaced expert
    a = int(ids[0, 0])
    b = (a + 1) % num_experts
    swapped = torch.where(ids == a, b, torch.where(ids == b, a, ids))
    twin = align_pairs_reference(swapped, num_experts, block_m)
    assert not (torch.equal(got.sorted_pairs, twin.sorted_pairs) and torch.equal(got.block_expert, twin.block_expert))


def test_align_cases_cover_partial_block_tiles():
    """Some cases above span several scatter tiles of blocks with a partial last one."""
    partial = [
        (t, e, k, m)
        for t, e, k, m, _ in ALIGN_CASES
        if (n := max_blocks(t * k, e, m)) > (bb := tile_sizes(e, m)["BB"]) and n % bb
    ]
    assert len(partial) >= 2, partial


def test_fused_experts_validates_shapes():
    x = torch.randn(3, 8)
    gate_up, down = experts(4, 8, 6, seed=0, dtype=torch.float32)
    with pytest.raises(AssertionError, match="gate_up"):
        fused_experts(x, gate_up[:, :, :7].contiguous(), down, torch.rand(3, 2), torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="powers of two"):
        bad = {**SMALL, "BLOCK_M": 24}
        fused_experts(x, gate_up, down, torch.rand(3, 2), torch.zeros(3, 2, dtype=torch.long), config=bad)


def test_no_tokens():
    gate_up, down = experts(4, 8, 6, seed=0, dtype=torch.float32)
    out = fused_experts(torch.empty(0, 8), gate_up, down, torch.empty(0, 2), torch.empty(0, 2, dtype=torch.long))
    assert out.shape == (0, 8)


def test_silu_gate_order():
    """gate rows come first in gate_up: the fused activation is silu(gate) * up, not silu(up) * gate."""
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(20))
    gate_up, down = experts(2, 16, 16, seed=21, dtype=torch.float32)
    weights, ids = torch.ones(4, 1), torch.zeros(4, 1, dtype=torch.long)
    out = fused_experts(x, gate_up, down, weights, ids, config=SMALL)
    g, u = F.linear(x, gate_up[0]).chunk(2, dim=-1)
    assert_rel_close("out", out, F.linear(F.silu(g) * u, down[0]), 1e-5)
    swapped = torch.cat([gate_up[:, 16:], gate_up[:, :16]], dim=1).contiguous()
    assert relative_error(fused_experts(x, swapped, down, weights, ids, config=SMALL), out) > 1e-2
