"""Per-request generation settings, shared by the HTTP front-end, the offline `LLM` and the engine."""

from __future__ import annotations

import msgspec

# seeds are folded into a torch.Generator, which takes 64-bit unsigned values
MAX_SEED = 2**63 - 1


class SamplingParams(msgspec.Struct, kw_only=True):
    """How to pick each next token and when to stop.

    `temperature == 0` means greedy (argmax); the other sampling knobs are then ignored. `top_k <= 0` and
    `top_p == 1` disable those filters. `logprobs=None` returns none; `logprobs=k` returns the chosen token's
    log-probability plus the k most likely alternatives (k may be 0). Log-probabilities are those of the model's
    raw distribution, before penalties, temperature and filters.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self) -> None:
        """Raise ValueError naming the offending field and the accepted range."""
        checks = [
            ("n", 1 <= self.n <= 64, "must be in [1, 64]"),
            ("temperature", 0.0 <= self.temperature <= 100.0, "must be in [0, 100]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= -1, "must be -1 (off), 0 (off) or positive"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0, "must be in (0, 10]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("seed", self.seed is None or 0 <= self.seed <= MAX_SEED, f"must be in [0, {MAX_SEED}]"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be at least 1"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be in [0, 20]"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            ("stop_token_ids", all(t >= 0 for t in self.stop_token_ids), "must be non-negative token ids"),
        ]
        for name, ok, reason in checks:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r}: {reason}")
