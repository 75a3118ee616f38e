"""Turn logits into tokens: penalties, temperature, top-k / top-p / min-p, seeded draws, log-probabilities.

Order of operations for a sampled row: penalties on the logits → divide by temperature → softmax → keep the
top_k most likely → keep the smallest prefix whose mass reaches top_p → drop tokens below min_p · max prob →
renormalise. A greedy row (temperature 0) takes the argmax of the penalised logits and draws no random number.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


def apply_penalties(logits: torch.Tensor, rows: list[RowContext]) -> torch.Tensor:
    """In place on `logits` [N, V]: repetition (prompt + output), presence and frequency (output only)."""
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        p = row.params
        if not p.has_penalties:
            continue
        out = torch.tensor(row.output_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(out[(out >= 0) & (out < vocab)], minlength=vocab).to(logits.dtype)
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            prompt = torch.tensor(row.prompt_ids, dtype=torch.long, device=logits.device)
            seen[prompt[(prompt >= 0) & (prompt < vocab)]] = True
            x = logits[i]
            penalised = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
            logits[i] = torch.where(seen, penalised, x)
        logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_probs(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Apply top-k, top-p and min-p to one distribution `probs` [V] and renormalise."""
    if 0 < top_k < probs.numel():
        kth = torch.topk(probs, top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # mass before each token; a token is kept while the mass before it is still short of top_p
        mass_before = torch.cumsum(sorted_probs, 0) - sorted_probs
        keep_sorted = mass_before < top_p
        keep = torch.zeros_like(keep_sorted).scatter_(0, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    if min_p > 0.0:
        probs = torch.where(probs >= min_p * probs.max(), probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    return probs


class Sampler:
    """Stateless apart from one shared generator for requests without a seed."""

    def __init__(self, seed: int = 0):
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator(self, row: RowContext, device: torch.device) -> torch.Generator:
        if row.generator is not None:
            return row.generator
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self._seed)
        return self._generators[device]

    def target_probs(self, logits: torch.Tensor, rows: list[RowContext]) -> torch.Tensor:
        """The distribution each row samples from, [N, V] fp32. Greedy rows get a one-hot of the argmax.

        Batched over rows; only rows that use penalties or top-k/top-p/min-p take a per-row path.
        """
        logits = apply_penalties(logits.float().clone(), rows)
        device = logits.device
        temps = torch.tensor([p.params.temperature or 1.0 for p in rows], dtype=torch.float32, device=device)
        probs = torch.softmax(logits / temps[:, None], dim=-1)
        for i, row in enumerate(rows):
            p = row.params
            if not p.greedy and (0 < p.top_k < probs.shape[1] or p.top_p < 1.0 or p.min_p > 0.0):
                probs[i] = filter_probs(probs[i], p.top_k, p.top_p, p.min_p)
        greedy = [i for i, row in enumerate(rows) if row.params.greedy]
        if greedy:
            index = torch.tensor(greedy, device=device)
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

    def sample(self, logits: torch.Tensor, rows: list[RowContext]) -> list[int]:
        probs = self.target_probs(logits, rows)
        return [self.draw(probs[i], row) for i, row in enumerate(rows)]


def compute_logprobs(
    logits: torch.Tensor, token_ids: list[int], num_top: int
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Raw-model log-probabilities of `token_ids` (one per row of `logits` [N, V]) and each row's top `num_top`."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp[torch.arange(len(token_ids), device=logp.device), torch.tensor(token_ids, device=logp.device)]
    tops: list[list[tuple[int, float]]] = [[] for _ in token_ids]
    if num_top > 0:
        values, indices = torch.topk(logp, num_top, dim=-1)
        tops = [list(zip(idx.tolist(), val.tolist())) for idx, val in zip(indices, values)]
    return chosen.tolist(), tops
