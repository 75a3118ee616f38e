"""Train the demo model: a small Qwen3.5-layout model (GDN, GDN, GDN, gated attention, x2) with an MTP head and its
own byte-level BPE tokenizer, on the running Python's standard library source (see `demo_model/corpus.py`).

    python -m lightllm.tools.train_demo_model --out /tmp/demo            # minutes on one GPU
    python -m lightllm.tools.train_demo_model --out /tmp/demo --max_steps 20 --max_train_files 8 \\
        --hidden_size 64 --intermediate_size 128 --batch_size 4 --seq_len 64      # seconds on a CPU

The output folder is a complete checkpoint (config.json, generation_config.json, tokenizer files, model.safetensors)
plus `training.json` (arguments, text digests, losses, held-out MTP acceptance). Copy it to
`lightllm/tools/demo_model/weights/` to make it the server's default model. Fixed seed and data order: the same
arguments, Python minor version and device type give the same run (up to GPU kernel non-determinism).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

from lightllm.tools.demo_model.corpus import (
    EXTRA_PACKAGES,
    heldout_documents,
    manifest,
    package_documents,
    package_versions,
    training_documents,
)
from lightllm.tools.demo_model.data import Batches, token_stream
from lightllm.tools.demo_model.export import write_checkpoint_weights
from lightllm.tools.demo_model.model import ARCH, DEFAULT_SIZES, DemoModel, demo_config
from lightllm.tools.hf_torch_paths import torch_paths
from lightllm.tools.tiny_model.configs import generation_config
from lightllm.tools.tiny_model.sizes import TinySizes
from lightllm.tools.tiny_model.tokenizer import write_tokenizer

_MAX_POSITIONS = 262_144
_SIZE_FLAGS = ("hidden_size", "num_layers", "vocab_size", "intermediate_size", "head_dim", "linear_key_head_dim")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _log(msg: str) -> None:
    print(msg, flush=True)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def learning_rate(progress: float, peak: float, warmup: float) -> float:
    """Linear warm-up over the first `warmup` fraction, then cosine decay to 10% of `peak` at progress 1."""
    if progress < warmup:
        return peak * progress / warmup
    t = min(1.0, (progress - warmup) / max(1e-9, 1.0 - warmup))
    return peak * (0.1 + 0.45 * (1.0 + math.cos(math.pi * t)))


def _optimizer(model: DemoModel, lr: float, weight_decay: float, device: torch.device) -> torch.optim.Optimizer:
    # decay matrices only; norms, gates' A_log / dt_bias and the conv filters keep their scale
    params = {id(p): p for p in model.parameters()}.values()
    decay = [p for p in params if p.dim() == 2]
    rest = [p for p in params if p.dim() != 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def _kernels(device: torch.device, fla_kernels: bool):
    """transformers' pure-torch GDN and conv paths unless fla-core's kernels are asked for on CUDA: at this size a
    step is launch-bound either way, and fla autotunes its forward and backward kernels for minutes on a fresh
    machine (on a CPU they would run under Triton's interpreter)."""
    return contextlib.nullcontext() if device.type == "cuda" and fla_kernels else torch_paths()


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def heldout_loss(model: DemoModel, batches: list[torch.Tensor], device: torch.device) -> tuple[float, float]:
    model.eval()
    main = mtp = 0.0
    for ids in batches:
        with _autocast(device):
            _, m, d = model.loss(ids.to(device), 1.0)
        main, mtp = main + m.item(), mtp + d.item()
    model.train()
    return main / len(batches), mtp / len(batches)


def train(args: argparse.Namespace) -> dict:
    """Train and write the checkpoint into `args.out`; returns the summary written to training.json."""
    t_start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    sizes = TinySizes(**{**DEFAULT_SIZES, **{k: getattr(args, k) for k in _SIZE_FLAGS if getattr(args, k)}})
    packages = tuple(name for name in args.extra_packages.split(",") if name)
    docs = training_documents() + package_documents(packages)
    if args.max_train_files:
        docs = docs[: args.max_train_files]
    heldout = heldout_documents()
    config, train_ids, heldout_ids = _write_tokenizer_and_config(out, sizes, args.dtype, docs, heldout)
    _log(
        f"text: {len(docs)} training files -> {train_ids.numel()} tokens, {len(heldout)} held-out files -> "
        f"{heldout_ids.numel()} tokens (vocab {sizes.vocab_size}); {time.time() - t_start:.1f}s"
    )

    model = DemoModel(config)
    model.init_weights(args.seed)
    model.to(device).train()
    num_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    _log(f"model: {num_params / 1e6:.2f}M parameters, layers {config['text_config']['layer_types']}, MTP 1")
    with _kernels(device, args.fla_kernels):
        history = _train_loop(model, args, device, train_ids, _eval_batches(heldout_ids, args))

    weights_bytes = write_checkpoint_weights(model.cpu(), out, _DTYPES[args.dtype], args.seed)
    _log(f"wrote {out} (model.safetensors {weights_bytes / 2**20:.2f} MiB) after {time.time() - t_start:.0f}s")
    steps = history[-1]["step"]
    summary = {
        # the output folder is the caller's own path, not a property of the run
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "python": platform.python_version(),
        "torch": torch.__version__,
        "steps": steps,
        "stopped_by": "steps" if steps >= args.max_steps else "time_budget_s",
        "num_parameters": num_params,
        "weights_bytes": weights_bytes,
        "training_text": manifest(docs),
        "training_packages": package_versions(packages),
        "heldout_text": manifest(heldout),
        "history": history,
        "train_and_export_s": time.time() - t_start,
    }
    _write_json(out / "training.json", summary)
    if args.acceptance_prompts:
        summary["acceptance"] = _acceptance(out, args)
        _write_json(out / "training.json", summary)
    return summary


def _write_tokenizer_and_config(out: Path, sizes: TinySizes, dtype: str, docs, heldout):
    """Train the BPE on `docs` and write it with config.json and generation_config.json; returns the config and the
    training and held-out token streams."""
    from tokenizers import Tokenizer

    ids = write_tokenizer(ARCH, sizes.vocab_size, _MAX_POSITIONS, out, corpus=(d.text for d in docs))
    config = demo_config(sizes, dtype, ids)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation_config(ARCH, ids))
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    return config, token_stream(tokenizer, docs), token_stream(tokenizer, heldout)


