"""Constrained decoding: each request with a grammar (SamplingParams.grammar, llguidance's format) owns a matcher,
and every logits row the step samples or verifies for it is masked to the tokens the grammar allows there.

Under speculation a window `[last, d_1, ..., d_k]` needs k + 1 masks: position j's mask is the grammar's state
after the drafts before it. The matcher walks the drafts to compute them and is rolled back; a draft the grammar
refuses ends the walk (its own position is masked against it, so it is rejected, and nothing after it can be
accepted). Only the tokens the window emits advance the matcher. A stopped grammar allows only EOS.

The vocabulary (llguidance's tokenizer: every token's bytes, and the EOS ids) is built from the tokenizer folder
named in the request by a loader the engine is given (the server's reads Hugging Face and tiktoken folders), once
per folder and EOS set; `GrammarBackend.preload` builds it at start-up.

The masks themselves (host bitmasks, llguidance's pool, the kernel applying them, an overlapped step's deferred
masks) are `grammar_masks.py`'s.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

import torch

from lightllm.engine.grammar_masks import HostBitmasks, MaskJob, fill_parallel, mask_windows
from lightllm.kernels.token_bitmask import apply_token_bitmask, unpack_bitmask

__all__ = [
    "CompilingRequests",
    "GrammarBackend",
    "HostBitmasks",
    "MaskJob",
    "RequestGrammar",
    "attach",
    "advance",
    "advance_many",
    "mask_windows",
    "unpack_bitmask",
]

if TYPE_CHECKING:
    from lightllm.engine.request import Request

# (tokenizer folder, logits width, EOS ids) -> llguidance.LLTokenizer
VocabularyLoader = Callable[[str, int, tuple[int, ...]], object]
# background compiles of requests' matchers (each releases the GIL; one takes about a millisecond, a large schema
# much longer)
COMPILE_THREADS = 2
# compiled at preload: the first matcher and mask of a vocabulary build llguidance's lazy structures
_WARM_GRAMMAR = '{"grammars": [{"json_schema": {"type": "object"}}]}'


def mask_threads() -> int:
    """The size of llguidance's pool: 3/8 of the cores this process may run on, at most 8 (llguidance's own default
    is 80%). Its threads spin for a while after each call, on cores the step's thread needs while it launches the
    next forward: on a 16-core host, cheap masks at batch 64 took as long on 6 threads as on 12, and the step ran
    steadily at 6 (2.2-2.3 ms) where at 12 it swung between 2.3 and 3.3 ms."""
    return max(1, min(8, len(os.sched_getaffinity(0)) * 3 // 8))


class RequestGrammar:
    """One request's matcher. `start_token`: the grammar applies after this token (a reasoning block's end);
    until it is generated the output is free but for its stop tokens (`stop_ids`): an output that ended inside the
    reasoning would never reach its grammar. `matcher` may be given as a future of a compile still running in the
    background (it is first needed at the request's first sampled token, after its prefill)."""

    def __init__(
        self,
        matcher,
        start_token: int | None,
        executor,
        host_masks: HostBitmasks | None = None,
        stop_ids: tuple[int, ...] = (),
    ):
        self._matcher = matcher
        self.start_token = start_token
        self.stop_ids = tuple(stop_ids)
        # llguidance's thread pool and the step's bitmask buffers, shared by the backend's matchers
        self.executor = executor
        self.host_masks = host_masks if host_masks is not None else HostBitmasks()
        self.active = start_token is None

    @property
    def matcher(self):
        if isinstance(self._matcher, Future):
            self._matcher = self._matcher.result()
        return self._matcher

    @property
    def compiling(self) -> Future | None:
        """The matcher's compile while it has not been taken (None once the matcher is at hand)."""
        return self._matcher if isinstance(self._matcher, Future) else None

    @property
    def ready(self) -> bool:
        """Whether the matcher's compile has ended (compiled or failed)."""
        return self.compiling is None or self.compiling.done()

    def compile_error(self) -> str | None:
        """Why the grammar did not compile, None when it compiled (waits for a compile still running)."""
        if isinstance(self._matcher, Future):
            error = self._matcher.exception()
            if error is not None:
                return str(error)
            self._matcher = self._matcher.result()
        return None

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
            else:
                self.hold_stop(bitmask, first_row + j, 1)
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

    def hold_stop(self, bitmask: torch.Tensor, first_row: int, rows: int) -> None:
        """Clear the stop tokens' bits in `rows` rows of `bitmask` from `first_row` (positions before the grammar
        starts: the output may not end there)."""
        for token in self.stop_ids:
            word, bit = divmod(token, 32)
            if word < bitmask.shape[1]:
                # ~(1 << bit) as an int32 (bit 31 is the sign)
                keep = ~(1 << bit) if bit < 31 else (1 << 31) - 1
                bitmask[first_row : first_row + rows, word] &= keep

    def advance(self, token_ids: list[int]) -> str | None:
        """Consume the emitted tokens; an error message if the grammar refuses one (a masking bug)."""
        for token in token_ids:
            if not self.active:
                self.active = token == self.start_token
                continue
            if not self.matcher.consume_token(token):
                return self._refused(token)
        return None

    def _refused(self, token: int) -> str:
        return f"token {token} left the grammar: {self.matcher.get_error()}"


class GrammarBackend:
    """Matchers for requests; vocabularies built per tokenizer folder and EOS set by `load_vocabulary`, on first use
    or at `preload`. Without a loader, requests with a grammar fail (an engine built without one).

    Every request compiles its own matcher. llguidance's copies of one compiled matcher share its lexer behind one
    lock, so the masks of copies computed on the pool run one at a time (on a 16-core host, 64 copies took as long
    on 12 threads as on one, while 64 separate compiles ran 3.8x faster). Every compile runs on a background thread
    (llguidance releases the GIL), so a new or large schema never stalls the steps of the other requests; the
    engine holds a request whose compile is running out of the queue (`CompilingRequests`) and fails it if the
    grammar does not compile."""

    def __init__(self, vocab_size: int, load_vocabulary: VocabularyLoader | None = None):
        self.vocab_size = vocab_size
        self._load_vocabulary = load_vocabulary
        self._executor = None
        self._compiler: ThreadPoolExecutor | None = None
        self._host_masks = HostBitmasks()
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

    def add_vocabulary(self, tokenizer_dir: str, eos_ids: tuple[int, ...], tokenizer) -> None:
        """A vocabulary built elsewhere (llguidance.LLTokenizer, `vocab_size` wide) for the folder and EOS set, as
        the loader would have built it."""
        self._tokenizers[(tokenizer_dir, tuple(eos_ids))] = tokenizer

    def _executor_pool(self):
        if self._executor is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor(mask_threads())
        return self._executor

    def preload(self, tokenizer_dir: str, eos_ids: list[int], device: str | None = None) -> None:
        """Build a vocabulary, the mask thread pool, and one matcher and mask over them now (at start-up), and on a
        GPU `device` compile the masking kernel (fp32 logits) and find out whether the device can wait for masks
        still being computed (`grammar_masks.MaskJob`), so the first constrained request does not pay for them
        inside a step."""
        grammar = self.matcher(_WARM_GRAMMAR, None, tokenizer_dir, eos_ids)
        bitmask = torch.zeros((1, (self.vocab_size + 31) // 32), dtype=torch.int32)
        fill_parallel(grammar.executor, bitmask, [(grammar.matcher, 0)], [])
        if not bitmask.any():
            raise ValueError(f"{tokenizer_dir}: the grammar vocabulary allows no token where JSON starts")
        if device is not None and torch.device(device).type == "cuda":
            logits = torch.zeros((1, self.vocab_size), dtype=torch.float32, device=device)
            apply_token_bitmask(logits, bitmask.to(device))
            self._host_masks.device_wait_works(torch.device(device))

    def matcher(self, grammar: str, start_token: int | None, tokenizer_dir: str, eos_ids: list[int]) -> RequestGrammar:
        """A fresh matcher of `grammar`, compiling in the background (`RequestGrammar.ready`, `compile_error`);
        raises ValueError naming the problem when the vocabulary cannot be built."""
        if not tokenizer_dir:
            raise ValueError("a request with a grammar must name its tokenizer folder")
        tokenizer = self._tokenizer(tokenizer_dir, tuple(eos_ids))
        if self._compiler is None:
            self._compiler = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
        matcher = self._compiler.submit(_compile, tokenizer, grammar)
        return RequestGrammar(matcher, start_token, self._executor_pool(), self._host_masks, tuple(eos_ids))


def _compile(tokenizer, grammar: str):
    from llguidance import LLMatcher

    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise ValueError(f"the grammar does not compile: {matcher.get_error()}")
    return matcher


class CompilingRequests:
    """Requests whose grammar is still compiling, in arrival order: the engine queues each once its compile has
    ended, or fails it when the grammar did not compile."""

    def __init__(self):
        self._reqs: list[Request] = []

    def __len__(self) -> int:
        return len(self._reqs)

    def add(self, req: Request) -> None:
        self._reqs.append(req)

    def discard(self, req: Request) -> None:
        if req in self._reqs:
            self._reqs.remove(req)

    def wait(self, timeout: float) -> None:
        """Until one compile ends or `timeout` seconds pass (the engine has nothing else to run)."""
        futures = [r.grammar.compiling for r in self._reqs if r.grammar.compiling is not None]
        if futures:
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def take_done(self) -> list[tuple[Request, str | None]]:
        """The requests whose compile has ended, in arrival order, each with the compile's error or None."""
        done = [r for r in self._reqs if r.grammar.ready]
        self._reqs = [r for r in self._reqs if r not in done]
        return [(r, r.grammar.compile_error()) for r in done]


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


def compile_error(req: Request) -> str | None:
    """Why the request's grammar did not compile, waiting for the compile (for a request that enters the running
    batch at once, as an imported one does); None without a grammar or when it compiled."""
    return req.grammar.compile_error() if req.grammar is not None else None


def advance(req: Request, token_ids: list[int]) -> str | None:
    """Move the request's matcher over the tokens it emits; an error message when the grammar refuses one."""
    return req.grammar.advance(token_ids) if req.grammar is not None else None


def advance_many(steps: list[tuple[RequestGrammar, int]]) -> list[str | None]:
    """`RequestGrammar.advance` of one token for each (grammar, token), the active matchers moved together in one
    call on llguidance's pool (which releases the GIL: the step's thread runs meanwhile); each an error message or
    None."""
    errors: list[str | None] = [None] * len(steps)
    active = []
    for k, (g, token) in enumerate(steps):
        if g.active:
            active.append(k)
        else:
            g.active = token == g.start_token
    if active:
        executor = steps[active[0]][0].executor
        consumed = executor.consume_token_par([(steps[k][0].matcher, steps[k][1]) for k in active])
        for k, ok in zip(active, consumed):
            if not ok:
                errors[k] = steps[k][0]._refused(steps[k][1])
    return errors
