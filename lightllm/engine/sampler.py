"""Turn logits into tokens: penalties, temperature, top-k / top-p / min-p, seeded draws, log-probabilities.

Order of operations for a sampled row: logit bias, penalties, allowed_token_ids and bans (stop tokens before
min_tokens, bad words' last tokens; a row they would leave no token keeps its logits from before them), then a
forced token (a spent thinking budget) on the logits → divide by temperature → softmax → keep the
top_k most likely → keep the smallest prefix whose mass reaches top_p → drop tokens below min_p · max prob →
renormalise. A greedy row (temperature 0) takes the argmax of the biased, penalised logits and draws no random
number.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from lightllm.cache.device_copy import list_to_device, to_device
from lightllm.engine.sampling_params import SamplingParams


@dataclass
class RowContext:
    """What one logits row needs to be turned into a distribution."""

    params: SamplingParams
    # prompt ids (repetition penalty looks at them too)
    prompt_ids: list[int]
    # tokens generated before this position, including accepted-so-far drafts of the window
    output_ids: list[int]
    # the request's own generator when it has a seed, else None (the sampler's shared generator is used)
    generator: torch.Generator | None = None
    # token ids this position may not take (stop tokens before the request's min_tokens, bad words' last tokens)
    banned_ids: tuple[int, ...] = ()
    # with params.allowed_token_ids: [vocab] bool, True where a token may be taken (`allowed_mask`)
    allowed_mask: torch.Tensor | None = None
    # the token this position must take (a thinking budget spent: the reasoning block's end), else None
    forced_id: int | None = None


def bad_word_bans(sequences: list[list[int]], output_ids: list[int], drafts: list[int]) -> set[int]:
    """The last token of each bad word sequence whose other tokens end the output so far (`output_ids` followed by
    the window's `drafts` before this position); a one-token sequence is banned everywhere."""
    if not sequences:
        return set()
    longest = max(len(seq) for seq in sequences) - 1
    # only the output's end is compared: no copy of a long output per position
    tail = (output_ids[-longest:] + drafts)[-longest:] if longest else []
    return {seq[-1] for seq in sequences if len(tail) >= len(seq) - 1 and tail[len(tail) - len(seq) + 1 :] == seq[:-1]}


def apply_logit_bias(logits: torch.Tensor, rows: list[RowContext]) -> torch.Tensor:
    """In place on `logits` [N, V]: each row's `logit_bias` added at its token ids, all rows in one indexed add. The
    index is read from the dicts' keys and values by numpy: a Python object per entry would make every step of the
    batch pay for rows × entries (up to 1024 entries a request) in the interpreter."""
    biased = [(i, row.params.logit_bias) for i, row in enumerate(rows) if row.params.logit_bias]
    if biased:
        sizes = [len(bias) for _, bias in biased]
        total = sum(sizes)
        rows_i = np.repeat(np.asarray([i for i, _ in biased], dtype=np.int64), sizes)
        tokens = np.fromiter(chain.from_iterable(bias.keys() for _, bias in biased), np.int64, total)
        values = np.fromiter(chain.from_iterable(bias.values() for _, bias in biased), np.float64, total)
        device = logits.device
        index = (to_device(rows_i, device), to_device(tokens, device))
        logits.index_put_(index, to_device(values, device).to(logits.dtype), accumulate=True)
    return logits


def allowed_mask(token_ids: list[int], width: int, device: torch.device) -> torch.Tensor:
    """[width] bool, True at `token_ids`: built once per request (the engine keeps it on the request), so a step
    costs no more for a long allowed list than for a short one."""
    mask = torch.zeros(width, dtype=torch.bool, device=device)
    mask[to_device(np.asarray(token_ids, dtype=np.int64), device)] = True
    return mask


def apply_allowed(logits: torch.Tensor, rows: list[RowContext]) -> torch.Tensor:
    """In place on `logits` [N, V]: -inf outside each row's `allowed_mask`, the rows that have one in one masked
    write (columns past a mask's width, padding of the logits, are outside)."""
    limited = [i for i, row in enumerate(rows) if row.allowed_mask is not None]
    if limited:
        vocab = logits.shape[1]
        keep = torch.stack([rows[i].allowed_mask[:vocab] for i in limited])
        keep = torch.nn.functional.pad(keep, (0, vocab - keep.shape[1]), value=False)
        index = list_to_device(limited, torch.long, logits.device)
        logits[index] = logits[index].masked_fill(~keep, float("-inf"))
    return logits


def apply_forced(logits: torch.Tensor, rows: list[RowContext]) -> torch.Tensor:
    """In place on `logits` [N, V]: a row with a forced token keeps that token alone, at a finite logit whatever
    masked it (the force is the last word on the position)."""
    forced = [(i, row.forced_id) for i, row in enumerate(rows) if row.forced_id is not None]
    if forced:
        index = list_to_device([i for i, _ in forced], torch.long, logits.device)
        tokens = list_to_device([t for _, t in forced], torch.long, logits.device)
        logits[index] = float("-inf")
        logits[index, tokens] = 0.0
    return logits


def apply_bans(logits: torch.Tensor, rows: list[RowContext]) -> torch.Tensor:
    """In place on `logits` [N, V]: -inf at each row's banned ids, all rows in one indexed write (an EOS id past
    the logits' width, which the model can never sample, is left out rather than indexed)."""
    vocab = logits.shape[1]
    entries = [(i, t) for i, row in enumerate(rows) for t in row.banned_ids if t < vocab]
    if entries:
        rows_i, tokens = zip(*entries)
        index = (list_to_device(rows_i, torch.long, logits.device), list_to_device(tokens, torch.long, logits.device))
        logits.index_put_(index, torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))
    return logits


