"""The trained demo model: its training text, tokenizer, model, export (`train_demo_model.py` drives them) and the
checkpoint shipped in `weights/`, which the server serves when no --model_dir is given."""

from __future__ import annotations

from pathlib import Path

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
# one name whichever checkpoint is served, so clients written against the demo keep working
SERVED_NAME = "tiny-qwen3_5"
CHECKPOINT_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json")


def trained_model_dir(weights_dir: Path | None = None) -> Path | None:
    """`weights_dir` (default `WEIGHTS_DIR`) if it holds a complete trained checkpoint, else None."""
    weights_dir = WEIGHTS_DIR if weights_dir is None else weights_dir
    if all((weights_dir / name).is_file() for name in CHECKPOINT_FILES):
        return weights_dir
    return None
