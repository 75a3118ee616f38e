"""Per-position MTP acceptance of a checkpoint with greedy decoding on held-out text.

    python -m lightllm.tools.measure_acceptance [--model_dir DIR] [--mtp_step 2] [--device cpu|cuda]

Prompts are windows of the demo model's held-out standard-library modules (never trained on), tokenized with the
checkpoint's own tokenizer. Each prompt is decoded greedily the way the engine does with MTP: draft `mtp_step`
tokens from the last accepted token, verify the window `[last, drafts...]` in one forward, keep the drafts that
equal the verify argmax plus one bonus token. Windows are counted like the engine's stats (a window without drafts,
at the length limit, is not counted); mean accepted length = tokens a counted window yields = 1 + accepted drafts.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from lightllm.engine.batch import ForwardBatch
from lightllm.server.model_info import read_model_info
from lightllm.server.tokenizer import checkpoint_tokenizer, eos_token_ids
from lightllm.tools.demo_model.corpus import heldout_documents
from lightllm.tools.demo_model.data import examples
from lightllm.worker.config import RunnerConfig
from lightllm.worker.runner import ModelRunner


@dataclass
class AcceptanceCounts:
    """Counts over every verify window that carried drafts (position i = the i-th draft, 0-based)."""

    mtp_step: int
    num_prompts: int = 0
    num_generated_tokens: int = 0
    num_windows: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    # windows in which position i was proposed / proposed with every earlier draft accepted / accepted
    proposed_at: list[int] = field(default_factory=list)
    reached_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    # accepted_length_counts[k]: windows that yielded k + 1 tokens (the engine's histogram)
    accepted_length_counts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("proposed_at", "reached_at", "accepted_at"):
            getattr(self, name).extend([0] * (self.mtp_step - len(getattr(self, name))))
        self.accepted_length_counts.extend([0] * (self.mtp_step + 1 - len(self.accepted_length_counts)))

    def record(self, num_drafts: int, num_accepted_drafts: int) -> None:
        if not num_drafts:
            return
        self.num_windows += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_draft_tokens += num_accepted_drafts
        self.accepted_length_counts[num_accepted_drafts] += 1
        for i in range(num_drafts):
            self.proposed_at[i] += 1
            self.reached_at[i] += i <= num_accepted_drafts
            self.accepted_at[i] += i < num_accepted_drafts

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.num_accepted_draft_tokens / max(1, self.num_windows)

    def rate_at(self, i: int) -> float:
        """Fraction of windows reaching position i (all earlier drafts accepted) that accept it."""
        return self.accepted_at[i] / max(1, self.reached_at[i])

    def table(self) -> str:
        lines = [
            f"prompts {self.num_prompts}, generated tokens {self.num_generated_tokens}, "
            f"verify windows with drafts {self.num_windows}",
            "| draft position | proposed | reached | accepted | accepted / reached | accepted / windows |",
            "|---|---|---|---|---|---|",
        ]
        for i in range(self.mtp_step):
            lines.append(
                f"| {i + 1} | {self.proposed_at[i]} | {self.reached_at[i]} | {self.accepted_at[i]} | "
                f"{self.rate_at(i):.3f} | {self.accepted_at[i] / max(1, self.num_windows):.3f} |"
            )
        lines.append(f"mean accepted length at MTP {self.mtp_step}: {self.mean_accepted_length:.3f}")
        return "\n".join(lines)


def heldout_prompts(tokenizer, num_prompts: int, prompt_len: int) -> list[list[int]]:
    """`num_prompts` windows of `prompt_len` tokens at evenly spaced offsets of the held-out text."""
    ids: list[int] = []
    for enc in tokenizer.encode_batch(list(examples(heldout_documents())), add_special_tokens=False):
        ids.extend(enc.ids)
    span = len(ids) - prompt_len
    if span < num_prompts:
        raise ValueError(f"held-out text has {len(ids)} tokens, too few for {num_prompts} x {prompt_len}")
    return [ids[k * span // num_prompts : k * span // num_prompts + prompt_len] for k in range(num_prompts)]


def _forward_logits(runner: ModelRunner, handle: int, ids: list[int], is_prefill: bool) -> torch.Tensor:
    start = runner.num_tokens(handle)
    batch = ForwardBatch([handle], [len(ids)], [start], int(is_prefill), torch.tensor(ids), [True] * is_prefill)
    return runner.forward(batch).logits


@torch.no_grad()
def decode_with_mtp(
    runner: ModelRunner, prompt: list[int], max_new_tokens: int, mtp_step: int, stop_ids: set[int], counts
) -> list[int]:
    """Greedy MTP decode of one prompt; records each window into `counts` and returns the generated ids."""
    handle = runner.add_request()
    try:
        out = [int(_forward_logits(runner, handle, prompt, True)[-1].argmax())]
        while len(out) < max_new_tokens and out[-1] not in stop_ids:
            drafts = runner.draft([handle], torch.tensor([out[-1]]), mtp_step)[0].tolist()
            # never draft past the token allowance (the engine's rule)
            drafts = drafts[: max(0, min(mtp_step, max_new_tokens - len(out) - 1))]
            argmax = _forward_logits(runner, handle, [out[-1], *drafts], False).argmax(-1).tolist()
            k = 0
            while k < len(drafts) and drafts[k] == argmax[k]:
                k += 1
            runner.accept([handle], [k + 1])
            counts.record(len(drafts), k)
            for token in [*drafts[:k], argmax[k]]:
                out.append(token)
                if token in stop_ids or len(out) >= max_new_tokens:
                    break
        counts.num_prompts += 1
        counts.num_generated_tokens += len(out)
        return out
    finally:
        runner.free_request(handle)


def default_data_type(device: str) -> str:
    """float32 on the CPU (no fast bf16 matmuls there), bfloat16 on a GPU."""
    return "float32" if device == "cpu" else "bfloat16"


def make_runner(model_dir: str, device: str, data_type: str, mtp_step: int, max_len: int) -> ModelRunner:
    return ModelRunner(
        RunnerConfig(
            model_dir=model_dir,
            device=device,
            data_type=data_type,
            mtp_step=mtp_step,
            max_running_requests=1,
            max_total_token_num=max_len + 16,
            max_req_total_len=max_len + 16,
            disable_prefix_cache=True,
            # one request at a time: capturing graphs for every batch bucket would cost more than the whole count
            disable_cudagraph=True,
        )
    )


def stop_ids(model_dir: str) -> set[int]:
    """The ids that end a sequence, by the server's rule (configs, generation config and tokenizer), so the
    windows counted here are the ones a served request would run."""
    return set(eos_token_ids(read_model_info(model_dir), checkpoint_tokenizer(model_dir).eos_token_id))


def measure_acceptance(
    model_dir: str,
    mtp_step: int = 2,
    num_prompts: int = 8,
    prompt_len: int = 64,
    max_new_tokens: int = 128,
    device: str = "cpu",
    data_type: str = "float32",
    prompts: list[list[int]] | None = None,
) -> AcceptanceCounts:
    """Acceptance counts of `model_dir` over held-out prompts (or the given token-id `prompts`)."""
    if mtp_step < 1:
        raise ValueError(f"mtp_step must be >= 1, got {mtp_step}")
    if prompts is None:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        prompts = heldout_prompts(tokenizer, num_prompts, prompt_len)
    max_len = max(len(p) for p in prompts) + max_new_tokens + mtp_step + 1
    runner = make_runner(model_dir, device, data_type, mtp_step, max_len)
    counts = AcceptanceCounts(mtp_step)
    eos = stop_ids(model_dir)
    for prompt in prompts:
        decode_with_mtp(runner, prompt, max_new_tokens, mtp_step, eos, counts)
    return counts


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m lightllm.tools.measure_acceptance", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model_dir", default=None, help="checkpoint (default: the built-in demo model)")
    p.add_argument("--mtp_step", type=int, default=2)
    p.add_argument("--num_prompts", type=int, default=8)
    p.add_argument("--prompt_len", type=int, default=64)
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--data_type", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--json", default=None, help="also write the counts to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    model_dir = args.model_dir
    if model_dir is None:
        from lightllm.server.demo_checkpoint import demo_model_dir

        model_dir = demo_model_dir()
    data_type = args.data_type or default_data_type(args.device)
    counts = measure_acceptance(
        model_dir, args.mtp_step, args.num_prompts, args.prompt_len, args.max_new_tokens, args.device, data_type
    )
    print(f"{model_dir} on {args.device} ({data_type}), greedy")
    print(counts.table())
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(counts), indent=2) + "\n")


if __name__ == "__main__":
    main()
