"""Host cost of grammar masks per decode step, without a model: `--rows` matchers of a JSON schema over a vocabulary
of `--vocab_size` tokens, each advanced at every step by a random token its mask allows (what greedy decoding of a
random-weight model under a grammar amounts to), fresh matchers for `--steps` steps like one run of
`bench_structured_output.py`.

    python test/benchmark/bench_grammar_masks.py [--rows 64] [--steps 256] [--vocab_size 31000] \
        [--vocabs generated,trained] [--schema records|digits] [--threads 1,2] [--device cpu|cuda] [--no_slices]

Vocabularies: `generated` is `lightllm.tools.synthetic_vocab`'s (what `--synthetic_vocab N` serves), `trained` a
byte-level BPE of the same size trained with `tokenizers` on the Python standard library's source (the demo
model's corpus); both go through llguidance's tiktoken loader with the serving tokenizer's split pattern.

Per step and vocabulary it times, on the same matcher states: llguidance's executor filling the masks with each
`--threads` count (the CPU time / wall time of the largest says whether the pool runs in parallel), the torch work
around it in two forms — `unfused` (a fresh [rows, words] bitmask, pinned on CUDA; unpacked to bool [rows, V] on
the device; index_select / masked_fill / index_copy of the logits) and `fused` (the engine's: a reused host
bitmask and one `apply_token_bitmask` pass) — the engine's whole `grammar.mask_windows`, and consuming the tokens.
Host times only (as the engine's step sees them); on CUDA the device is synchronized between parts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_structured_output import SCHEMAS  # noqa: E402

from lightllm.engine import grammar as grammar_module  # noqa: E402
from lightllm.engine import grammar_masks  # noqa: E402
from lightllm.engine.grammar import GrammarBackend, HostBitmasks, RequestGrammar  # noqa: E402
from lightllm.kernels.token_bitmask import apply_token_bitmask, unpack_bitmask  # noqa: E402
from lightllm.server.engine_process import GIL_SWITCH_S, quiet_host_threads  # noqa: E402
from lightllm.server.http.structured import json_schema_grammar  # noqa: E402
from lightllm.server.tiktoken_tokenizer import KIMI_PATTERN  # noqa: E402
from lightllm.tools.synthetic_vocab import synthetic_ranks  # noqa: E402


def trained_ranks(num_tokens: int) -> dict[bytes, int]:
    """A byte-level BPE of `num_tokens` tokens trained on the standard library's source: token bytes -> rank, the
    256 bytes first, then merges in the order they were learned (tiktoken's encoding merges by rank)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from lightllm.tools.demo_model.corpus import training_documents

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=num_tokens, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator((d.text for d in training_documents()), trainer=trainer)
    # GPT-2's printable stand-ins for bytes, read back from the pre-tokenizer's alphabet
    printable = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
    stand_in = {chr(b): b for b in printable}
    stand_in.update({chr(256 + i): b for i, b in enumerate(b for b in range(256) if b not in printable)})
    ranks = {bytes([b]): b for b in range(256)}
    for piece, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]):
        ranks.setdefault(bytes(stand_in[c] for c in piece), len(ranks))
    return ranks


def lltokenizer(ranks: dict[bytes, int], slices: list[str] | None = None):
    """llguidance's tokenizer of `ranks` (EOS right after them), as the server's tiktoken loader builds it
    (`slices`: llguidance's slicer configuration, None for its default, [] for none)."""
    import llguidance.tiktoken
    import tiktoken

    eos = len(ranks)
    encoding = tiktoken.Encoding("bench", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens={"<eos>": eos})
    tok = llguidance.tiktoken.lltokenizer_from_encoding(encoding, n_vocab=eos + 1, eos_token=[eos], slices=slices)
    return tok, eos + 1


