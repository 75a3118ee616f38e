"""`test/benchmark/bench_grammar_masks.py` at tiny size: both vocabularies are built (the trained BPE encodes text
back to itself), every part of a step is timed, and the run completes only if the template copies' masks equal the
per-row compiles' at every step (the script raises otherwise)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import tiktoken

from lightllm.server.tiktoken_tokenizer import KIMI_PATTERN
from unit_tests.server.live_server import single_threaded_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "test" / "benchmark" / "bench_grammar_masks.py"
sys.path.insert(0, str(SCRIPT.parent))


def test_trained_ranks_are_a_byte_level_bpe():
    from bench_grammar_masks import trained_ranks

    ranks = trained_ranks(600)
    assert len(ranks) == 600 and sorted(ranks.values()) == list(range(600))
    assert all(ranks[bytes([b])] == b for b in range(256))
    # learned merges of Python source: common keywords became single tokens
    assert b"def" in ranks or b" def" in ranks
    enc = tiktoken.Encoding("t", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens={})
    text = "def f(x):\n    return x + 1  # é"
    ids = enc.encode(text)
    assert enc.decode(ids) == text and len(ids) < len(text.encode())


def test_every_part_is_timed():
    cmd = [sys.executable, str(SCRIPT), "--rows", "3", "--steps", "4", "--vocab_size", "600", "--threads", "1"]
    run = subprocess.run(cmd, cwd=ROOT, env=single_threaded_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    assert "generated: 600 tokens" in out and "trained: 600 tokens" in out
    for part in ("llguidance 1 thr, copied", "llguidance 1 thr, compiled", "mask_windows", "fused torch"):
        row = re.search(rf"^{re.escape(part)}: median ms\s+([\d.]+)\s+([\d.]+)$", out, re.M)
        assert row and float(row[1]) > 0 and float(row[2]) > 0, part