def _train_loop(
    model: DemoModel, args: argparse.Namespace, device: torch.device, train_ids: torch.Tensor, eval_batches
) -> list[dict]:
    """Steps until `max_steps` (or `time_budget_s`) is reached; returns the logged rows."""
    opt = _optimizer(model, args.lr, args.weight_decay, device)
    batches = Batches(train_ids, args.batch_size, args.seq_len, args.seed)
    history: list[dict] = []
    step, progress, t_train = 0, 0.0, time.time()
    while progress < 1.0:
        lr = learning_rate(max(progress, (step + 1) / args.max_steps), args.lr, args.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        ids = batches.next().to(device, non_blocking=True)
        with _autocast(device):
            loss, main, mtp = model.loss(ids, args.mtp_weight, args.mtp_distill)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        elapsed = time.time() - t_train
        progress = step / args.max_steps
        if args.time_budget_s:
            progress = max(progress, elapsed / args.time_budget_s)
        if step % args.log_every == 0 or step == 1 or progress >= 1.0:
            row = {"step": step, "loss": main.item(), "mtp_loss": mtp.item(), "lr": lr, "elapsed_s": elapsed}
            if step % args.eval_every == 0 or progress >= 1.0:
                row["heldout_loss"], row["heldout_mtp_loss"] = heldout_loss(model, eval_batches, device)
            history.append(row)
            _log_row(row, step * args.batch_size * args.seq_len / max(elapsed, 1e-9))
    return history


def _log_row(row: dict, tokens_per_s: float) -> None:
    held = f" heldout {row['heldout_loss']:.3f} / {row['heldout_mtp_loss']:.3f}" if "heldout_loss" in row else ""
    _log(
        f"step {row['step']:5d} loss {row['loss']:.3f} mtp {row['mtp_loss']:.3f} lr {row['lr']:.2e}{held} "
        f"| {row['elapsed_s']:.0f}s, {tokens_per_s / 1e3:.0f}k tok/s"
    )


def _eval_batches(stream: torch.Tensor, args: argparse.Namespace) -> list[torch.Tensor]:
    seq_len = min(args.seq_len, stream.numel() - 1)
    held = Batches(stream, args.batch_size, seq_len, args.seed + 1)
    return [held.next() for _ in range(args.eval_batches)]


def _acceptance(out: Path, args: argparse.Namespace) -> dict:
    from dataclasses import asdict

    from lightllm.tools.measure_acceptance import default_data_type, measure_acceptance

    t = time.time()
    data_type = default_data_type(args.acceptance_device)
    counts = measure_acceptance(
        str(out),
        mtp_step=2,
        num_prompts=args.acceptance_prompts,
        max_new_tokens=args.acceptance_tokens,
        device=args.acceptance_device,
        data_type=data_type,
    )
    _log(f"held-out MTP acceptance ({args.acceptance_device}, {data_type}, greedy), {time.time() - t:.0f}s:")
    _log(counts.table())
    return {**asdict(counts), "mean_accepted_length": counts.mean_accepted_length}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lightllm.tools.train_demo_model", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output checkpoint folder (created if missing)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max_steps", type=int, default=2000)
    p.add_argument(
        "--time_budget_s", type=float, default=0.0, help="also end (and decay the learning rate) by this training time"
    )
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=float, default=0.03, help="warm-up fraction of training")
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--mtp_weight", type=float, default=1.0, help="weight of the MTP head's loss")
    p.add_argument(
        "--mtp_distill",
        type=float,
        default=1.0,
        help="weight of the MTP head's loss against the main model's own next-token distribution",
    )
    p.add_argument(
        "--extra_packages",
        default=",".join(EXTRA_PACKAGES),
        help="comma-separated installed packages whose source joins the standard library's as training text",
    )
    p.add_argument("--dtype", default="bfloat16", choices=tuple(_DTYPES), help="dtype of the saved weights")
    p.add_argument("--max_train_files", type=int, default=0, help="train on the first N files only (quick checks)")
    p.add_argument("--log_every", type=int, default=50)
    p.add_argument("--eval_every", type=int, default=250)
    p.add_argument("--eval_batches", type=int, default=4)
    p.add_argument(
        "--fla_kernels", action="store_true", help="fla-core's Triton GDN kernels on CUDA (autotuned on first use)"
    )
    p.add_argument("--acceptance_prompts", type=int, default=8, help="held-out prompts for the final MTP check")
    p.add_argument("--acceptance_tokens", type=int, default=128)
    p.add_argument("--acceptance_device", default="cpu")
    for name in _SIZE_FLAGS:
        p.add_argument(f"--{name}", type=int, default=0, help=f"default {DEFAULT_SIZES[name]}")
    args = p.parse_args(argv)
    if args.max_steps < 1 or args.batch_size < 1 or args.seq_len < 8:
        p.error("need --max_steps >= 1, --batch_size >= 1 and --seq_len >= 8")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    _log(f"train_demo_model on {args.device}, python {sys.version.split()[0]}, torch {torch.__version__}")
    summary = train(args)
    acc = summary.get("acceptance")
    if acc:
        _log(f"mean accepted length at MTP 2 on held-out text: {acc['mean_accepted_length']:.3f}")


if __name__ == "__main__":
    main()
