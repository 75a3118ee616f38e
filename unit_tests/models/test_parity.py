"""ModelRunner.forward vs transformers on tiny checkpoints (CPU, fp32): prefill, chunked prefill, decode, mixed
batches. Errors are max|a - e| / max|e| per compared logit row."""

from __future__ import annotations

import pytest
import torch

from lightllm.engine.batch import ForwardBatch
from unit_tests.models.conftest import MODEL_CASES
from unit_tests.models.drive import decode, make_runner, prefill

MAX_REL = 1e-4


def max_rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def assert_logits(name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    err = max_rel(actual, expected)
    assert err < MAX_REL, f"{name}: max relative error {err:.3e} >= {MAX_REL:.0e}"


def prompt(seed: int, length: int, vocab: int = 470) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("seed,length", [(0, 7), (1, 33), (2, 70)], ids=lambda v: str(v))
@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_prefill_logits_match_transformers(tiny, case, seed, length):
    model_dir, oracle = tiny(case)
    ids = prompt(seed, length)
    runner = make_runner(model_dir)
    logits = prefill(runner, runner.add_request(), ids)
    assert_logits(f"{case} prefill T={length}", logits, oracle.prefill_logits(ids)[0, -1])


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_batched_prefill_rows_match_transformers(tiny, case):
    """Three prompts of different lengths in one step (varlen prefill, one attention group per row)."""
    model_dir, oracle = tiny(case)
    prompts = [prompt(10 + i, n) for i, n in enumerate((5, 19, 12))]
    runner = make_runner(model_dir)
    handles = [runner.add_request() for _ in prompts]
    batch = ForwardBatch(handles, [len(p) for p in prompts], [0] * 3, 3, torch.tensor(sum(prompts, [])), [True] * 3)
    out = runner.forward(batch)
    for i, p in enumerate(prompts):
        assert_logits(f"{case} row {i}", out.logits[i], oracle.prefill_logits(p)[0, -1])


@pytest.mark.parametrize("chunk", [5, 16], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("case", ["qwen3_next-hv4", "qwen3_5-hv2", "kimi_linear"])
def test_chunked_prefill_equals_full_prefill(tiny, case, chunk):
    model_dir, oracle = tiny(case)
    ids = prompt(3, 37)
    runner = make_runner(model_dir)
    full = prefill(runner, runner.add_request(), ids)
    chunked = prefill(runner, runner.add_request(), ids, chunk=chunk)
    err = max_rel(chunked, full)
    assert err < 1e-5, f"{case} chunk={chunk} vs full prefill: max relative error {err:.3e}"
    assert_logits(f"{case} chunked vs transformers", chunked, oracle.prefill_logits(ids)[0, -1])


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_incremental_decode_matches_transformers_cache(tiny, case):
    model_dir, oracle = tiny(case)
    ids = prompt(4, 26)
    expected = oracle.decode_logits(ids, prefill_len=18)[0]
    runner = make_runner(model_dir)
    h = runner.add_request()
    assert_logits(f"{case} prefill", prefill(runner, h, ids[:18]), expected[17])
    for t in range(18, 26):
        assert_logits(f"{case} decode t={t}", decode(runner, h, ids[t]), expected[t])


@pytest.mark.parametrize("case", ["qwen3_next-hv2", "qwen3_5_moe-hv4", "kimi_linear"])
def test_mixed_prefill_and_decode_rows_in_one_step(tiny, case):
    """A new prompt's prefill row and two decode rows of other requests share a step."""
    model_dir, oracle = tiny(case)
    a, b, c = prompt(5, 11), prompt(6, 14), prompt(7, 9)
    runner = make_runner(model_dir)
    ha, hb, hc = (runner.add_request() for _ in range(3))
    prefill(runner, ha, a[:-1])
    prefill(runner, hb, b[:-1])
    batch = ForwardBatch(
        [hc, ha, hb], [len(c), 1, 1], [0, len(a) - 1, len(b) - 1], 1, torch.tensor(c + a[-1:] + b[-1:]), [True]
    )
    out = runner.forward(batch)
    runner.accept([ha, hb], [1, 1])
    assert_logits(f"{case} prefill row", out.logits[0], oracle.prefill_logits(c)[0, -1])
    assert_logits(f"{case} decode row a", out.logits[1], oracle.prefill_logits(a)[0, -1])
    assert_logits(f"{case} decode row b", out.logits[2], oracle.prefill_logits(b)[0, -1])
