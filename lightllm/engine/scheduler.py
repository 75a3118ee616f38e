"""Continuous batching: decide, each step, which requests run and how many tokens each feeds.

One token budget per step covers decode windows and prefill chunks. Decode rows go first (each at least its
last token; drafts only while budget and KV allow), then prefill chunks of admitted requests, then new requests
from the waiting queue. A request is admitted only when a linear-state slot is free (`runner.add_request`) and
the KV cache can hold its prefill on top of what running requests still need. When KV runs out for decode
rows, the most recently admitted request is preempted: its slot and KV are returned and it later re-prefills
its prompt and output (recompute).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from lightllm.engine.batch import ModelRunnerProtocol
from lightllm.engine.request import Request, Status


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
    def __init__(self, runner: ModelRunnerProtocol, max_running_requests: int, token_budget: int, max_width: int):
        self.runner = runner
        # KV tokens of an empty cache: a request whose prefill alone exceeds this can never run
        self.kv_capacity = runner.num_free_kv_tokens()
        self.max_running_requests = max_running_requests
        self.token_budget = token_budget
        self.max_width = max_width
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._admit_seq = 0
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Take a request out of the queues and give its runner resources back (abort or finish)."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        if req.handle is not None:
            self.runner.free_request(req.handle)
            req.handle = None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulePlan:
        plan = SchedulePlan()
        free_kv = self.runner.num_free_kv_tokens()
        decoding = [r for r in self.running if not r.is_prefilling]
        # every decode row needs one KV token for its last token; preempt latest admissions until they fit
        while decoding and len(decoding) > free_kv:
            victim = max(self.running, key=lambda r: r.admit_seq)
            if victim in decoding:
                decoding.remove(victim)
            free_kv += self._preempt(victim, plan)
        budget = self.token_budget - len(decoding)
        free_kv -= len(decoding)
        for req in decoding:
            # drafts only while the step's budget and the KV cache have room; the width never exceeds the runner's
            num_drafts = max(
                0, min(len(req.draft_ids), self.max_width - 1, budget, free_kv, req.num_remaining_tokens - 1)
            )
            budget -= num_drafts
            free_kv -= num_drafts
            drafts = req.draft_ids[:num_drafts]
            plan.decode.append(ScheduledRow(req, 1 + num_drafts, drafts))
        for req in self.running:
            if req.is_prefilling and budget > 0 and free_kv > 0:
                chunk = min(req.num_prefill_tokens - req.num_computed_tokens, budget, free_kv)
                plan.prefill.append(ScheduledRow(req, chunk))
                budget -= chunk
                free_kv -= chunk
        self._admit(plan, budget, free_kv)
        if plan.is_empty and self.running:
            # nothing could progress (prefills starved of KV): free the latest admission so the rest can move
            self._preempt(max(self.running, key=lambda r: r.admit_seq), plan)
        return plan

    def _admit(self, plan: SchedulePlan, budget: int, free_kv: int) -> None:
        # KV the running prefills will still claim after this step, plus a window of headroom per running request
        committed = sum(r.num_prefill_tokens - r.num_computed_tokens for r in self.running if r.is_prefilling)
        committed -= sum(row.num_tokens for row in plan.prefill)
        committed += self.max_width * len(self.running)
        while self.waiting and budget > 0 and len(self.running) < self.max_running_requests:
            req = self.waiting[0]
            num_prefill = req.num_tokens
            if num_prefill + 1 > self.kv_capacity:
                plan.unfittable.append(self.waiting.popleft())
                continue
            if num_prefill + committed > free_kv or self.runner.num_free_requests() == 0:
                break
            self.waiting.popleft()
            req.handle = self.runner.add_request()
            req.status = Status.RUNNING
            req.num_computed_tokens = 0
            req.num_prefill_tokens = num_prefill
            self._admit_seq += 1
            req.admit_seq = self._admit_seq
            self.running.append(req)
            chunk = min(num_prefill, budget)
            plan.prefill.append(ScheduledRow(req, chunk))
            budget -= chunk
            free_kv -= chunk
            committed += num_prefill - chunk + self.max_width

    def _preempt(self, req: Request, plan: SchedulePlan) -> int:
        """Send `req` back to the head of the queue; returns the KV tokens this frees."""
        freed = req.num_computed_tokens
        self.running.remove(req)
        if req.handle is not None:
            self.runner.free_request(req.handle)
            req.handle = None
        req.status = Status.WAITING
        req.num_computed_tokens = 0
        req.num_prefill_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        plan.preempted.append(req)
        for rows in (plan.prefill, plan.decode):
            rows[:] = [row for row in rows if row.req is not req]
        return freed
