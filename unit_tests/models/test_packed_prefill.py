"""Packed prefill steps: several prompts' chunks in one step (first chunks, chunks resuming a cached prefix, a whole
prompt) give every position the logits of the same chunks run row by row and of transformers' forward over the
whole prompt, and the last token's hidden state of transformers; with the torch attention path and the Triton
kernel (interpreted). Short rows share one attention group (`prefill_group_spans`, exact spans tested)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightllm.engine.batch import ForwardBatch
from lightllm.models.context import prefill_group_spans
from lightllm.models.layers.attention import GatedAttention
from lightllm.models.layers.mla import LatentAttention
from unit_tests.models.conftest import ARCH_CASES
from unit_tests.models.drive import make_runner
from unit_tests.models.test_parity import assert_logits, max_rel, prompt

LENGTHS = (9, 23, 16, 7)
# the two steps as (prompt, start, end) chunks: first chunks and a whole prompt, then resumed chunks and a new prompt
STEPS = (((0, 0, 4), (1, 0, 10), (2, 0, 16)), ((0, 4, 9), (1, 10, 23), (3, 0, 7)))


def _runner(model_dir: str, backend: str):
    runner = make_runner(model_dir)
    for module in runner.model.modules():
        if isinstance(module, (GatedAttention, LatentAttention)):
            module.attention_backend = backend
    return runner


def _run_steps(runner, prompts: list[list[int]], steps) -> tuple[list[list[torch.Tensor]], dict[int, torch.Tensor]]:
    """Run `steps` (each a list of chunks forming one step); returns every prompt's per-position logits (one tensor
    per chunk) and the final hidden state of each prompt's last token."""
    handles = {}
    logits = [[] for _ in prompts]
    hidden = {}
    for chunks in steps:
        for p, start, _ in chunks:
            if start == 0:
                handles[p] = runner.add_request()
        ids = torch.tensor([t for p, a, b in chunks for t in prompts[p][a:b]])
        last = [b == len(prompts[p]) for p, _, b in chunks]
        batch = ForwardBatch(
            [handles[p] for p, _, _ in chunks],
            [b - a for _, a, b in chunks],
            [a for _, a, _ in chunks],
            len(chunks),
            ids,
            last,
            [True] * len(chunks),
        )
        out = runner.forward(batch)
        for i, (p, _, _) in enumerate(chunks):
            logits[p].append(out.prompt_logits[out.prompt_logits_offsets[i] : out.prompt_logits_offsets[i + 1]])
        ends = [p for (p, _, _), is_last in zip(chunks, last) if is_last]
        for row, p in enumerate(ends):
            hidden[p] = out.hidden[row]
    return logits, hidden


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", ARCH_CASES)
def test_packed_chunks_equal_row_by_row_and_transformers(tiny, case, backend):
    model_dir, oracle = tiny(case)
    prompts = [prompt(40 + i, n) for i, n in enumerate(LENGTHS)]
    packed, packed_hidden = _run_steps(_runner(model_dir, backend), prompts, STEPS)
    # row by row: the same chunks, one row per step
    alone, _ = _run_steps(_runner(model_dir, backend), prompts, [[c] for chunks in STEPS for c in chunks])
    for p, ids in enumerate(prompts):
        got, row_by_row = torch.cat(packed[p]), torch.cat(alone[p])
        err = max_rel(got, row_by_row)
        assert err < 1e-5, f"{case} {backend} prompt {p}: packed vs row by row, max relative error {err:.3e}"
        assert_logits(f"{case} {backend} prompt {p} vs transformers", got, oracle.prefill_logits(ids)[0])
        assert_logits(f"{case} {backend} prompt {p} hidden", packed_hidden[p], oracle.hidden_states(ids)[0, -1])

    # the twin: one token of prompt 1's resumed chunk changed in the packed step; its later positions no longer
    # match transformers on the prompt
    broken = [list(p) for p in prompts]
    broken[1][12] = (broken[1][12] + 1) % 470
    changed, _ = _run_steps(_runner(model_dir, backend), broken, STEPS)
    assert max_rel(torch.cat(changed[1])[12:], oracle.prefill_logits(prompts[1])[0, 12:]) > 1e-3


def test_prefill_group_spans():
    lens = np.array([10, 20, 30000, 40000, 5, 5])
    assert prefill_group_spans(lens, 65536) == [(0, 2), (2, 3), (3, 4), (4, 6)]
    assert prefill_group_spans(np.array([256] * 8), 2048) == [(0, 8)]
    assert prefill_group_spans(np.array([256] * 9), 2048) == [(0, 8), (8, 9)]
    assert prefill_group_spans(np.array([], dtype=np.int64), 2048) == []
