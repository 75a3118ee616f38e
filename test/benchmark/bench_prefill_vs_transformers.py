"""Prefill speed of lightllm against a plain transformers forward of the same checkpoint.

    python test/benchmark/bench_prefill_vs_transformers.py [--model_dir DIR] [--modes replay,native] \\
        [--shapes 64x1024,16x4096,256x256,4x16384] [--max_num_batched_tokens N] [--result_file out.json]
    python test/benchmark/bench_prefill_vs_transformers.py --top_kernels 12   # where each side's GPU time goes
    python test/benchmark/bench_prefill_vs_transformers.py --tiny      # CPU smoke run of the whole path

lightllm: `LLM.generate(prompts, max_tokens=1)` over `requests` random prompts of `tokens` token ids each, submitted
at once (one engine per state mode, its start-up warm-up done before timing). transformers: one
`AutoModelForCausalLM` forward over the same `[requests, tokens]` ids with `logits_to_keep=1` (fla's chunk kernels
when fla is installed). Both run on the same checkpoint (default: the serving benchmark's random-weight one,
`bench_throughput --serving_model`), each shape timed after an untimed pass of the same shape, with fresh ids for
every pass so the prefix cache resumes nothing. Prints a tok/s table with the ratio lightllm / transformers; each
side also checks that its first token is the other's (greedy), so both computed the same model. Without CUDA the run
is skipped (exit 0) unless `--tiny` (the tiny demo model in fp32 on the CPU, transformers on its torch paths).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
from pathlib import Path

import torch

DEFAULT_SHAPES = "64x1024,16x4096,256x256,4x16384"
TINY_SHAPES = "3x16,1x40"


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'64x1024,16x4096' -> [(64, 1024), (16, 4096)] as (requests, tokens)."""
    shapes = []
    for part in text.split(","):
        requests, _, tokens = part.strip().partition("x")
        if not (requests.isdigit() and tokens.isdigit()) or int(requests) < 1 or int(tokens) < 2:
            raise ValueError(f"shape {part!r}: want REQUESTSxTOKENS with requests >= 1 and tokens >= 2")
        shapes.append((int(requests), int(tokens)))
    return shapes


