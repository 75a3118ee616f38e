"""The engine loop: schedule → forward → sample/verify → accept → emit. Transport-free and text-free.

Keep this file minimal: features (speculation strategies, scheduling policy, sampling) live in their own modules
and are chosen at start-up. The engine never looks at the state mode; every state decision goes through the
runner (`forward`, `accept`, `free_request`).

Overlap scheduling (a step left in flight while the host reads the one before and plans the next) is
`overlap.py`; MTP verify steps left in flight the same way are `spec_overlap.py`.
"""

from __future__ import annotations

import logging

import torch

from lightllm.engine import grammar
from lightllm.engine.batch import ForwardBatch, ForwardOutput, ModelRunnerProtocol
from lightllm.engine.logits_check import NONFINITE_LOGITS_ERROR, nonfinite_rows
from lightllm.engine.messages import (
    MAX_PRIORITY,
    MIN_PRIORITY,
    EngineOutput,
    EngineStats,
    Finished,
    NewRequest,
    TokenChunk,
)
from lightllm.engine.overlap import OverlapScheduler, chained_plan
from lightllm.engine.publish_queue import PublishQueue
from lightllm.engine.request import Request, Status
from lightllm.engine.sampler import (
    RowContext,
    Sampler,
    allowed_mask,
    bad_word_bans,
    compute_logprobs,
    token_ranks,
)
from lightllm.engine.scheduler import SchedulePlan, Scheduler
from lightllm.engine.speculative import create_speculator
from lightllm.engine.speculative.acceptance import SimulatedAcceptance
from lightllm.engine.speculative.device_drafts import decode_draft_ids, host_drafts
from lightllm.engine.speculative.verify import WindowResult, verify_greedy_windows, verify_window
from lightllm.engine.thinking_budget import forced_end_token

logger = logging.getLogger(__name__)

# the longest an idle step waits for a grammar compile before it returns to the loop (which calls it again)
COMPILE_WAIT_S = 0.005


