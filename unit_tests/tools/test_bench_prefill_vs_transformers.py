"""`test/benchmark/bench_prefill_vs_transformers.py --tiny` on the CPU: one row per shape with positive speeds on both
sides, and lightllm's greedy first token of every prompt equal to the argmax of transformers' `logits_to_keep=1`
logits on the same ids (the two sides computed the same model). Twin: transformers on the same prompts with their
last token changed disagrees with lightllm's tokens."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "test" / "benchmark" / "bench_prefill_vs_transformers.py"


def _script():
    spec = importlib.util.spec_from_file_location("bench_prefill_vs_transformers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_run_rows_agree_with_transformers(tmp_path):
    bench = _script()
    result = tmp_path / "rows.json"
    rows = bench.main(["--tiny", "--modes", "native", "--shapes", "3x12,1x20", "--result_file", str(result)])
    assert [(r["requests"], r["tokens"]) for r in rows] == [(3, 12), (1, 20)]
    for row in rows:
        assert math.isfinite(row["native_tok_s"]) and row["native_tok_s"] > 0
        assert math.isfinite(row["transformers_tok_s"]) and row["transformers_tok_s"] > 0
        assert row["native_first_tokens"] == row["transformers_first_tokens"]
        assert row["first_tokens_agree"] == row["requests"]
    assert json.loads(result.read_text()) == rows

    # the twin: the timed prompts of the first shape (the script's seeded draws: untimed, then timed), last token
    # changed, through transformers
    from lightllm.tools.make_tiny_model import tiny_model_dir

    model_dir = str(tiny_model_dir("qwen3_5"))
    config = json.loads((Path(model_dir) / "config.json").read_text())
    vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    bench.random_prompts(3, 12, vocab, gen)
    ids = bench.random_prompts(3, 12, vocab, gen)
    hf = bench.TransformersSide(model_dir, "cpu", torch.float32)
    same, _ = hf.first_tokens(ids)
    assert same == rows[0]["native_first_tokens"]
    ids[:, -1] = (ids[:, -1] + 1) % vocab
    broken, _ = hf.first_tokens(ids)
    assert broken != rows[0]["native_first_tokens"]


@pytest.mark.parametrize("text", ["64", "0x128", "4x1", "ax3"])
def test_bad_shape_is_refused(text):
    with pytest.raises(ValueError, match="REQUESTSxTOKENS"):
        _script().parse_shapes(text)
