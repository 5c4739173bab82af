"""Continuous-batching scheduler (host side), in the manner of vLLM v1.

A request is a token list (prompt, then its outputs) and `num_computed_tokens`, the prefix whose latent rows
are in the cache. Each step gives every scheduled request the next `n` uncomputed tokens under a token budget:
running requests first (decodes, then unfinished prefill chunks, oldest first), then waiting requests. When a
request reaches the end of its tokens in a step, the step samples its next token. When pages run out, the
newest running request is preempted: its pages are freed and it goes back to the front of the waiting queue
with nothing computed; it is recomputed later from its prompt and outputs so far, and since samples depend only
on (seed, position), its outputs do not change.
"""
from __future__ import annotations

import dataclasses
import enum
import itertools
from collections import deque
from typing import Hashable

from mla_jax.allocator import OutOfPages, PagePool
from mla_jax.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class Request:
    request_id: Hashable
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length"
    num_preemptions: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclasses.dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int  # first token position computed this step
    num_tokens: int

    @property
    def samples(self) -> bool:
        """The chunk ends at the request's last token: the step samples the next one."""
        return self.start + self.num_tokens == self.request.num_tokens


class Scheduler:
    def __init__(self, pool: PagePool, *, max_num_seqs: int, token_budget: int, max_prefills: int,
                 long_prefill_threshold: int | None = None):
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.token_budget = token_budget
        self.max_prefills = max_prefills  # prefill requests (query length > 1) per step: a static shape
        self.long_prefill_threshold = long_prefill_threshold
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._arrivals = itertools.count()
        self.num_preemptions = 0

    def add(self, request_id: Hashable, prompt: list[int], params: SamplingParams) -> Request:
        r = Request(request_id, list(prompt), params, next(self._arrivals))
        self.waiting.append(r)
        return r

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt_newest(self) -> Request:
        victim = max(self.running, key=lambda r: r.arrival)
        self.running.remove(victim)
        self.pool.free(victim.request_id)
        victim.num_computed_tokens = 0
        victim.status = Status.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        return victim

    def _grow(self, r: Request, upto: int) -> None:
        have = self.pool.num_tokens(r.request_id) if r.request_id in self.pool else 0
        if r.request_id not in self.pool:
            self.pool.allocate(r.request_id, upto)
        elif upto > have:
            self.pool.append(r.request_id, upto - have)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.token_budget
        prefills = 0
        preempted = False
        out: list[ScheduledChunk] = []
        # Running requests, oldest first; decodes (1 token) are cheap, chunks of unfinished prompts bigger.
        for r in sorted(self.running, key=lambda r: r.arrival):
            if r.status is not Status.RUNNING or budget == 0:
                continue
            remaining = r.num_tokens - r.num_computed_tokens
            n = min(remaining, budget)
            if n > 1:
                if prefills >= self.max_prefills:
                    continue
            while True:
                try:
                    self._grow(r, r.num_computed_tokens + n)
                    break
                except OutOfPages:
                    victim = self._preempt_newest()
                    preempted = True
                    out = [c for c in out if c.request is not victim]
                    if victim is r:
                        break
            if r.status is not Status.RUNNING:
                continue
            prefills += n > 1
            budget -= n
            out.append(ScheduledChunk(r, r.num_computed_tokens, n))
        # Waiting requests (FIFO), while the batch and the pages allow; none after a preemption, which would
        # only hand the freed pages back and forth.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            n = min(r.num_tokens, budget)
            if n > 1 and prefills >= self.max_prefills:
                break
            try:
                self._grow(r, n)
            except OutOfPages:
                break
            self.waiting.popleft()
            r.status = Status.RUNNING
            self.running.append(r)
            prefills += n > 1
            budget -= n
            out.append(ScheduledChunk(r, 0, n))
        return out

    def finish(self, r: Request, reason: str) -> None:
        r.status = Status.FINISHED
        r.finish_reason = reason
        self.running.remove(r)
        self.pool.free(r.request_id)