class Engine:
    def __init__(
        self,
        runner: ModelRunnerProtocol,
        *,
        max_running_requests: int,
        chunked_prefill_size: int,
        max_req_total_len: int,
        mtp_step: int = 0,
        spec_ngram: int = 0,
        seed: int = 0,
        state_mode: str | None = None,
        prefix_cache_checkpoint_interval: int = 0,
        overlap_schedule: bool = False,
        short_resume_tokens: int = 0,
        acceptance: SimulatedAcceptance | None = None,
        max_num_batched_tokens: int | None = None,
        max_mixed_prefill_tokens: int | None = None,
        mixed_prefill_chunk: int | None = None,
        grammar_vocabulary: grammar.VocabularyLoader | None = None,
    ):
        self.runner = runner
        # only labels the state-memory statistic; the engine never acts on the mode
        self.state_mode = state_mode
        self.max_req_total_len = max_req_total_len
        self.speculator = create_speculator(mtp_step, spec_ngram)
        # None: the model decides which drafts stay (`_verify`); benchmarks may simulate it instead
        self.acceptance = acceptance
        max_width = min(runner.max_width, self.speculator.num_drafts + 1)
        self.scheduler = Scheduler(
            runner,
            max_running_requests,
            max_num_batched_tokens or chunked_prefill_size,
            max_width,
            prefix_cache_checkpoint_interval,
            short_resume_tokens,
            chunked_prefill_size=chunked_prefill_size,
            mixed_prefill_tokens=max_mixed_prefill_tokens,
            mixed_prefill_chunk=mixed_prefill_chunk,
        )
        self.sampler = Sampler(seed)
        # None: requests with a grammar fail (the server passes its loader of tokenizer folders)
        self.grammars = grammar.GrammarBackend(runner.vocab_size, grammar_vocabulary)
        self.requests: dict[str, Request] = {}
        # True between a forward with decode rows and its accept (so a failure in between can settle the runner)
        self.awaiting_accept = False
        self.stats = EngineStats(accepted_length_counts=[0] * max_width)
        # with drafts only the MTP head's run overlapped (spec_overlap.py): n-gram drafts are read on the host
        self.overlap_schedule = overlap_schedule and (self.speculator.num_drafts == 0 or self.runner.mtp_step > 0)
        self.overlap = OverlapScheduler(self)
        # a step's prefix-cache publishes, run by the next step() call (see publish_queue.py)
        self._publishes = PublishQueue(self.scheduler, runner)
        self._in_step = False
        # requests whose grammar is still compiling: queued once it has compiled
        self._compiling = grammar.CompilingRequests()
        if max_req_total_len > self.scheduler.kv_capacity:
            raise ValueError(
                f"max_req_total_len={max_req_total_len} exceeds the KV cache ({self.scheduler.kv_capacity} tokens): "
                "lower --max_req_total_len or give the KV cache more memory (--max_total_token_num / --mem_fraction)"
            )

    def capacity_report(self) -> str:
        """How many requests can run at once and which resource limits it."""
        limits = {
            "linear-state slots": self.runner.num_free_requests(),
            "--max_running_requests": self.scheduler.max_running_requests,
            f"KV tokens ({self.scheduler.kv_capacity}) / max_req_total_len ({self.max_req_total_len})": (
                self.scheduler.kv_capacity // self.max_req_total_len
            ),
        }
        binding = min(limits, key=limits.get)
        parts = ", ".join(f"{k}: {v}" for k, v in limits.items())
        per_request = self.runner.bytes_per_request()
        parts += f"; linear state {per_request / 2**20:.2f} MiB per request ({self.state_mode or 'state'})"
        prefix = self.runner.prefix_cache_stats()
        if prefix:
            parts += (
                f"; prefix cache: {prefix['checkpoint_capacity_bytes'] / 2**20:.2f} MiB for "
                f"{prefix['checkpoint_capacity_bytes'] // max(prefix['bytes_per_checkpoint'], 1)} state checkpoints "
                f"of {prefix['bytes_per_checkpoint'] / 2**20:.3f} MiB"
            )
        return (
            f"up to {min(limits['linear-state slots'], limits['--max_running_requests'])} concurrent requests "
            f"({parts}); {limits[binding]} full-length requests fit at once, limited by {binding}; "
            "shorter requests share the KV cache and are preempted (recomputed) if it runs out"
        )

    def has_work(self) -> bool:
        return self._has_steps() or bool(self._compiling)

    def _has_steps(self) -> bool:
        return self.overlap.has_work() or bool(self._publishes) or self.scheduler.has_work()

    def add_request(self, msg: NewRequest) -> list[EngineOutput]:
        """Queue a request. Invalid ones finish at once with reason "error" (the front-end validates first)."""
        error = self._check(msg)
        if error is not None:
            return [Finished(msg.req_id, "error", num_prompt_tokens=len(msg.prompt_ids), error=error)]
        req = Request.from_message(msg, self.max_req_total_len)
        error = grammar.attach(self.grammars, req, msg)
        if error is not None:
            return [Finished(msg.req_id, "error", num_prompt_tokens=len(msg.prompt_ids), error=error)]
        req.checkpoint_hints = sorted({h for h in msg.checkpoint_hints if 0 < h < len(req.prompt_ids)})
        self.requests[req.req_id] = req
        if req.grammar is not None and not req.grammar.ready:
            self._compiling.add(req)
        else:
            self.scheduler.add(req)
        return []

    def abort(self, req_id: str) -> list[EngineOutput]:
        req = self.requests.get(req_id)
        return self.finish(req, "abort") if req is not None else []

    def step(self) -> list[EngineOutput]:
        """Run one model step over the scheduled batch; returns the tokens and finishes it produced (with overlap,
        those of the step launched by the previous call)."""
        self._in_step = True
        try:
            return self._step()
        finally:
            self._in_step = False

    def _step(self) -> list[EngineOutput]:
        outputs = self.overlap.take_failed() + self._queue_compiled()
        due = self._publishes.take()
        inflight = self.overlap.take_inflight()
        plan = None
        if inflight is not None:
            # an overlapped step has no drafts: its publishes wait for nothing
            self._publishes.run(due)
            due = []
            if self.overlap.can_chain(inflight):
                return outputs + self.overlap.launch(chained_plan(inflight), inflight)
            plan = self.overlap.schedule_ahead(inflight)
            if plan is not None:
                outputs += self._finish_unfittable(plan)
                if not plan.is_empty and self.overlap.can_launch(plan):
                    return outputs + self.overlap.launch(plan, inflight)
            outputs += self.overlap.complete(inflight)
            if plan is not None:
                # planned before the read-back: rows whose request finished there drop out
                plan.prefill = [row for row in plan.prefill if not row.req.is_finished]
                plan.decode = [row for row in plan.decode if not row.req.is_finished]
                if plan.is_empty:
                    plan = None
        if plan is None:
            outputs += self._propose()
            # after the drafts: the MTP head's KV they commit is the part of a publish that costs a forward
            self._publishes.run(due)
            plan = self.scheduler.schedule()
            outputs += self._finish_unfittable(plan)
        if plan.is_empty:
            return outputs
        if self.overlap.can_launch(plan):
            return outputs + self.overlap.launch(plan, None)
        self.stats.num_steps += 1
        self.awaiting_accept = False
        try:
            fwd = self.runner.forward(self.build_batch(plan))
            self.awaiting_accept = bool(plan.decode)
            outputs += self._process(plan, fwd)
            self.queue_prefill_checkpoints(plan)
        except Exception:
            # the failure cannot be pinned on one row: every request of the batch finishes, the loop goes on
            logger.exception("engine step failed; finishing %d requests with an error", len(plan.rows))
            self.settle_runner(plan)
            for row in plan.rows:
                if not row.req.is_finished:
                    # clients see a message; the exception and its traceback are in the engine log
                    outputs += self.finish(row.req, "error", error="the model step failed (see the engine log)")
        return outputs

    def _queue_compiled(self) -> list[EngineOutput]:
        """Queue the requests whose grammar has compiled and fail those whose grammar did not compile; with no
        other work, wait a little for a compile instead of returning at once (the loop would spin)."""
        if not self._compiling:
            return []
        if not self._has_steps():
            self._compiling.wait(COMPILE_WAIT_S)
        outputs: list[EngineOutput] = []
        for req, error in self._compiling.take_done():
            if error is None:
                self.scheduler.add(req)
            else:
                outputs += self.finish(req, "error", error=error)
        return outputs

    def _finish_unfittable(self, plan: SchedulePlan) -> list[EngineOutput]:
        outputs: list[EngineOutput] = []
        for req in plan.unfittable:
            outputs += self.finish(req, "error", error=f"{req.num_tokens} tokens do not fit in the KV cache")
        plan.unfittable = []
        return outputs

    def _propose(self) -> list[EngineOutput]:
        """Drafts for the running requests' next windows (MTP drafts those that got a token in the last step)."""
        reqs = [r for r in self.scheduler.running if not r.is_prefilling]
        try:
            self.speculator.propose(reqs)
        except Exception:
            # the MTP head ran for the requests that got a token in the last step: which one failed is unknown
            logger.exception("drafting failed; finishing %d requests with an error", len(reqs))
            return [
                o for req in reqs for o in self.finish(req, "error", error="the model step failed (see the engine log)")
            ]
        return []

    def fail_rows(self, plan: SchedulePlan) -> list[EngineOutput]:
        outputs: list[EngineOutput] = []
        for row in plan.rows:
            if not row.req.is_finished:
                outputs += self.finish(row.req, "error", error="the model step failed (see the engine log)")
        return outputs

    def queue_prefill_checkpoints(self, plan: SchedulePlan) -> None:
        """Queue for the prefix cache the prefill rows (committed, after the step) that stand where a checkpoint
        is due; rows that finished are queued by their finish."""
        for row in plan.prefill:
            req = row.req
            if req.handle is not None and not req.is_finished and self.scheduler.is_checkpoint_due(req):
                self._publishes.checkpoint(req)

    def publish_now(self, reqs: list[Request]) -> None:
        """Run the queued publishes of `reqs` now (a request leaving the engine with its state: a PD hand-off)."""
        self._publishes.run_now(reqs)

    def settle_runner(self, plan: SchedulePlan) -> None:
        """After a failure between forward and accept, close the runner's pending verify so it can step again."""
        if not self.awaiting_accept:
            return
        self.awaiting_accept = False
        try:
            self.runner.accept([row.req.handle for row in plan.decode], [1] * len(plan.decode))
        except Exception:
            logger.exception("could not settle the runner after a failed step")

    def fail_all(self, error: str) -> list[EngineOutput]:
        """Finish every queued and running request with an error (last resort after an unexpected fault)."""
        outputs: list[EngineOutput] = []
        for req in list(self.requests.values()):
            outputs += self.finish(req, "error", error=error)
        return outputs

    def snapshot(self) -> EngineStats:
        s = self.stats
        # a request whose grammar is still compiling waits too
        s.num_waiting = len(self.scheduler.waiting) + len(self._compiling)
        s.num_running = len(self.scheduler.running)
        s.num_free_kv_tokens = self.runner.num_free_kv_tokens()
        s.num_free_state_slots = self.runner.num_free_requests()
        s.num_preemptions = self.scheduler.num_preemptions
        if self.state_mode:
            s.state_pool_bytes = {
                self.state_mode: self.runner.bytes_per_request() * self.scheduler.max_running_requests
            }
        s.num_folds = self.runner.stats()["num_folds"]
        prefix = self.runner.prefix_cache_stats()
        if prefix:
            s.prefix_cache_queried_tokens = prefix["num_queried_tokens"]
            s.prefix_cache_hit_tokens = prefix["num_hit_tokens"]
            s.prefix_cache_host_hit_tokens = prefix.get("host_hit_tokens", 0)
            s.prefix_cache_host_entries_written = prefix.get("host_entries_written", 0)
            s.prefix_cache_host_entries_skipped = prefix.get("host_entries_skipped", 0)
            s.prefix_cache_checkpoints_stored = prefix["num_checkpoints_stored"]
            s.prefix_cache_checkpoints_evicted = prefix["num_checkpoints_evicted"]
            s.prefix_cache_checkpoint_bytes = prefix["checkpoint_bytes"]
            s.prefix_cache_tokens = prefix["num_cached_tokens"]
        return s

    def _check(self, msg: NewRequest) -> str | None:
        n = len(msg.prompt_ids)
        if msg.req_id in self.requests:
            return f"duplicate request id {msg.req_id!r}"
        if n == 0:
            return "empty prompt"
        if n >= self.max_req_total_len:
            return f"prompt has {n} tokens; max_req_total_len={self.max_req_total_len} leaves no room to generate"
        if not (isinstance(msg.priority, int) and MIN_PRIORITY <= msg.priority <= MAX_PRIORITY):
            return f"priority must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}]"
        if min(msg.prompt_ids) < 0 or max(msg.prompt_ids) >= self.runner.vocab_size:
            return f"prompt token ids must be in [0, {self.runner.vocab_size})"
        try:
            # params are mutable and the engine has callers besides the HTTP front-end: a bad knob found here
            # fails this request alone instead of the engine step of its whole batch
            msg.params.validate()
        except ValueError as exc:
            return str(exc)
        problem = msg.params.vocab_problem(self.runner.vocab_size)
        return problem[0] if problem is not None else None

    def build_batch(self, plan: SchedulePlan) -> ForwardBatch:
        ids: list[int] = []
        for row in plan.prefill:
            start = row.req.num_computed_tokens
            ids += row.req.all_ids[start : start + row.num_tokens]
        for row in plan.decode:
            ids.append(row.req.last_token_id)
            if row.draft_ids:
                ids += host_drafts(row.draft_ids)
        rows = plan.rows
        asks = [self.asks_prompt_logits(row.req, row.num_tokens) for row in plan.prefill]
        return ForwardBatch(
            req_handles=[row.req.handle for row in rows],
            query_lens=[row.num_tokens for row in rows],
            num_cached_tokens=[row.req.num_computed_tokens for row in rows],
            num_prefill_rows=len(plan.prefill),
            input_ids=torch.tensor(ids, dtype=torch.long),
            prefill_is_last_chunk=[
                row.req.num_computed_tokens + row.num_tokens == row.req.num_prefill_tokens for row in plan.prefill
            ],
            prefill_prompt_logits=asks if any(asks) else [],
            decode_draft_ids=decode_draft_ids([row.draft_ids for row in plan.decode]),
        )

    @staticmethod
    def asks_prompt_logits(req: Request, num_tokens: int) -> bool:
        """Whether a prefill chunk of `num_tokens` holds positions whose prompt log-probabilities are still due: the
        logits at position j score prompt token j + 1, and a recompute after a preemption inside the prefill passes
        over the positions gathered before it."""
        if not req.needs_prompt_logprobs:
            return False
        start = req.num_computed_tokens
        return max(start, len(req.prompt_logprobs)) < min(start + num_tokens, len(req.prompt_ids) - 1)

    def _process(self, plan: SchedulePlan, fwd: ForwardOutput) -> list[EngineOutput]:
        # (request, first logits row, window width, drafts) for every row that produces tokens this step
        windows: list[tuple[Request, int, int, list[int]]] = []
        num_logit_rows = 0
        offsets = fwd.prompt_logits_offsets
        for i, row in enumerate(plan.prefill):
            if fwd.prompt_logits is not None and offsets[i] < offsets[i + 1]:
                self._gather_prompt_logprobs(row.req, fwd.prompt_logits[offsets[i] : offsets[i + 1]])
            row.req.num_computed_tokens += row.num_tokens
            if not row.req.is_prefilling:
                windows.append((row.req, num_logit_rows, 1, []))
                num_logit_rows += 1
        num_prefill_windows = len(windows)
        for row in plan.decode:
            windows.append((row.req, num_logit_rows, row.num_tokens, row.draft_ids))
            num_logit_rows += row.num_tokens
        logits = fwd.logits
        assert logits.shape[0] == num_logit_rows, (
            f"runner gave {logits.shape[0]} logits rows, expected {num_logit_rows}"
        )
        # a grammar masks every position the step verifies, drafts included, before acceptance
        results = self._verify(windows, grammar.mask_windows(windows, logits))
        if plan.decode:
            decode = list(zip(windows[num_prefill_windows:], results[num_prefill_windows:]))
            accepted = [result.num_accepted if result is not None else 1 for _, result in decode]
            self.runner.accept([req.handle for (req, *_), _ in decode], accepted)
            self.awaiting_accept = False
            for ((req, *_), _), num in zip(decode, accepted):
                req.num_computed_tokens += num
        outputs: list[EngineOutput] = []
        hidden_rows: list[tuple[Request, int]] = []
        for i, ((req, start, _, drafts), result) in enumerate(zip(windows, results)):
            if result is None:
                outputs += self.finish(req, "error", error=NONFINITE_LOGITS_ERROR)
                continue
            if i >= num_prefill_windows and self.speculator.num_drafts:
                self._record_window(len(drafts), result)
            outputs += self.emit(req, result.token_ids, logits, start)
            hidden_rows.append((req, start + result.num_accepted - 1))
        self.speculator.after_step(self.runner, hidden_rows, fwd.hidden)
        return outputs

    @staticmethod
    def _gather_prompt_logprobs(req: Request, logits: torch.Tensor) -> None:
        """Score the prompt tokens that follow the chunk's positions (`logits` [chunk length, V], the chunk starting
        at `req.num_computed_tokens`), skipping the ones already gathered."""
        start, done = req.num_computed_tokens, len(req.prompt_logprobs)
        if start > done:
            # positions the runner never computed here (resumed, not prefilled) stay unscored: null entries
            req.prompt_logprobs += [None] * (start - done)
            req.prompt_top_logprobs += [None] * (start - done)
            req.prompt_ranks += [None] * (start - done)
            done = start
        end = min(start + logits.shape[0], len(req.prompt_ids) - 1)
        if end <= done:
            return
        rows, scored = logits[done - start : end - start], req.prompt_ids[done + 1 : end + 1]
        lps, tops = compute_logprobs(rows, scored, req.params.prompt_logprobs)
        req.prompt_logprobs += lps
        req.prompt_top_logprobs += tops
        req.prompt_ranks += token_ranks(rows, scored)

    def _verify(
        self, windows: list[tuple[Request, int, int, list[int]]], logits: torch.Tensor
    ) -> list[WindowResult | None]:
        """Tokens per window; None for a window whose logits hold a NaN (that request fails alone)."""
        if not windows:
            return []
        if self.acceptance is not None:
            return self.acceptance.verify(windows, logits, self.sampler, self.row_context)
        if all(req.params.takes_raw_argmax for req, *_ in windows):
            return self._verify_greedy(windows, logits)
        # sampled verification walks the drafts on the host
        windows = [(req, start, width, list(drafts)) for req, start, width, drafts in windows]
        contexts = [self.row_context(req, drafts[:j], logits.device) for req, _, w, drafts in windows for j in range(w)]
        probs = self.sampler.target_probs(logits, contexts)
        # one host transfer for the whole batch: greedy rows verify from these, NaN / +inf rows fail alone
        argmax = probs.argmax(dim=-1).tolist()
        has_nan = nonfinite_rows(logits).tolist()
        # windows without drafts (prefill ends, plain decode) sample in one batched draw
        single = [start for _, start, width, _ in windows if width == 1]
        drawn = dict(zip(single, self.sampler.draw_many(probs[single], [contexts[i] for i in single])))
        results: list[WindowResult | None] = []
        for _, start, width, drafts in windows:
            if any(has_nan[start : start + width]):
                results.append(None)
            elif width == 1:
                results.append(WindowResult([drawn[start]]))
            else:
                window = probs[start : start + width]
                results.append(
                    verify_window(self.sampler, window, drafts, contexts[start], argmax[start : start + width])
                )
        return results

    @staticmethod
    def _verify_greedy(
        windows: list[tuple[Request, int, int, list[int]]], logits: torch.Tensor
    ) -> list[WindowResult | None]:
        """`_verify` when every row is greedy without penalties: acceptance counted on the device, one transfer."""
        starts, widths, drafts = [w[1] for w in windows], [w[2] for w in windows], [w[3] for w in windows]
        return verify_greedy_windows(starts, widths, drafts, logits)

    def row_context(self, req: Request, drafts: list[int], device: torch.device) -> RowContext:
        if req.params.seed is not None and req.generator is None:
            req.generator = torch.Generator(device=device).manual_seed(req.params.seed)
        output = req.output_ids + drafts if req.params.has_penalties else []
        # the position's output count: the kept drafts before it are output by then
        early = len(req.output_ids) + len(drafts) < req.params.min_tokens
        banned = bad_word_bans(req.params.bad_words_token_ids, req.output_ids, drafts)
        if early:
            banned |= req.stop_ids
        if req.params.allowed_token_ids is not None and req.allowed_mask is None:
            req.allowed_mask = allowed_mask(req.params.allowed_token_ids, self.runner.vocab_size, device)
        forced = None
        if req.thinking is not None:
            req.thinking, forced = forced_end_token(req.params, req.thinking, req.output_ids, drafts)
        return RowContext(
            req.params, req.prompt_ids, output, req.generator, tuple(sorted(banned)), req.allowed_mask, forced
        )

    def _record_window(self, num_drafts: int, result: WindowResult) -> None:
        s = self.stats
        if not num_drafts:
            # a window without drafts always yields one token: counting it would drag the acceptance length to 1
            return
        s.num_spec_windows += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_draft_tokens += result.num_accepted_drafts
        index = min(result.num_accepted, len(s.accepted_length_counts)) - 1
        s.accepted_length_counts[index] += 1

    def emit(
        self,
        req: Request,
        token_ids: list[int],
        logits: torch.Tensor,
        start: int,
        advance_grammar: bool = True,
        grammar_error: str | None = None,
    ) -> list[EngineOutput]:
        """Append tokens until a stop token or the length cap, and report them (`logits[start:]` are the tokens'
        rows, read only when the request asked for log-probabilities). `advance_grammar=False`: the caller already
        moved the request's matcher over `token_ids` (one token, which is always emitted), with `grammar_error` as
        the outcome."""
        is_first = not req.output_ids
        sends_prompt_logprobs = req.needs_prompt_logprobs
        emitted: list[int] = []
        reason = None
        for token in token_ids:
            req.output_ids.append(token)
            emitted.append(token)
            if token in req.stop_ids:
                req.stop_token_id, reason = token, "stop"
                break
            if req.num_remaining_tokens <= 0:
                reason = "length"
                break
        if advance_grammar:
            grammar_error = grammar.advance(req, emitted)
        chunk = TokenChunk(req.req_id, emitted)
        if is_first:
            chunk.num_cached_tokens = req.num_cached_tokens
        if req.params.logprobs is not None:
            rows = logits[start : start + len(emitted)]
            chunk.logprobs, chunk.top_logprobs = compute_logprobs(rows, emitted, req.params.logprobs)
        if sends_prompt_logprobs:
            # once, on the first chunk: the first prompt token has nothing before it; positions a runner did not
            # score are null. Dropped afterwards (a recompute after preemption never gathers them again).
            missing = [None] * (len(req.prompt_ids) - 1 - len(req.prompt_logprobs))
            chunk.prompt_logprobs = [None, *req.prompt_logprobs, *missing]
            chunk.prompt_top_logprobs = [None, *req.prompt_top_logprobs, *missing]
            chunk.prompt_ranks = [None, *req.prompt_ranks, *missing]
            req.prompt_logprobs, req.prompt_top_logprobs, req.prompt_ranks = [], [], []
        outputs: list[EngineOutput] = [chunk]
        if grammar_error is not None:
            return outputs + self.finish(req, "error", error=grammar_error)
        if reason is not None:
            outputs += self.finish(req, reason)
        return outputs

    def finish(self, req: Request, reason: str, error: str | None = None) -> list[EngineOutput]:
        if req.is_finished:
            return []
        # after a failed step the state is suspect: only cleanly finished or aborted requests feed the cache
        publish = reason != "error"
        # a finish inside a step publishes after the step's outputs are out (the next step); its resources wait
        later = publish and self._in_step and req.handle is not None
        self._compiling.discard(req)
        self.scheduler.remove(req, publish=publish, keep_resources=later)
        if later:
            self._publishes.leaving(req)
        req.status, req.finish_reason, req.error = Status.FINISHED, reason, error
        self.requests.pop(req.req_id, None)
        return [
            Finished(
                req.req_id,
                reason,
                num_prompt_tokens=len(req.prompt_ids),
                num_output_tokens=len(req.output_ids),
                stop_token_id=req.stop_token_id,
                error=error,
            )
        ]