def apply_penalties(logits: torch.Tensor, rows: list[RowContext]) -> torch.Tensor:
    """In place on `logits` [N, V]: repetition (prompt + output), presence and frequency (output only)."""
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        p = row.params
        if not p.has_penalties:
            continue
        out = list_to_device(row.output_ids, torch.long, logits.device)
        counts = torch.bincount(out[(out >= 0) & (out < vocab)], minlength=vocab).to(logits.dtype)
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            prompt = list_to_device(row.prompt_ids, torch.long, logits.device)
            seen[prompt[(prompt >= 0) & (prompt < vocab)]] = True
            x = logits[i]
            penalised = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
            logits[i] = torch.where(seen, penalised, x)
        logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_probs_batch(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Top-k, then top-p, then min-p on each row of `probs` [N, V] (per-row knobs [N]), renormalised.

    One sort serves all three filters: each filter sees the renormalised survivors of the previous one, which in
    sorted order are a prefix, so every mask is a prefix mask over the sorted row.
    """
    vocab = probs.shape[1]
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    ranks = torch.arange(vocab, device=probs.device)
    keep = ranks[None, :] < torch.where(top_k > 0, top_k, vocab)[:, None]
    kept = sorted_probs * keep
    kept = kept / kept.sum(-1, keepdim=True)
    # a token is kept while the mass before it is still short of top_p (the first token always stays)
    keep &= (torch.cumsum(kept, -1) - kept) < top_p[:, None]
    kept = sorted_probs * keep
    kept = kept / kept.sum(-1, keepdim=True)
    keep &= kept >= min_p[:, None] * kept[:, :1]
    kept = sorted_probs * keep
    kept = kept / kept.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(1, order, kept)


# top_k, top_p, min_p
KNOB_DTYPES = (torch.long, torch.float32, torch.float32)


def filter_probs(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """`filter_probs_batch` for one distribution `probs` [V]."""
    knobs = [list_to_device([v], dtype, probs.device) for v, dtype in zip((top_k, top_p, min_p), KNOB_DTYPES)]
    return filter_probs_batch(probs[None], *knobs)[0]


class Sampler:
    """Stateless apart from one shared generator for requests without a seed."""

    def __init__(self, seed: int = 0):
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator(self, row: RowContext, device: torch.device) -> torch.Generator:
        return row.generator if row.generator is not None else self._shared(device)

    def _shared(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self._seed)
        return self._generators[device]

    def target_probs(self, logits: torch.Tensor, rows: list[RowContext]) -> torch.Tensor:
        """The distribution each row samples from, [N, V] fp32. Greedy rows get a one-hot of the argmax.

        Batched over rows; only rows that use penalties or top-k/top-p/min-p take a per-row path.
        """
        logits = apply_allowed(apply_penalties(apply_logit_bias(logits.float().clone(), rows), rows), rows)
        if any(row.banned_ids for row in rows):
            unbanned = logits.clone()
            logits = apply_bans(logits, rows)
            # a ban yields where it would leave nothing (a grammar or allowed_token_ids allowing only banned tokens):
            # a distribution of all -inf has no sample (its softmax is NaN)
            logits = torch.where(torch.isfinite(logits.amax(dim=-1, keepdim=True)), logits, unbanned)
        logits = apply_forced(logits, rows)
        device = logits.device
        temps = list_to_device([p.params.temperature or 1.0 for p in rows], torch.float32, device)
        probs = torch.softmax(logits / temps[:, None], dim=-1)
        filtered = [
            i
            for i, row in enumerate(rows)
            if not row.params.greedy and (row.params.top_k > 0 or row.params.top_p < 1.0 or row.params.min_p > 0.0)
        ]
        if filtered:
            index = list_to_device(filtered, torch.long, device)
            vocab = probs.shape[1]
            # top_k beyond the vocabulary keeps everything; clamped so no client value can overflow the tensor
            top_k = list_to_device([min(rows[i].params.top_k, vocab) for i in filtered], torch.long, device)
            knobs = [top_k] + [
                list_to_device([float(getattr(rows[i].params, k)) for i in filtered], torch.float32, device)
                for k in ("top_p", "min_p")
            ]
            probs[index] = filter_probs_batch(probs[index], *knobs)
        greedy = [i for i, row in enumerate(rows) if row.params.greedy]
        if greedy:
            index = list_to_device(greedy, torch.long, device)
            one_hot = torch.zeros(len(greedy), probs.shape[1], device=device)
            one_hot.scatter_(1, logits[index].argmax(dim=-1, keepdim=True), 1.0)
            probs[index] = one_hot
        return probs

    def draw(self, probs: torch.Tensor, row: RowContext) -> int:
        """One token from `probs` [V] using the row's generator (argmax when the row is greedy)."""
        if row.params.greedy:
            return int(torch.argmax(probs))
        gen = self.generator(row, probs.device)
        # exponential race: argmax(p / E) with E ~ Exp(1) is a sample from p, without a host-side cumsum
        noise = torch.empty_like(probs).exponential_(generator=gen)
        # a zero draw would turn a zero-probability token into 0/0 = NaN, which argmax would pick
        return int(torch.argmax(probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)))

    def uniform(self, row: RowContext, device: torch.device) -> float:
        return float(torch.rand((), generator=self.generator(row, device), device=device))

    def draw_many(self, probs: torch.Tensor, rows: list[RowContext]) -> list[int]:
        """One token per row of `probs` [N, V]: greedy rows take the argmax, unseeded rows share one batched draw,
        seeded rows draw from their own generator."""
        return self.draw_tokens(probs, rows).tolist()

    def draw_tokens(self, probs: torch.Tensor, rows: list[RowContext]) -> torch.Tensor:
        """`draw_many` left on the device ([N] int64), for a caller that must not wait for the GPU."""
        noise = torch.empty_like(probs)
        shared = [i for i, row in enumerate(rows) if row.generator is None and not row.params.greedy]
        if shared:
            noise[list_to_device(shared, torch.long, probs.device)] = torch.empty(
                len(shared), probs.shape[1], device=probs.device
            ).exponential_(generator=self._shared(probs.device))
        for i, row in enumerate(rows):
            if row.generator is not None and not row.params.greedy:
                noise[i] = torch.empty_like(probs[i]).exponential_(generator=row.generator)
            elif row.params.greedy:
                noise[i] = 1.0
        return torch.argmax(probs / noise.clamp_min(torch.finfo(noise.dtype).tiny), dim=-1)

    def sample(self, logits: torch.Tensor, rows: list[RowContext]) -> list[int]:
        return self.draw_many(self.target_probs(logits, rows), rows)


def compute_logprobs(
    logits: torch.Tensor, token_ids: list[int], num_top: int
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Raw-model log-probabilities of `token_ids` (one per row of `logits` [N, V]) and each row's top `num_top`."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp[torch.arange(len(token_ids), device=logp.device), list_to_device(token_ids, torch.long, logp.device)]
    tops: list[list[tuple[int, float]]] = [[] for _ in token_ids]
    if num_top > 0:
        values, indices = torch.topk(logp, num_top, dim=-1)
        tops = [list(zip(idx.tolist(), val.tolist())) for idx, val in zip(indices, values)]
    return chosen.tolist(), tops


def token_ranks(logits: torch.Tensor, token_ids: list[int]) -> list[int]:
    """Each of `token_ids`' rank in its row of `logits` [N, V] (vLLM's: 1 for the most likely; tokens as likely as
    it count ahead of it). Read on the logits: log_softmax keeps a row's order."""
    rows = logits.float()
    chosen = rows[torch.arange(len(token_ids), device=rows.device), list_to_device(token_ids, torch.long, rows.device)]
    return (rows >= chosen[:, None]).sum(dim=-1).tolist()
