"""The models with SwiGLU's activation (dense FFNs, MoE shared experts) and GDN's projection split through their
Triton kernels (their CUDA path, here under TRITON_INTERPRET=1) instead of their torch forms: prefill and decode
logits still match transformers on the tiny checkpoints of every architecture, and neither kernel meets a second
compile key between a prefill and a decode step; twins: gate and up swapped, or GDN's b and a swapped, break the
match."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import lightllm.models.layers.gdn as gdn
import lightllm.models.layers.mlp as mlp
from lightllm.kernels.silu_mul import silu_mul_triton
from lightllm.kernels.split_columns import split_columns_triton
from unit_tests.helpers.launch_keys import launch_keys
from unit_tests.models.conftest import ARCH_CASES
from unit_tests.models.drive import decode, make_runner, prefill
from unit_tests.models.kernel_parity import prefill_mismatch, route_through
from unit_tests.models.test_parity import MAX_REL, assert_logits, prompt


@pytest.fixture
def glue_kernels(monkeypatch) -> Counter:
    """Both layers call the kernels; the counter says how often each ran."""
    calls = Counter()
    route_through(monkeypatch, calls, mlp, "silu_mul", silu_mul_triton)
    route_through(monkeypatch, calls, gdn, "split_columns", split_columns_triton)
    return calls


@pytest.mark.parametrize("case", ARCH_CASES)
def test_prefill_and_decode_through_the_kernels_match_transformers(tiny, case, glue_kernels):
    model_dir, oracle = tiny(case)
    ids = prompt(7, 19)
    runner = make_runner(model_dir)
    handle = runner.add_request()
    with launch_keys() as keys:
        logits = prefill(runner, handle, ids[:-1])
        step = decode(runner, handle, ids[-1])
    assert_logits(f"{case} prefill", logits, oracle.prefill_logits(ids[:-1])[0, -1])
    assert_logits(f"{case} decode", step, oracle.prefill_logits(ids)[0, -1])
    # every architecture has a SwiGLU (dense layers or shared experts); Kimi's linear attention is KDA, not GDN
    assert glue_kernels["silu_mul"] > 0
    assert (glue_kernels["split_columns"] > 0) == (case != "kimi_linear")
    glue = {"silu_mul_kernel"} | ({"split_columns_kernel"} if case != "kimi_linear" else set())
    assert glue <= set(keys.by_kernel)
    assert not glue & set(keys.varying()), keys.varying()


def test_twin_gate_and_up_swapped_breaks_the_match(tiny, monkeypatch):
    model_dir, oracle = tiny("qwen3_5-hv2")
    monkeypatch.setattr(mlp, "silu_mul", lambda x: silu_mul_triton(torch.cat(x.chunk(2, dim=-1)[::-1], dim=-1)))
    assert prefill_mismatch(model_dir, oracle, 8, 15) > 10 * MAX_REL


def test_twin_b_and_a_swapped_breaks_the_match(tiny, monkeypatch):
    model_dir, oracle = tiny("qwen3_5-hv2")

    def swapped(x, sizes):
        parts = split_columns_triton(x, sizes)
        return parts[:2] + parts[2:][::-1] if len(parts) == 4 else parts

    monkeypatch.setattr(gdn, "split_columns", swapped)
    assert prefill_mismatch(model_dir, oracle, 8, 15) > 10 * MAX_REL