def random_prompts(requests: int, tokens: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(1, vocab, (requests, tokens), generator=gen)


def _rate(tok_s: float) -> str:
    return f"{tok_s / 1e3:.1f}k" if tok_s >= 1e3 else f"{tok_s:.0f}"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class LightllmSide:
    """One engine (one state mode) whose `generate(max_tokens=1)` is timed."""

    def __init__(self, model_dir: str, device: str, mode: str, shapes, dtype: str | None, budget: int | None):
        from lightllm import LLM

        flags = dict(
            device=device,
            ssm_state_mode=mode,
            max_running_requests=max(r for r, _ in shapes),
            max_req_total_len=max(t for _, t in shapes) + 8,
        )
        if dtype:
            flags["data_type"] = dtype
        if budget:
            flags["max_num_batched_tokens"] = budget
        self.llm = LLM(model_dir, **flags)
        self.device = device

    def first_tokens(self, ids: torch.Tensor) -> tuple[list[int], float]:
        """Greedy first token of each prompt and the seconds `generate` took."""
        from lightllm import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        _sync(self.device)
        start = time.perf_counter()
        outs = self.llm.generate(ids.tolist(), params)
        _sync(self.device)
        return [o.outputs[0].token_ids[0] for o in outs], time.perf_counter() - start

    def close(self) -> None:
        self.llm.close()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class TransformersSide:
    """The checkpoint in transformers; on the CPU its linear-attention layers take their torch paths (fla's Triton
    kernels would run under the interpreter)."""

    def __init__(self, model_dir: str, device: str, dtype: torch.dtype):
        import transformers

        self.device = device
        with self._paths():
            self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        self.model.to(device).eval()

    def _paths(self):
        if self.device == "cuda":
            return contextlib.nullcontext()
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from unit_tests.helpers.hf_oracle import torch_paths

        return torch_paths()

    @torch.inference_mode()
    def first_tokens(self, ids: torch.Tensor) -> tuple[list[int], float]:
        ids = ids.to(self.device)
        _sync(self.device)
        start = time.perf_counter()
        with self._paths():
            logits = self.model(input_ids=ids, logits_to_keep=1).logits
        tokens = logits[:, -1].float().argmax(-1).tolist()
        _sync(self.device)
        return tokens, time.perf_counter() - start

    def close(self) -> None:
        del self.model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _timed(side, ids_untimed: torch.Tensor, ids: torch.Tensor) -> tuple[list[int], float]:
    side.first_tokens(ids_untimed)
    return side.first_tokens(ids)


def profile_kernels(side, ids: torch.Tensor, host_ids: torch.Tensor, top: int, label: str) -> None:
    """One more pass of `side` over `ids` under the CUDA profiler: its `top` kernels by GPU time, and how much of
    the pass's wall time the GPU spent in kernels (the rest is host time not hidden behind the GPU); then one pass
    over `host_ids` (fresh ids: the prefix cache must not resume them) under cProfile: the `top` Python functions
    by own time (a wait for the device shows as the call that syncs) and by cumulative time."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _, seconds = side.first_tokens(ids)
    events = sorted(prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)
    busy_us = sum(e.self_device_time_total for e in events)
    print(f"{label}: {seconds * 1e3:.1f} ms wall, {busy_us / 1e3:.1f} ms in kernels ({busy_us / 1e4 / seconds:.0f}%)")
    for e in events[:top]:
        print(f"  {e.self_device_time_total / 1e3:8.2f} ms {e.count:6d} calls  {e.key[:100]}")
    host = cProfile.Profile()
    host.enable()
    _, seconds = side.first_tokens(host_ids)
    host.disable()
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(host, stream=text).sort_stats(order).print_stats(top)
        lines = text.getvalue().splitlines()
        start = next(i for i, line in enumerate(lines) if "ncalls" in line)
        print(f"{label}, host (cProfile, {seconds * 1e3:.1f} ms wall; by {order}):")
        print("\n".join("  " + line[:170] for line in lines[start : start + top + 1]))


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model_dir", default=None, help="checkpoint (default: the serving benchmark's random weights)")
    p.add_argument("--modes", default="replay,native", help="comma-separated state modes")
    p.add_argument("--shapes", default=None, help=f"REQUESTSxTOKENS,... (default {DEFAULT_SHAPES})")
    p.add_argument("--max_num_batched_tokens", type=int, default=None, help="lightllm's step budget (default: auto)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result_file", default=None, help="write every row as JSON here")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run on the tiny demo model (fp32)")
    p.add_argument("--top_kernels", type=int, default=0, help="on CUDA, profile one more pass per side and shape")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    a = _parse(argv)
    if a.tiny:
        from lightllm.tools.make_tiny_model import tiny_model_dir

        device, dtype, model_dir = "cpu", torch.float32, a.model_dir or str(tiny_model_dir("qwen3_5"))
        shapes = parse_shapes(a.shapes or TINY_SHAPES)
    else:
        if not torch.cuda.is_available():
            print("skipped: no CUDA device (use --tiny for a CPU smoke run)")
            return []
        from lightllm.tools.bench_throughput import serving_model_dir

        device, dtype, model_dir = "cuda", torch.bfloat16, a.model_dir or serving_model_dir()
        shapes = parse_shapes(a.shapes or DEFAULT_SHAPES)
    modes = [m for m in a.modes.split(",") if m]
    vocab = json.loads((Path(model_dir) / "config.json").read_text())
    vocab = vocab.get("vocab_size") or vocab["text_config"]["vocab_size"]
    gen = torch.Generator().manual_seed(a.seed)
    # two fresh batches per shape (untimed, timed), shared by both sides so their tokens can be compared
    batches = {s: (random_prompts(*s, vocab, gen), random_prompts(*s, vocab, gen)) for s in shapes}
    rows = {s: {"requests": s[0], "tokens": s[1]} for s in shapes}

    hf = TransformersSide(model_dir, device, dtype)
    for shape, (warm, ids) in batches.items():
        tokens, seconds = _timed(hf, warm, ids)
        rows[shape].update(transformers_tok_s=ids.numel() / seconds, transformers_first_tokens=tokens)
        if a.top_kernels and device == "cuda":
            fresh = (random_prompts(*shape, vocab, gen) for _ in range(2))
            profile_kernels(hf, *fresh, a.top_kernels, f"transformers {shape}")
    hf.close()
    for mode in modes:
        side = LightllmSide(model_dir, device, mode, shapes, "float32" if a.tiny else None, a.max_num_batched_tokens)
        for shape, (warm, ids) in batches.items():
            tokens, seconds = _timed(side, warm, ids)
            rows[shape][f"{mode}_tok_s"] = ids.numel() / seconds
            rows[shape][f"{mode}_first_tokens"] = tokens
            if a.top_kernels and device == "cuda":
                fresh = (random_prompts(*shape, vocab, gen) for _ in range(2))
                profile_kernels(side, *fresh, a.top_kernels, f"lightllm {mode} {shape}")
        side.close()

    out = list(rows.values())
    header = " | ".join(f"lightllm {m}" for m in modes)
    print(
        f"| requests x tokens | {header} | transformers forward | {' | '.join(f'{m} / transformers' for m in modes)} "
        "| first tokens agree |"
    )
    print("|---" * (3 + 2 * len(modes)) + "|")
    for row in out:
        hf_tok_s = row["transformers_tok_s"]
        speeds = " | ".join(_rate(row[f"{m}_tok_s"]) for m in modes)
        ratios = " | ".join(f"{row[f'{m}_tok_s'] / hf_tok_s:.2f}" for m in modes)
        ref = row["transformers_first_tokens"]
        agree = min(sum(x == y for x, y in zip(row[f"{m}_first_tokens"], ref)) for m in modes)
        row["first_tokens_agree"] = agree
        print(
            f"| {row['requests']} x {row['tokens']} | {speeds} | {_rate(hf_tok_s)} | {ratios} "
            f"| {agree}/{row['requests']} |"
        )
    if a.result_file:
        Path(a.result_file).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
