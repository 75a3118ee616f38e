"""Constrained decoding: each request with a grammar (SamplingParams.grammar, llguidance's format) owns a matcher,
and every logits row the step samples or verifies for it is masked to the tokens the grammar allows there.

Under speculation a window `[last, d_1, ..., d_k]` needs k + 1 masks: position j's mask is the grammar's state
after the drafts before it. The matcher walks the drafts to compute them and is rolled back; a draft the grammar
refuses ends the walk (its own position is masked against it, so it is rejected, and nothing after it can be
accepted). Only the tokens the window emits advance the matcher. A stopped grammar allows only EOS.

The vocabulary (llguidance's tokenizer: every token's bytes, and the EOS ids) is built from the tokenizer folder
named in the request by a loader the engine is given (the server's reads Hugging Face and tiktoken folders), once
per folder and EOS set; `GrammarBackend.preload` builds it at start-up.

Masks are applied without a host sync (pinned host buffers, copies that do not wait for the device), so an
overlapped step can mask its logits while the device still runs its forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lightllm.engine.request import Request

# (tokenizer folder, logits width, EOS ids) -> llguidance.LLTokenizer
VocabularyLoader = Callable[[str, int, tuple[int, ...]], object]
# compiled at preload: the first matcher and mask of a vocabulary build llguidance's lazy structures
_WARM_GRAMMAR = '{"grammars": [{"json_schema": {"type": "object"}}]}'


class RequestGrammar:
    """One request's matcher. `start_token`: the grammar applies after this token (a reasoning block's end);
    until it is generated the output is free."""

    def __init__(self, matcher, start_token: int | None, executor):
        self.matcher = matcher
        self.start_token = start_token
        # llguidance's thread pool, shared by the backend's matchers
        self.executor = executor
        self.active = start_token is None

    def starts_inside(self, drafts: list[int]) -> bool:
        """Whether the grammar is off at the window's start and a draft may switch it on."""
        return not self.active and self.start_token in drafts

    def fill_window(self, bitmask: torch.Tensor, first_row: int, drafts: list[int]) -> None:
        """Write the masks of window positions 0 .. len(drafts) into `bitmask[first_row:]` (int32 [rows, words]):
        positions before the grammar starts keep theirs (all ones), and after a draft the grammar refuses nothing
        is written (nothing past it can be accepted). The matcher ends where it began."""
        active, consumed = self.active, 0
        for j in range(len(drafts) + 1):
            if active:
                row = bitmask[first_row + j]
                self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
            if j == len(drafts):
                break
            if not active:
                active = drafts[j] == self.start_token
            elif self.matcher.try_consume_tokens([drafts[j]]) == 1:
                consumed += 1
            else:
                break
        if consumed:
            self.matcher.rollback(consumed)

    def advance(self, token_ids: list[int]) -> str | None:
        """Consume the emitted tokens; an error message if the grammar refuses one (a masking bug)."""
        for token in token_ids:
            if not self.active:
                self.active = token == self.start_token
                continue
            if not self.matcher.consume_token(token):
                return f"token {token} left the grammar: {self.matcher.get_error()}"
        return None


