"""A deterministic stand-in for `ModelRunner`: a tiny torch "model" whose logits depend on the whole history.

The next-token logits depend on the last two tokens *and* the sum of every token so far, so a wrong
`num_cached_tokens`, a rejected draft left in the cache, or rows mixed up between requests all change the
generated text. The KV cache is the token history itself, so the runner can check the engine's bookkeeping:
`forward` asserts each row's cached length and free KV, `accept` asserts every decode row is listed.
"""

from __future__ import annotations

import json
import logging
import os
import time

import torch

from lightllm.cache.prefix import PrefixMatch
from lightllm.engine.batch import ForwardBatch, ForwardOutput

NUM_SUM_BUCKETS = 7


class FakeRunner:
    def __init__(
        self,
        vocab_size: int = 64,
        *,
        max_requests: int = 8,
        kv_tokens: int = 512,
        max_width: int = 1,
        mtp_step: int = 4,
        seed: int = 0,
        fail_token: int | None = None,
        nan_token: int | None = None,
        step_delay_s: float = 0.0,
    ):
        self.vocab_size = vocab_size
        self.max_width = max_width
        self.mtp_step = mtp_step
        self.kv_tokens = kv_tokens
        # a prompt holding fail_token makes the whole forward raise; nan_token gives its row NaN logits
        self.fail_token, self.nan_token = fail_token, nan_token
        # seconds each forward sleeps, so a test can act while a request is still running
        self.step_delay_s = step_delay_s
        g = torch.Generator().manual_seed(seed)
        dim = 16
        self.emb_last = torch.randn(vocab_size, dim, generator=g)
        self.emb_prev = torch.randn(vocab_size, dim, generator=g)
        self.emb_sum = torch.randn(NUM_SUM_BUCKETS, dim, generator=g)
        self.out = torch.randn(dim, vocab_size, generator=g) * 2.0
        self._free_handles = list(range(max_requests - 1, -1, -1))
        self.cache: dict[int, list[int]] = {}
        self._window_start: dict[int, int] = {}
        self.num_forwards = 0
        self.batches: list[ForwardBatch] = []

    # -- the model -------------------------------------------------------------------------------------------------
    def next_logits(self, history: list[int]) -> torch.Tensor:
        prev = history[-2] if len(history) > 1 else 0
        h = self.emb_last[history[-1]] + 0.5 * self.emb_prev[prev] + self.emb_sum[sum(history) % NUM_SUM_BUCKETS]
        return h @ self.out

    def greedy(self, prompt: list[int], num_tokens: int, logit_bias: dict[int, float] | None = None) -> list[int]:
        """Reference greedy continuation, one token at a time with no batching; `logit_bias` is added to every
        position's logits first."""
        bias = torch.zeros(self.vocab_size)
        for token, value in (logit_bias or {}).items():
            bias[token] = value
        ids = list(prompt)
        for _ in range(num_tokens):
            ids.append(int(torch.argmax(self.next_logits(ids) + bias)))
        return ids[len(prompt) :]

    # -- ModelRunnerProtocol ---------------------------------------------------------------------------------------
    def add_request(self, prefix: list[int] | None = None, namespace: bytes = b"") -> int:
        assert self._free_handles, "add_request without a free slot"
        handle = self._free_handles.pop()
        self.cache[handle] = []
        return handle

    def num_tokens(self, handle: int) -> int:
        return len(self.cache[handle])

    def match_prefix(self, token_ids: list[int], namespace: bytes = b"") -> PrefixMatch:
        return PrefixMatch()

    def publish(self, handle: int, token_ids: list[int]) -> None:
        assert self._window_start == {}, "publish() between forward and accept"
        assert token_ids == self.cache[handle], "publish() of tokens that are not the committed ones"

    def publish_many(self, entries: list[tuple[int, list[int]]]) -> None:
        # as the runner's: a failed publish is logged and the others go on
        for handle, token_ids in entries:
            try:
                self.publish(handle, token_ids)
            except Exception:
                logging.getLogger(__name__).exception("publish of %d failed", handle)

    def free_request(self, handle: int) -> None:
        assert handle in self.cache, f"double free of handle {handle}"
        del self.cache[handle]
        self._window_start.pop(handle, None)
        self._free_handles.append(handle)

    def num_free_requests(self) -> int:
        return len(self._free_handles)

    def num_free_kv_tokens(self) -> int:
        return self.kv_tokens - sum(len(c) for c in self.cache.values())

    def bytes_per_request(self) -> int:
        # the fake model keeps its history in Python lists: no device state
        return 0

    def prefix_cache_stats(self) -> dict[str, int] | None:
        return None

    def stats(self) -> dict[str, int | None]:
        return {"num_folds": None}

    def export_request(self, handle: int, pack=None):
        raise NotImplementedError("the fake runner has no state to hand off")

    def import_request(self, state, region=None, namespace: bytes = b"") -> int:
        raise NotImplementedError("the fake runner has no state to take over")

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        self.num_forwards += 1
        self.batches.append(batch)
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        need = sum(batch.query_lens)
        assert need <= self.num_free_kv_tokens(), f"forward needs {need} KV tokens, {self.num_free_kv_tokens()} free"
        assert self._window_start == {}, "accept() was not called after the previous decode step"
        ids = batch.input_ids.tolist()
        if batch.decode_input_ids is not None:
            # decode rows' first tokens from the device tensor (the host's copy is stale under overlap)
            starts = [sum(batch.query_lens[:row]) for row in range(batch.num_prefill_rows, batch.num_rows)]
            for start, token in zip(starts, batch.decode_input_ids.tolist()):
                ids[start] = token
        if batch.decode_draft_ids is not None:
            # drafts the host has not read: their places in `input_ids` are placeholders
            starts = [sum(batch.query_lens[:row]) for row in range(batch.num_prefill_rows, batch.num_rows)]
            for start, row in zip(starts, batch.decode_draft_ids.tolist()):
                for j, token in enumerate(row):
                    if token >= 0:
                        ids[start + 1 + j] = token
        if self.fail_token is not None and self.fail_token in ids:
            raise RuntimeError("fake runner failure")
        logits, hidden, offset = [], [], 0
        # every position of the prefill rows that ask (prompt log-probabilities), with per-row cumulative starts
        prompt_logits, prompt_offsets = [], [0]
        for row, (handle, n, cached) in enumerate(zip(batch.req_handles, batch.query_lens, batch.num_cached_tokens)):
            cache = self.cache[handle]
            assert cached == len(cache), f"row {row}: engine says {cached} cached tokens, runner holds {len(cache)}"
            new = ids[offset : offset + n]
            offset += n
            is_prefill = row < batch.num_prefill_rows
            if not is_prefill:
                self._window_start[handle] = len(cache)
            cache.extend(new)
            if is_prefill and batch.prefill_prompt_logits:
                if batch.prefill_prompt_logits[row]:
                    prompt_logits += [self.next_logits(cache[: p + 1]) for p in range(len(cache) - n, len(cache))]
                prompt_offsets.append(len(prompt_logits))
            positions = [len(cache) - 1] if is_prefill else range(len(cache) - n, len(cache))
            if is_prefill and not batch.prefill_is_last_chunk[row]:
                positions = []
            for p in positions:
                row_logits = self.next_logits(cache[: p + 1])
                if self.nan_token is not None and self.nan_token in cache:
                    row_logits = torch.full_like(row_logits, float("nan"))
                logits.append(row_logits)
                hidden.append(torch.tensor([float(sum(cache[: p + 1])), float(cache[p])]))
        if not logits:
            out = ForwardOutput(torch.empty(0, self.vocab_size), torch.empty(0, 2))
        else:
            out = ForwardOutput(torch.stack(logits), torch.stack(hidden))
        if prompt_logits:
            out.prompt_logits, out.prompt_logits_offsets = torch.stack(prompt_logits), prompt_offsets
        return out

    def accept(self, handles: list[int], num_accepted: list[int]) -> None:
        assert sorted(handles) == sorted(self._window_start), "accept must list every decode row of the step"
        for handle, n in zip(handles, num_accepted):
            start = self._window_start.pop(handle)
            assert 1 <= n <= len(self.cache[handle]) - start, (
                f"accepted {n} of a {len(self.cache[handle]) - start} window"
            )
            del self.cache[handle][start + n :]

    def draft(self, handles: list[int], next_tokens: torch.Tensor, mtp_step: int) -> torch.Tensor:
        """Greedy chain after each request's accepted history, wrong whenever (position + step) % 3 == 0."""
        assert self._window_start == {}, "draft() before accept()"
        rows = []
        for handle, token in zip(handles, next_tokens.tolist()):
            history = [*self.cache[handle], token]
            pos = len(history) - 1
            drafts = []
            for step in range(mtp_step):
                guess = int(torch.argmax(self.next_logits(history)))
                if (pos + step) % 3 == 0:
                    guess = (guess + 1) % self.vocab_size
                drafts.append(guess)
                history.append(guess)
            rows.append(drafts)
        return torch.tensor(rows, dtype=torch.long).reshape(len(rows), mtp_step)


def create_fake_runner(args, model_info) -> FakeRunner:
    """Runner factory with the server's signature: sizes come from ServerArgs and the checkpoint's config.

    A checkpoint's config.json may set `fake_fail_token` / `fake_nan_token` to inject failures and
    `fake_step_delay_s` to slow every step down.
    """
    with open(os.path.join(args.model_dir, "config.json")) as f:
        config = json.load(f)
    return FakeRunner(
        model_info.vocab_size,
        max_requests=args.max_running_requests,
        kv_tokens=args.max_total_token_num or 4096,
        max_width=max(args.mtp_step, args.spec_ngram) + 1,
        fail_token=config.get("fake_fail_token"),
        nan_token=config.get("fake_nan_token"),
        step_delay_s=config.get("fake_step_delay_s", 0.0),
    )
