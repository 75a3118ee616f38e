"""Per-request generation settings, shared by the HTTP front-end, the offline `LLM` and the engine."""

from __future__ import annotations

import math

import msgspec

# seeds are folded into a torch.Generator, which takes 64-bit unsigned values
MAX_SEED = 2**63 - 1
# integer knobs the engine turns into tensors (top_k) or compares with token ids stay within int32
MAX_INT = 2**31 - 1
MAX_N = 64
# below these a temperature or top_p leaves one token with any mass: the row is sampled greedily (dividing by a
# temperature of 1e-300 overflows the logits to inf, and the softmax of inf is NaN)
GREEDY_TEMPERATURE = 1e-5
GREEDY_TOP_P = 1e-5
# a repetition penalty divides or multiplies logits: within [1/100, 10] it reweights tokens, beyond it only
# overflows (a penalty of 1e-300 turns every seen token's logit into inf)
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 10.0
# OpenAI's range for a logit bias: -100 bans a token and +100 forces it in practice
MAX_LOGIT_BIAS = 100.0
# biased tokens per request (each one an entry added to its row's logits every step)
MAX_LOGIT_BIAS_TOKENS = 1024
# allowed_token_ids per request: more than any vocabulary served here holds
MAX_ALLOWED_TOKEN_IDS = 1 << 18
# bad words per request (each becomes up to two token sequences), and tokens per sequence
MAX_BAD_WORDS = 128
MAX_BAD_WORD_TOKENS = 64


TOKEN_ID_RANGE = f"must be a token id in [0, {MAX_INT}]"


class SamplingParamsError(ValueError):
    """A field out of range or of the wrong type; `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _is_int(v, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _is_float(v, lo: float, hi: float, lo_open: bool = False) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return False
    return (lo < v if lo_open else lo <= v) and v <= hi


class StructuredOutputsParams(msgspec.Struct, kw_only=True):
    """vLLM's offline constraint on the output: exactly one of a JSON schema (an object or its JSON text), any JSON
    object, a regular expression the whole output matches, one of several strings, a Lark grammar (llguidance's
    dialect) or a structural tag (`{type: structural_tag, structures: [{begin, schema, end}], triggers: [...]}`, an
    object or its JSON text). The offline `LLM` compiles it into `SamplingParams.grammar`."""

    json: dict | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict | str | None = None

    def constraint(self) -> tuple[str, object] | None:
        """(kind, value) of the one constraint given; None unless exactly one is, of its kind's type."""
        kinds = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
        given = [(k, v) for k in kinds if (v := getattr(self, k)) is not None and v is not False]
        if len(given) != 1:
            return None
        kind, value = given[0]
        valid = {
            "json": isinstance(value, dict) or (isinstance(value, str) and value),
            "structural_tag": isinstance(value, dict) or (isinstance(value, str) and value),
            "json_object": value is True,
            "choice": isinstance(value, list) and value and all(isinstance(c, str) and c for c in value),
        }.get(kind, isinstance(value, str) and value)
        return given[0] if valid else None