class GrammarBackend:
    """Matchers for requests; vocabularies built per tokenizer folder and EOS set by `load_vocabulary`, on first use
    or at `preload`. Without a loader, requests with a grammar fail (an engine built without one)."""

    def __init__(self, vocab_size: int, load_vocabulary: VocabularyLoader | None = None):
        self.vocab_size = vocab_size
        self._load_vocabulary = load_vocabulary
        self._executor = None
        self._tokenizers: dict[tuple[str, tuple[int, ...]], object] = {}
        # a vocabulary that could not be built, and why: later requests fail at once instead of stalling a step
        self._failed: dict[tuple[str, tuple[int, ...]], str] = {}

    def _tokenizer(self, tokenizer_dir: str, eos_ids: tuple[int, ...]):
        key = (tokenizer_dir, eos_ids)
        if key in self._failed:
            raise ValueError(self._failed[key])
        if key not in self._tokenizers:
            if self._load_vocabulary is None:
                raise ValueError("this engine was built without a grammar vocabulary loader")
            try:
                # sized to the model's logits (a checkpoint may pad its vocabulary past the tokenizer's)
                self._tokenizers[key] = self._load_vocabulary(tokenizer_dir, self.vocab_size, eos_ids)
            except Exception as exc:
                self._failed[key] = f"the grammar vocabulary of {tokenizer_dir} could not be built: {exc}"
                raise ValueError(self._failed[key]) from exc
        return self._tokenizers[key]

    def _executor_pool(self):
        if self._executor is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor()
        return self._executor

    def preload(self, tokenizer_dir: str, eos_ids: list[int]) -> None:
        """Build a vocabulary, the mask thread pool, and one matcher and mask over them now (at start-up), so the
        first constrained request does not pay for them inside a step."""
        grammar = self.matcher(_WARM_GRAMMAR, None, tokenizer_dir, eos_ids)
        bitmask = torch.zeros((1, (self.vocab_size + 31) // 32), dtype=torch.int32)
        _fill_parallel(grammar.executor, bitmask, [(grammar.matcher, 0)], [])
        if not bitmask.any():
            raise ValueError(f"{tokenizer_dir}: the grammar vocabulary allows no token where JSON starts")

    def matcher(self, grammar: str, start_token: int | None, tokenizer_dir: str, eos_ids: list[int]) -> RequestGrammar:
        """Raises ValueError naming the problem when the grammar does not compile."""
        from llguidance import LLMatcher

        if not tokenizer_dir:
            raise ValueError("a request with a grammar must name its tokenizer folder")
        matcher = LLMatcher(self._tokenizer(tokenizer_dir, tuple(eos_ids)), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the grammar does not compile: {matcher.get_error()}")
        return RequestGrammar(matcher, start_token, self._executor_pool())


def attach(backend: GrammarBackend, req: Request, msg) -> str | None:
    """Give `req` its matcher when its params carry a grammar; the error that fails the request, if any."""
    params = req.params
    if params.grammar is None:
        return None
    try:
        req.grammar = backend.matcher(params.grammar, params.grammar_start_token, msg.tokenizer_dir, msg.eos_token_ids)
    except Exception as exc:
        return str(exc)
    return None


def advance(req: Request, token_ids: list[int]) -> str | None:
    """Move the request's matcher over the tokens it emits; an error message when the grammar refuses one."""
    return req.grammar.advance(token_ids) if req.grammar is not None else None


def mask_windows(windows: list[tuple[Request, int, int, list[int]]], logits: torch.Tensor) -> torch.Tensor:
    """`logits` [rows, V] with every constrained position of every window (request, first row, width, drafts)
    masked to -inf outside its grammar; the same tensor when no window has a grammar. No host sync: the masks go
    to the device through pinned buffers, behind whatever the device is running."""
    constrained = [(req.grammar, start, drafts) for req, start, _, drafts in windows if req.grammar is not None]
    if not constrained:
        return logits
    vocab = logits.shape[1]
    num_rows = sum(len(d) + 1 for _, _, d in constrained)
    pinned = logits.is_cuda
    # -1 (every bit set): no constraint, the mask of a position before the grammar starts
    bitmask = torch.full((num_rows, (vocab + 31) // 32), -1, dtype=torch.int32, pin_memory=pinned)
    rows: list[int] = []
    plain, drafted = [], []
    offset = 0
    for grammar, start, drafts in constrained:
        width = len(drafts) + 1
        rows += range(start, start + width)
        if grammar.starts_inside(drafts):
            # the grammar starts inside this window (a reasoning block ends): walked here, position by position
            grammar.fill_window(bitmask, offset, drafts)
        elif grammar.active:
            (drafted if drafts else plain).append((grammar.matcher, offset, *([drafts] if drafts else [])))
        offset += width
    _fill_parallel(constrained[0][0].executor, bitmask, plain, drafted)
    allowed = unpack_bitmask(bitmask.to(logits.device, non_blocking=True), vocab)
    index = torch.tensor(rows, dtype=torch.long)
    index = (index.pin_memory() if pinned else index).to(logits.device, non_blocking=True)
    masked_rows = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy(0, index, masked_rows)


def _fill_parallel(executor, bitmask: torch.Tensor, plain: list[tuple], drafted: list[tuple]) -> None:
    """Masks of many matchers at once on llguidance's thread pool (the GIL released): `plain` (matcher, row)
    one position each, `drafted` (matcher, first row, drafts) a window each, walked and rolled back in the pool.
    Rows after a draft the grammar refuses are left as they are: nothing past that draft can be accepted.
    (llguidance.torch wraps the same calls but imports torch.compile, seconds of start-up in the engine.)"""
    assert bitmask.dtype == torch.int32 and bitmask.is_contiguous() and not bitmask.is_cuda
    row_bytes = bitmask.shape[1] * bitmask.element_size()
    if plain:
        executor.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), row_bytes, bitmask.shape[0])
    if drafted:
        executor.unsafe_compute_mask_ptr_with_draft_token(drafted, bitmask.data_ptr(), row_bytes, bitmask.shape[0])


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 [rows, words] (bit b of word w: token 32 w + b) → bool [rows, vocab] (a view of one uint8 tensor)."""
    # little-endian words (x86, ARM, CUDA): byte k of word w holds tokens 32 w + 8 k .. 32 w + 8 k + 7, so the bytes
    # unpack in token order, one byte per token instead of four
    shifts = torch.arange(8, device=bitmask.device, dtype=torch.uint8)
    bits = (bitmask.view(torch.uint8)[:, :, None] >> shifts) & 1
    return bits.view(torch.bool).reshape(bitmask.shape[0], -1)[:, :vocab]