def unfused_apply(bitmask_src: torch.Tensor, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The mask applied with generic torch ops: a fresh bitmask of the constrained rows (pinned on CUDA), unpacked
    to bool [rows, V] on the device, the rows gathered, filled and scattered back."""
    pinned = logits.is_cuda
    bitmask = torch.full(bitmask_src.shape, -1, dtype=torch.int32, pin_memory=pinned)
    bitmask.copy_(bitmask_src)  # stands in for the executor writing it
    allowed = unpack_bitmask(bitmask.to(logits.device, non_blocking=True), logits.shape[1])
    index = torch.tensor(rows, dtype=torch.long)
    index = (index.pin_memory() if pinned else index).to(logits.device, non_blocking=True)
    masked = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy(0, index, masked)


def fused_apply(buffers: HostBitmasks, bitmask_src: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The engine's form: a reused host bitmask and one pass over the logits."""
    bitmask, entry = buffers.take(*bitmask_src.shape, logits.is_cuda)
    bitmask.copy_(bitmask_src)  # stands in for the executor writing it
    return apply_token_bitmask(logits, buffers.to_device(bitmask, entry, logits.device))


class Timer:
    def __init__(self, device: torch.device):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.samples: dict[str, list[float]] = {}
        self.cpu: dict[str, list[float]] = {}

    def __call__(self, name: str, fn):
        self.sync()
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn()
        wall = time.perf_counter() - t0
        self.samples.setdefault(name, []).append(wall)
        self.cpu.setdefault(name, []).append(time.process_time() - c0)
        self.sync()
        return out


def _matcher_sets(tok, vocab: int, opts, timer: Timer | None = None) -> dict[str, list]:
    """The rows' matchers twice: the engine's (`GrammarBackend.matcher`: each row compiles its own, in the
    background once the grammar is known) and deep copies of one compiled matcher (which share its lexer's lock);
    with a `timer`, how long giving the rows their matchers takes the step each way (the grammar compiled once
    beforehand, as a server that has seen it)."""
    from llguidance import LLMatcher

    grammar = json_schema_grammar(SCHEMAS[opts.schema])
    backend = GrammarBackend(vocab, lambda *_: tok)
    template = backend.matcher(grammar, None, "bench", [vocab - 1]).matcher
    timer = timer or Timer(torch.device("cpu"))
    compiled = timer("admit rows: the engine's", lambda: [
        backend.matcher(grammar, None, "bench", [vocab - 1]) for _ in range(opts.rows)])  # fmt: skip
    copied = timer("admit rows: copies of one", lambda: [template.deep_copy() for _ in range(opts.rows)])
    assert all(isinstance(m, LLMatcher) for m in copied)
    return {"compiled": [g.matcher for g in compiled], "copied": copied}


def _trajectory(sets: dict[str, list], vocab: int, opts, step) -> None:
    """Drive every set of matchers for `--steps` steps: `step(name, matchers)` computes a set's masks (int32
    [rows, words], host); every set must get the same masks, and each row's next token is drawn from them."""
    rng = np.random.default_rng(opts.seed)
    for i in range(opts.steps):
        # alternate which set goes first: a set timed right after another must not always pay for its cache misses
        names = list(sets)[:: 1 if i % 2 else -1]
        masks = {name: step(name, sets[name]).clone() for name in names}
        first = masks[names[0]]
        if any(not torch.equal(first, m) for m in masks.values()):
            raise RuntimeError(f"step {i}: the sets' masks differ")
        bits = np.unpackbits(first.numpy().view(np.uint8), axis=1, count=vocab, bitorder="little")
        tokens = [int(rng.choice(np.flatnonzero(row))) for row in bits]
        for matchers in sets.values():
            if not all(m.consume_token(t) for m, t in zip(matchers, tokens)):
                raise RuntimeError("a token its mask allowed was refused")


def run_vocab(ranks: dict[bytes, int], opts) -> dict[str, float]:
    """For each executor size a trajectory of both matcher sets, interleaved step by step (a mask computed twice
    for one state is cached by its matcher, so each set computes its own); then the engine's `mask_windows` with
    the largest size on the engine's (compiled) set, its llguidance part timed inside, and the torch parts alone."""
    from llguidance import LLExecutor

    tok, vocab = lltokenizer(ranks, [] if opts.no_slices else None)
    words = (vocab + 31) // 32
    device = torch.device(opts.device)
    logits = torch.randn(opts.rows, vocab, device=device)
    timer = Timer(device)
    bitmask = torch.empty((opts.rows, words), dtype=torch.int32)
    for n in opts.threads:
        pool = LLExecutor(n)

        def fill(name, matchers, pool=pool, n=n):
            bitmask.fill_(-1)
            plain = [(m, i) for i, m in enumerate(matchers)]
            timer(f"llguidance {n} thr, {name}", lambda: pool.unsafe_compute_mask_ptr(
                plain, bitmask.data_ptr(), words * 4, opts.rows))  # fmt: skip
            return bitmask

        _trajectory(_matcher_sets(tok, vocab, opts, timer), vocab, opts, fill)
    served_masks, served_pool, reused = HostBitmasks(), LLExecutor(max(opts.threads)), HostBitmasks()
    inner_fill = grammar_masks.fill_parallel

    def timed_fill(*args):
        # no device sync here: inside mask_windows, as the engine runs it
        c0, t0 = time.process_time(), time.perf_counter()
        inner_fill(*args)
        timer.samples.setdefault("  of which llguidance", []).append(time.perf_counter() - t0)
        timer.cpu.setdefault("  of which llguidance", []).append(time.process_time() - c0)

    def served(_, matchers):
        windows = [(SimpleNamespace(grammar=RequestGrammar(m, None, served_pool, served_masks)), i, 1, [])
                   for i, m in enumerate(matchers)]  # fmt: skip
        grammar_masks.fill_parallel = timed_fill
        try:
            timer("mask_windows", lambda: grammar_module.mask_windows(windows, logits))
        finally:
            grammar_masks.fill_parallel = inner_fill
        filled = served_masks.last[: opts.rows]
        timer("unfused torch", lambda: unfused_apply(filled, logits, list(range(opts.rows))))
        timer("fused torch", lambda: fused_apply(reused, filled, logits))
        return filled

    _trajectory({"compiled": _matcher_sets(tok, vocab, opts)["compiled"]}, vocab, opts, served)
    result = {}
    for part, samples in timer.samples.items():
        result[f"{part}: mean ms"] = statistics.mean(samples) * 1000
        result[f"{part}: median ms"] = statistics.median(samples) * 1000
        result[f"{part}: cpu ms"] = statistics.mean(timer.cpu[part]) * 1000
    total, inside = result["mask_windows: median ms"], result["  of which llguidance: median ms"]
    result["mask_windows outside llguidance %"] = 100 * (total - inside) / total
    return result


def host_cpus() -> str:
    """What the pool can use: the machine's CPUs, those this process may run on, and the cgroup's CPU quota."""
    try:
        quota = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        quota = "none" if quota[0] == "max" else f"{int(quota[0]) / int(quota[1]):.1f} CPUs"
    except (OSError, ValueError, IndexError):
        quota = "unknown"
    return f"{os.cpu_count()} CPUs, {len(os.sched_getaffinity(0))} usable, cgroup quota {quota}"


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--vocab_size", type=int, default=31000)
    p.add_argument("--vocabs", default="generated,trained")
    p.add_argument("--schema", default="records", choices=sorted(SCHEMAS))
    p.add_argument("--threads", default="1,2", help="llguidance executor thread counts, comma-separated")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no_slices", action="store_true", help="llguidance's tokenizer without its slicer")
    opts = p.parse_args(argv)
    opts.threads = [int(n) for n in opts.threads.split(",")]
    return opts


def main(argv=None) -> dict:
    opts = _parse(argv)
    if opts.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: skipped (the default --device cpu times the host parts alone)")
        return {}
    # the engine's torch threads on this device and its GIL switch interval
    quiet_host_threads(opts.device)
    sys.setswitchinterval(GIL_SWITCH_S)
    builders = {"generated": synthetic_ranks, "trained": trained_ranks}
    results = {}
    for name in opts.vocabs.split(","):
        t0 = time.perf_counter()
        ranks = builders[name](opts.vocab_size)
        build_s = time.perf_counter() - t0
        results[name] = run_vocab(ranks, opts)
        print(f"{name}: {len(ranks)} tokens (built in {build_s:.1f} s)", flush=True)
    print(f"rows {opts.rows}, steps {opts.steps}, schema {opts.schema}, slices {not opts.no_slices}, device "
          f"{opts.device}, torch threads "
          f"{torch.get_num_threads()}, {host_cpus()}; host time per step (cpu: the process's CPU time, every "
          "thread)")  # fmt: skip
    names = list(results)
    print(f"{'':<44}" + "".join(f"{n:>12}" for n in names))
    for key in results[names[0]]:
        print(f"{key:<44}" + "".join(f"{results[n][key]:>12.2f}" for n in names))
    return results


if __name__ == "__main__":
    main()