class SamplingParams(msgspec.Struct, kw_only=True):
    """How to pick each next token and when to stop.

    `temperature == 0` means greedy (argmax), as does a temperature below `GREEDY_TEMPERATURE` or a top_p below
    `GREEDY_TOP_P`; the other sampling knobs are then ignored. `top_k <= 0` and
    `top_p == 1` disable those filters. `logprobs=None` returns none; `logprobs=k` returns the chosen token's
    log-probability plus the k most likely alternatives (k may be 0). `prompt_logprobs=k` returns, once, each prompt
    token's log-probability given the tokens before it (None for the first) with k alternatives at each position.
    Log-probabilities are those of the model's raw distribution, before penalties, temperature and filters (and
    before a grammar's mask and `logit_bias`). `logit_bias` maps token ids to values added to their logits before
    penalties and temperature, for greedy rows too. `min_tokens` keeps stop tokens (EOS, `stop_token_ids`) from
    being sampled, and stop strings from matching, until that many tokens are out. `grammar` constrains every sampled token, drafts included (see
    engine/grammar.py). `allowed_token_ids` keeps every other token from being sampled (EOS included: list it to
    let the output end early). `bad_words` (vLLM's) are words the output never ends with: the front-end tokenizes
    each, with and without a leading space, into `bad_words_token_ids`, and a sequence's last token is banned
    wherever the output so far ends with the rest of it. A ban that would leave a position no token at all (a
    grammar allowing only banned tokens) yields at that position. `thinking_token_budget` caps the tokens inside a
    reasoning block (`think_open_token` ... `think_end_token`, filled by the front-end): once spent, the end token
    is forced.
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
    # no stop token (EOS, stop_token_ids) is sampled and no stop string matches before this many output tokens
    min_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)
    # the stop string (or the stop token's text) that ended the output is part of its text
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)
    # an llguidance grammar (its JSON or Lark text) the output must follow; EOS is allowed once it is complete
    grammar: str | None = None
    # the grammar applies after this token has been generated (a reasoning block's end); None: from the start
    grammar_start_token: int | None = None
    # vLLM's offline form of a constraint, which the offline `LLM` compiles into `grammar`; the engine never sees it
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None
    # vLLM's: at most this many tokens inside a reasoning block, then its end token is forced (engine/thinking_budget.py)
    thinking_token_budget: int | None = None
    # the reasoning block's open and end token ids, which the front-end (HTTP, `LLM`) fills beside a budget
    think_open_token: int | None = None
    think_end_token: int | None = None
    # words as the client sent them; what the engine reads is their tokenization in bad_words_token_ids
    bad_words: list[str] = msgspec.field(default_factory=list)
    bad_words_token_ids: list[list[int]] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_p < GREEDY_TOP_P

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def needs_output_history(self) -> bool:
        """A token's distribution depends on the output before it (penalties count it, min_tokens its length, a
        bad word of several tokens its end, a thinking budget its reasoning): a step cannot be launched before its predecessor's tokens are on the
        host."""
        return (
            self.has_penalties
            or self.min_tokens > 0
            or any(len(s) > 1 for s in self.bad_words_token_ids)
            or self.thinking_token_budget is not None
        )

    @property
    def takes_raw_argmax(self) -> bool:
        """Each token is the argmax of the model's raw logits: greedy, with nothing added to, scaled in or banned
        from them (the device-side fast paths count on it)."""
        return (
            self.greedy
            and not self.needs_output_history
            and not self.logit_bias
            and self.allowed_token_ids is None
            and not self.bad_words_token_ids
        )

    def vocab_problem(self, vocab_size: int) -> tuple[str, str] | None:
        """(message, field) when a token id these params name lies outside a vocabulary of `vocab_size`, else None."""
        if any(t >= vocab_size for t in self.stop_token_ids):
            return f"stop_token_ids must be in [0, {vocab_size})", "stop_token_ids"
        if any(t >= vocab_size for t in self.logit_bias):
            return f"logit_bias token ids must be in [0, {vocab_size})", "logit_bias"
        if any(t >= vocab_size for t in self.allowed_token_ids or ()):
            return f"allowed_token_ids must be in [0, {vocab_size})", "allowed_token_ids"
        if any(t >= vocab_size for seq in self.bad_words_token_ids for t in seq):
            return f"bad_words_token_ids must be in [0, {vocab_size})", "bad_words_token_ids"
        if self.thinking_token_budget is not None and not (
            self.think_end_token is not None and self.think_end_token < vocab_size
        ):
            return (
                "thinking_token_budget: the reasoning block's end token (think_end_token) is not in the vocabulary",
                ("thinking_token_budget"),
            )
        return None

    def validate(self) -> None:
        """Raise SamplingParamsError naming the offending field and the accepted range. The engine calls this too:
        a request that slipped past the front-end's checks fails alone instead of failing its batch."""
        seed_ok = self.seed is None or (
            _is_int(self.seed, 0, MAX_SEED) and _is_int(self.n, 1, MAX_N) and self.seed + self.n - 1 <= MAX_SEED
        )
        checks = [
            ("n", _is_int(self.n, 1, MAX_N), f"must be an integer in [1, {MAX_N}]"),
            ("temperature", _is_float(self.temperature, 0.0, 100.0), "must be a number in [0, 100]"),
            ("top_p", _is_float(self.top_p, 0.0, 1.0, lo_open=True), "must be a number in (0, 1]"),
            ("top_k", _is_int(self.top_k, -1, MAX_INT), f"must be -1 (off), 0 (off) or in [1, {MAX_INT}]"),
            ("min_p", _is_float(self.min_p, 0.0, 1.0), "must be a number in [0, 1]"),
            (
                "repetition_penalty",
                _is_float(self.repetition_penalty, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
                f"must be a number in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY:g}]",
            ),
            ("presence_penalty", _is_float(self.presence_penalty, -2.0, 2.0), "must be a number in [-2, 2]"),
            ("frequency_penalty", _is_float(self.frequency_penalty, -2.0, 2.0), "must be a number in [-2, 2]"),
            # the n sequences of a request use seeds seed, seed + 1, ..., seed + n - 1
            ("seed", seed_ok, f"must be an integer in [0, {MAX_SEED}] with seed + n - 1 <= {MAX_SEED}"),
            (
                "max_tokens",
                self.max_tokens is None or _is_int(self.max_tokens, 1, MAX_INT),
                f"must be an integer in [1, {MAX_INT}]",
            ),
            (
                "min_tokens",
                _is_int(self.min_tokens, 0, MAX_INT)
                and (
                    self.max_tokens is None
                    or not _is_int(self.max_tokens, 1, MAX_INT)
                    or self.min_tokens <= self.max_tokens
                ),
                f"must be an integer in [0, {MAX_INT}], at most max_tokens",
            ),
            ("logprobs", self.logprobs is None or _is_int(self.logprobs, 0, 20), "must be an integer in [0, 20]"),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or _is_int(self.prompt_logprobs, 0, 20),
                "must be an integer in [0, 20]",
            ),
            (
                "stop",
                isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
                "must be non-empty strings",
            ),
            (
                "stop_token_ids",
                isinstance(self.stop_token_ids, list) and all(_is_int(t, 0, MAX_INT) for t in self.stop_token_ids),
                f"must be token ids in [0, {MAX_INT}]",
            ),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "must be a boolean"),
            ("include_stop_str_in_output", isinstance(self.include_stop_str_in_output, bool), "must be a boolean"),
            ("skip_special_tokens", isinstance(self.skip_special_tokens, bool), "must be a boolean"),
            (
                "logit_bias",
                isinstance(self.logit_bias, dict)
                and len(self.logit_bias) <= MAX_LOGIT_BIAS_TOKENS
                and all(
                    _is_int(t, 0, MAX_INT) and _is_float(b, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
                    for t, b in self.logit_bias.items()
                ),
                f"must map at most {MAX_LOGIT_BIAS_TOKENS} token ids in [0, {MAX_INT}] to numbers in "
                f"[{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
            ),
            ("grammar", self.grammar is None or (isinstance(self.grammar, str) and self.grammar), "must be text"),
            (
                "min_tokens",
                not self.min_tokens or self.grammar is None,
                "cannot be combined with constrained output (a complete grammar allows only EOS)",
            ),
            (
                "structured_outputs",
                self.structured_outputs is None
                or (
                    isinstance(self.structured_outputs, StructuredOutputsParams)
                    and self.structured_outputs.constraint() is not None
                    and self.grammar is None
                ),
                "must be a StructuredOutputsParams naming exactly one of json (a schema: a dict or its text), "
                "json_object (true), regex (text), choice (a list of non-empty strings), grammar (text) or "
                "structural_tag (a dict or its text), and no grammar beside it",
            ),
            (
                "allowed_token_ids",
                self.allowed_token_ids is None
                or (
                    isinstance(self.allowed_token_ids, list)
                    and 0 < len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS
                    and all(_is_int(t, 0, MAX_INT) for t in self.allowed_token_ids)
                    and self.grammar is None
                ),
                f"must be 1 to {MAX_ALLOWED_TOKEN_IDS} token ids in [0, {MAX_INT}], without constrained output (a "
                "grammar chooses the tokens itself)",
            ),
            (
                "bad_words",
                isinstance(self.bad_words, list)
                and len(self.bad_words) <= MAX_BAD_WORDS
                and all(isinstance(w, str) and w.strip() for w in self.bad_words),
                f"must be at most {MAX_BAD_WORDS} words, each with a character other than white space",
            ),
            (
                "bad_words_token_ids",
                isinstance(self.bad_words_token_ids, list)
                and len(self.bad_words_token_ids) <= 2 * MAX_BAD_WORDS
                and all(
                    isinstance(seq, list)
                    and 0 < len(seq) <= MAX_BAD_WORD_TOKENS
                    and all(_is_int(t, 0, MAX_INT) for t in seq)
                    for seq in self.bad_words_token_ids
                ),
                f"must be at most {2 * MAX_BAD_WORDS} sequences of 1 to {MAX_BAD_WORD_TOKENS} token ids in "
                f"[0, {MAX_INT}]",
            ),
            (
                "thinking_token_budget",
                self.thinking_token_budget is None or _is_int(self.thinking_token_budget, 0, MAX_INT),
                f"must be an integer in [0, {MAX_INT}]",
            ),
            *(
                (name, getattr(self, name) is None or _is_int(getattr(self, name), 0, MAX_INT), TOKEN_ID_RANGE)
                for name in ("think_open_token", "think_end_token", "grammar_start_token")
            ),
        ]
        for name, ok, reason in checks:
            if not ok:
                raise SamplingParamsError(name, f"{name}={_short(getattr(self, name))}: {reason}")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
