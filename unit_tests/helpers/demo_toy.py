"""A toy-sized demo model trained once per test session (seconds on a CPU) by the real training entry point."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

# 8 layers of the real layout at hidden 64, a few files of text, fp32 weights so parity checks are exact
TOY_ARGS = (
    "--max_steps", "100", "--max_train_files", "8", "--hidden_size", "64", "--intermediate_size", "128",
    "--head_dim", "16", "--linear_key_head_dim", "16", "--vocab_size", "512", "--batch_size", "4", "--seq_len", "64",
    "--log_every", "10", "--eval_every", "20", "--eval_batches", "2", "--dtype", "float32",
    "--acceptance_prompts", "0", "--device", "cpu",
)  # fmt: skip


@functools.cache
def toy_demo_checkpoint() -> tuple[Path, dict]:
    """(checkpoint folder, training summary); removed when the session ends."""
    import torch

    from lightllm.tools.train_demo_model import parse_args, train

    out = Path(tempfile.mkdtemp(prefix="lightllm-demo-toy-"))
    atexit.register(shutil.rmtree, out, True)
    # training seeds the global generator; the tests around it keep theirs. One thread: tiny shapes gain nothing
    # from more, and on a busy machine spin-waiting workers slow them down many times over.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            return out, train(parse_args(["--out", str(out), *TOY_ARGS]))
    finally:
        torch.set_num_threads(threads)
