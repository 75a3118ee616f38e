"""Continuous batching: decide, each step, which requests run and how many tokens each feeds.

One token budget per step (`token_budget`, the server's `--max_num_batched_tokens`) covers decode windows and
prefill chunks. Decode rows go first (each at least its last token; drafts only while budget and KV allow), so a
running request gets a token every step however long the prompts beside it are; prefill chunks of admitted
requests then fill what is left of the budget, then new requests from the waiting queue. A prefill chunk is what
is left of the step's budget, capped at `chunked_prefill_size` tokens per request (by default the whole budget),
so the step's cost stays bounded by the budget and a long prompt spreads over as many steps as it needs. A step
with decode rows of requests past their prompt feeds at most `mixed_prefill_tokens` prompt tokens (by default the
whole budget): such a step sets those requests' gap between two tokens, while a step that only prefills, or whose
decode rows are prompts' last tokens, keeps the whole budget (time to first token, throughput). In such a step a
prompt's chunk is also at most `mixed_prefill_chunk` tokens (on a GPU the largest prefill graph: a step of a few
such chunks replays their graphs beside the decode graph, where one longer chunk would run the step eagerly).

A request is admitted only when a linear-state slot is free (`runner.add_request`) and the KV cache can hold its
prefill on top of what running requests still need. When KV runs out for decode rows, the most recently admitted
request is preempted: its slot and KV are returned and it later re-prefills its prompt and output (recompute).

The waiting queue is ordered by priority (lower first; every request has 0 unless the server takes priorities),
then arrival; a preempted request keeps its arrival, so it goes back ahead of later ones. Victims are taken from the
worst priority first, latest admission first within it, and a waiting request that cannot be admitted as things
stand takes the place of a running request of a worse priority.

With a prefix cache, admission resumes a request from the deepest cached checkpoint on its tokens' path
(`runner.add_request(prefix)`) and prefills only the rest. Prefill chunks are cut to end at multiples of
`checkpoint_interval` when they cross one, so the engine can checkpoint there; a request leaving the batch
(finished, aborted or preempted) first publishes its committed tokens (`runner.publish`). The prefill rows stop one
token short of the prompt and the last token runs as a one-token decode window: the checkpoint at the prefill end is
then the state just before the last token, from which a later request with the same tokens produces its first
output token without prefilling anything. A request that resumed from the cache with at most
`short_resume_tokens` (and at least two) tokens left is the exception: its one prefill chunk feeds the last token
too, so a hit (a later turn, a shared prefix with a short question) reaches its first token one step sooner. Its
prefill end is checkpointed after the last token: a prompt extending it resumes there, while an exact repeat
resumes at an earlier checkpoint (the one the hit itself resumed from) and prefills the short rest again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

from lightllm.cache.prefix.cache import PrefixMatch
from lightllm.engine.batch import ModelRunnerProtocol
from lightllm.engine.request import Request, Status

# prefill positions per step whose logits are kept for prompt log-probabilities: each costs a vocabulary-wide fp32
# row twice (logits and their log-softmax), ~1.2 GB per 1024 rows at a 150k vocabulary; requests asking for them
# prefill in smaller chunks instead of holding a whole chunked-prefill budget of such rows
MAX_PROMPT_LOGIT_ROWS_PER_STEP = 1024


@dataclass
class ScheduledRow:
    req: Request
    # tokens this row feeds: the prefill chunk length, or 1 + len(draft_ids) for a decode window
    num_tokens: int
    draft_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulePlan:
    prefill: list[ScheduledRow] = field(default_factory=list)
    decode: list[ScheduledRow] = field(default_factory=list)
    # requests sent back to the waiting queue this step
    preempted: list[Request] = field(default_factory=list)
    # requests that can never fit (finished with an error by the engine)
    unfittable: list[Request] = field(default_factory=list)

    @property
    def rows(self) -> list[ScheduledRow]:
        return self.prefill + self.decode

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    def __init__(
        self,
        runner: ModelRunnerProtocol,
        max_running_requests: int,
        token_budget: int,
        max_width: int,
        checkpoint_interval: int = 0,
        short_resume_tokens: int = 0,
        chunked_prefill_size: int | None = None,
        mixed_prefill_tokens: int | None = None,
        mixed_prefill_chunk: int | None = None,
    ):
        if token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {token_budget}")
        if chunked_prefill_size is not None and not 1 <= chunked_prefill_size <= token_budget:
            raise ValueError(
                f"chunked_prefill_size must be in [1, token_budget={token_budget}], got {chunked_prefill_size}"
            )
        if mixed_prefill_tokens is not None and not 1 <= mixed_prefill_tokens <= token_budget:
            raise ValueError(
                f"mixed_prefill_tokens must be in [1, token_budget={token_budget}], got {mixed_prefill_tokens}"
            )
        self.runner = runner
        # prefill chunks end at multiples of this when they cross one (0 = no alignment)
        self.checkpoint_interval = checkpoint_interval
        # a resume with at most this many tokens left prefills its last prompt token in the same chunk
        self.short_resume_tokens = short_resume_tokens
        # KV tokens of an empty cache: a request whose prefill alone exceeds this can never run
        self.kv_capacity = runner.num_free_kv_tokens()
        self.max_running_requests = max_running_requests
        # tokens one step feeds (decode windows and prefill chunks together)
        self.token_budget = token_budget
        # the longest prefill chunk of one request in one step
        self.chunked_prefill_size = chunked_prefill_size or token_budget
        # the most prompt tokens of a step that also decodes for requests streaming output, and the longest chunk of
        # one prompt in such a step
        self.mixed_prefill_tokens = mixed_prefill_tokens or token_budget
        self.mixed_prefill_chunk = mixed_prefill_chunk or token_budget
        self.max_width = max_width
        self.max_prompt_logit_rows = MAX_PROMPT_LOGIT_ROWS_PER_STEP
        self._prompt_logit_rows_left = MAX_PROMPT_LOGIT_ROWS_PER_STEP
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._admit_seq = 0
        self._arrivals = 0
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self._arrivals += 1
        req.arrival_seq = self._arrivals
        self._queue(req)

    def _queue(self, req: Request) -> None:
        """Into the waiting queue by (priority, arrival)."""
        key = (req.priority, req.arrival_seq)
        i = len(self.waiting)
        while i > 0 and (self.waiting[i - 1].priority, self.waiting[i - 1].arrival_seq) > key:
            i -= 1
        self.waiting.insert(i, req)

    def _victim(self, among: Collection[Request]) -> Request:
        """Who is preempted first: the worst priority, the latest admission within it."""
        return max(among, key=lambda r: (r.priority, r.admit_seq))

    def remove(self, req: Request, publish: bool = False, keep_resources: bool = False) -> None:
        """Take a request out of the queues and give its runner resources back (abort or finish); `publish`
        offers its committed tokens to the prefix cache first (never after a failed step: its state is suspect).
        `keep_resources` leaves both to a later `release` by the caller."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        if not keep_resources:
            self.release(req, publish)

    def release(self, req: Request, publish: bool) -> None:
        """Give the runner resources of a request out of the queues back, publishing its committed tokens first
        when `publish`; a request without resources is left as it is."""
        if req.handle is None:
            return
        # a stop token inside an accepted window leaves committed tokens past the output: publish what is kept
        num_kept = min(req.num_computed_tokens, req.num_tokens)
        if publish and num_kept:
            self.runner.publish(req.handle, req.all_ids[:num_kept])
        self.runner.free_request(req.handle)
        req.handle = None

    def prefill_chunk(self, req: Request, limit: int) -> int:
        """Tokens of `req`'s prefill to run next, at most `limit`, ending where a checkpoint is due: at the first
        branch point or hinted position the chunk crosses, else at the last checkpoint-interval boundary it
        crosses (unless the chunk ends the prefill). A request asking for prompt log-probabilities draws on the
        step's allowance of such rows (`max_prompt_logit_rows`)."""
        start = req.num_computed_tokens
        if req.needs_prompt_logprobs:
            limit = min(limit, self._prompt_logit_rows_left)
        last = self.prefill_end(req)
        end = min(last, start + max(limit, 0))
        interval = self.checkpoint_interval
        points = [p for p in (req.branch_point, *req.checkpoint_hints) if start < p < end]
        if points and interval:
            end = min(points)
        elif interval and end < last and end // interval * interval > start:
            end = end // interval * interval
        if req.needs_prompt_logprobs:
            self._prompt_logit_rows_left -= end - start
        return end - start

    def prefill_end(self, req: Request) -> int:
        """Where `req`'s prefill rows stop. With a prefix cache (`checkpoint_interval` > 0), one token short of
        `num_prefill_tokens`: the last token is fed as a one-token decode window instead (the same math, in the
        decode batch), so the prefill end is checkpointed just before it. A later request for the same tokens
        resumes there and feeds only that token, whose logits give its first output token; one that extends them
        resumes there too and prefills one token more than it would from a checkpoint after the last token. A
        request resumed with a short rest (`prefills_last_token`) prefills to `num_prefill_tokens`."""
        n = req.num_prefill_tokens
        return n - 1 if self.checkpoint_interval and n > 1 and not req.prefills_last_token else n

    def awaits_last_token(self, req: Request) -> bool:
        """Prefilled up to `prefill_end` short of its last token: its next row is that token's decode window."""
        return req.num_computed_tokens == self.prefill_end(req) < req.num_prefill_tokens

    def is_checkpoint_due(self, req: Request) -> bool:
        """After a prefill chunk: whether `req` stands where a checkpoint is due (prefill end, branch point,
        hinted position, interval boundary)."""
        n, interval = req.num_computed_tokens, self.checkpoint_interval
        if n == self.prefill_end(req):
            return True
        return bool(interval) and (n == req.branch_point or n in req.checkpoint_hints or n % interval == 0)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, held: Collection[Request] = (), may_preempt: bool = True) -> SchedulePlan:
        """The next step's rows. `held`: running requests that get no row (their token in flight is their last:
        they leave when it is read back). Without `may_preempt` nobody is sent back to the queue (a step is in
        flight: its rows' tokens are not read yet); the plan is then what fits without it, possibly empty."""
        plan = SchedulePlan()
        held = set(held)
        self._prompt_logit_rows_left = self.max_prompt_logit_rows
        if may_preempt:
            self._preempt_for_priority(plan, held)
        free_kv = self.runner.num_free_kv_tokens()
        decoding = [r for r in self.running if r not in held and (not r.is_prefilling or self.awaits_last_token(r))]
        # every decode row needs one KV token for its last token; preempt latest admissions until they fit
        while may_preempt and decoding and len(decoding) > free_kv:
            victim = self._victim(self.running)
            if victim in decoding:
                decoding.remove(victim)
            free_kv += self._preempt(victim, plan)
        budget = self.token_budget - len(decoding)
        free_kv -= len(decoding)
        for req in decoding:
            # drafts only while the step's budget and the KV cache have room; the width never exceeds the runner's
            # a request still prefilling feeds its last token: nothing was drafted after it (drafts from before a
            # preemption belong to an older position)
            num_drafts = (
                0
                if req.is_prefilling
                else max(0, min(len(req.draft_ids), self.max_width - 1, budget, free_kv, req.num_remaining_tokens - 1))
            )
            budget -= num_drafts
            free_kv -= num_drafts
            drafts = req.draft_ids[:num_drafts]
            plan.decode.append(ScheduledRow(req, 1 + num_drafts, drafts))
        chunk_limit = self.chunked_prefill_size
        if any(not req.is_prefilling for req in decoding):
            # what the prompts get is capped (the decode rows and their drafts are not)
            budget = min(budget, self.mixed_prefill_tokens)
            chunk_limit = min(chunk_limit, self.mixed_prefill_chunk)
        for req in self.running:
            if req.is_prefilling and not self.awaits_last_token(req) and budget > 0 and free_kv > 0:
                chunk = self.prefill_chunk(req, min(budget, chunk_limit, free_kv))
                if chunk == 0:
                    continue
                plan.prefill.append(ScheduledRow(req, chunk))
                budget -= chunk
                free_kv -= chunk
        self._admit(plan, budget, free_kv, chunk_limit)
        if plan.is_empty and self.running and may_preempt:
            # nothing could progress (prefills starved of KV): free the latest admission so the rest can move
            self._preempt(self._victim(self.running), plan)
        return plan

    def _preempt_for_priority(self, plan: SchedulePlan, held: Collection[Request]) -> None:
        while (victim := self.priority_victim(held)) is not None:
            self._preempt(victim, plan)

    def priority_victim(self, held: Collection[Request] = ()) -> Request | None:
        """The running request (not in `held`) the queue's head takes the place of: one of a worse priority, while
        the head cannot be admitted (no state slot or room under `max_running_requests`, or too little KV for its
        prefill beside what the running requests still need); None when there is none."""
        if not self.waiting:
            return None
        head = self.waiting[0]
        worse = [r for r in self.running if r not in held and r.priority > head.priority]
        if not worse or head.num_tokens + 1 > self.kv_capacity:
            return None
        fits = (
            len(self.running) < self.max_running_requests
            and self.runner.num_free_requests() > 0
            and self._admission_kv(head, self._match(head)[1]) + self._committed_kv()
            <= self.runner.num_free_kv_tokens()
        )
        return None if fits else self._victim(worse)

    def waiting_would_join(self) -> bool:
        """A waiting request could join the running batch now: there is a state slot and room for it under
        `max_running_requests`, or a running request of a worse priority it takes the place of."""
        if not self.waiting:
            return False
        room = len(self.running) < self.max_running_requests and self.runner.num_free_requests() > 0
        return room or self.priority_victim() is not None

    def _match(self, req: Request) -> tuple[list[int], PrefixMatch]:
        """The tokens `req` resumes from the prefix cache by, and the cache's match on them. Prompt
        log-probabilities need every prompt position computed: such a request resumes nothing."""
        prefix = [] if req.needs_prompt_logprobs else req.all_ids
        return prefix, self.runner.match_prefix(prefix, req.cache_namespace)

    @staticmethod
    def _admission_kv(req: Request, match: PrefixMatch) -> int:
        """KV tokens admitting `req` takes: its tokens past the match, and the cached ones the match locks (no
        longer reclaimable)."""
        return req.num_tokens - match.num_tokens + match.num_pinned

    def _committed_kv(self) -> int:
        """KV the running prefills will still claim, plus a window of headroom per running request."""
        prefills = sum(r.num_prefill_tokens - r.num_computed_tokens for r in self.running if r.is_prefilling)
        return prefills + self.max_width * len(self.running)

    def _admit(self, plan: SchedulePlan, budget: int, free_kv: int, chunk_limit: int) -> None:
        # what the running requests claim after this step's prefill rows
        committed = self._committed_kv() - sum(row.num_tokens for row in plan.prefill)
        while self.waiting and budget > 0 and len(self.running) < self.max_running_requests:
            req = self.waiting[0]
            num_prefill = req.num_tokens
            if num_prefill + 1 > self.kv_capacity:
                plan.unfittable.append(self.waiting.popleft())
                continue
            prefix, match = self._match(req)
            if self._admission_kv(req, match) + committed > free_kv:
                break
            if self.runner.num_free_requests() == 0:
                break
            self.waiting.popleft()
            free_before = self.runner.num_free_kv_tokens()
            req.handle = self.runner.add_request(prefix, namespace=req.cache_namespace)
            # cached tokens the hit locked are no longer reclaimable
            free_kv -= free_before - self.runner.num_free_kv_tokens()
            req.status = Status.RUNNING
            req.num_computed_tokens = self.runner.num_tokens(req.handle)
            if req.num_preemptions == 0:
                req.num_cached_tokens = req.num_computed_tokens
            # the tokens branch off a cached path past the last checkpoint on it: checkpoint at the branch, so
            # later requests sharing this prefix resume there
            req.branch_point = match.num_matched if match.num_matched > req.num_computed_tokens else 0
            req.num_prefill_tokens = num_prefill
            left = num_prefill - req.num_computed_tokens
            req.prefills_last_token = req.num_computed_tokens > 0 and 2 <= left <= self.short_resume_tokens
            self._admit_seq += 1
            req.admit_seq = self._admit_seq
            self.running.append(req)
            if self.awaits_last_token(req):
                # resumed just before its last token (an exact repeat): that token's window, this step
                chunk = 1
                plan.decode.append(ScheduledRow(req, chunk))
            else:
                chunk = self.prefill_chunk(req, min(budget, chunk_limit, free_kv))
                if chunk > 0:
                    plan.prefill.append(ScheduledRow(req, chunk))
            budget -= chunk
            free_kv -= chunk
            committed += num_prefill - req.num_computed_tokens - chunk + self.max_width

    def _preempt(self, req: Request, plan: SchedulePlan) -> int:
        """Send `req` back to the queue (ahead of later arrivals of its priority); returns the KV tokens this frees."""
        free_before = self.runner.num_free_kv_tokens()
        self.running.remove(req)
        # its committed tokens stay cached (reclaimable), so the re-admission resumes where it stopped
        self.release(req, publish=True)
        freed = self.runner.num_free_kv_tokens() - free_before
        req.status = Status.WAITING
        req.num_computed_tokens = 0
        req.num_prefill_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._queue(req)
        plan.preempted.append(req)
        for rows in (plan.prefill, plan.decode):
            rows[:] = [row for row in rows if row.req is not req]
        return freed
