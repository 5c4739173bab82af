"""Continuous-batching scheduler (host side), in the manner of vLLM v1.

A request is a token list (prompt, then its outputs) and `num_computed_tokens`, the prefix whose latent rows
are in the cache. Each step gives every scheduled request the next `n` uncomputed tokens under a token budget:
running requests first (decodes, then unfinished prefill chunks, oldest first), then waiting requests. When a
request reaches the end of its tokens in a step, the step samples its next token. When pages run out, the
newest running request is preempted: its pages are freed and it goes back to the front of the waiting queue
with nothing computed; it is recomputed later from its prompt and outputs so far, and since samples depend only
on (seed, position), its outputs do not change.

With prefix caching (the pool's `enable_prefix_caching`), a request admitted from the waiting queue starts
with the longest run of its full pages found in the cache (`PagePool.cached_prefix` over its chain hashes) as
computed context, at most all but its last token, which must be computed to sample from; only the rest is
prefilled, the cached part read as chunked context. After each step `cache_computed` registers the request's
newly completed full pages. A preempted request drops its references like a finished one; its pages stay
cached until evicted, so its recompute is often mostly a cache hit.

Data-parallel attention (`DPScheduler`): one `Scheduler` with its own page pool per DP rank; new requests wait in
one shared queue until a rank takes them, then stay on that rank (their cache is there), preempted and resumed
within it.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections import deque
from typing import Hashable

from mla_jax.allocator import OutOfPages, PagePool, page_hashes
from mla_jax.sampling import SamplingParams

PENDING = -1  # an output id the device has sampled but the host has not read yet (async scheduling)


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
    output_top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_preemptions: int = 0
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)  # chain hashes of its full pages so far
    num_cached_pages: int = 0  # leading pages it holds that are in the prefix cache (hits or registered)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at its (last) admission
    # Speculative decoding: the drafts to verify after its last token (`mla_jax.spec_decode`), and counters.
    draft_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_draft_tokens: int = 0  # drafts verified so far
    num_accepted_tokens: int = 0  # of which accepted
    num_pending: int = 0  # trailing output ids still PENDING (sampled by a step in flight)
    # Async speculative steps: drafts of its step in flight, which the host counts neither as computed nor as
    # rejected yet; the next step's rows sit up to that many positions later (`schedule` allocates for them).
    num_unverified: int = 0
    dp_rank: int = 0  # data-parallel attention: the rank whose pool holds its pages (`DPScheduler`)

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
    num_tokens: int  # query rows: real tokens, then num_drafts draft tokens
    num_drafts: int = 0

    @property
    def token_ids(self) -> list[int]:
        r = self.request
        real = r.all_token_ids[self.start : self.start + self.num_tokens - self.num_drafts]
        return real + r.draft_token_ids[: self.num_drafts]

    @property
    def samples(self) -> bool:
        """The chunk ends at the request's last token: the step samples the next one (and verifies drafts)."""
        return self.start + self.num_tokens - self.num_drafts == self.request.num_tokens


class Scheduler:
    def __init__(
        self,
        pool: PagePool,
        *,
        max_num_seqs: int,
        token_budget: int,
        max_prefills: int,
        long_prefill_threshold: int | None = None,
    ):
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.token_budget = token_budget
        self.max_prefills = max_prefills  # prefill requests (query length > 1) per step: a static shape
        self.long_prefill_threshold = long_prefill_threshold
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._arrivals = itertools.count()
        self.num_preemptions = 0
        # Prefix cache counters (tokens), over every admission from the waiting queue: tokens looked up, tokens
        # found cached.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def enable_prefix_caching(self) -> bool:
        return self.pool.enable_prefix_caching

    def pool_of(self, r: Request) -> PagePool:
        """The page pool holding a request's pages (one pool here; one per rank in `DPScheduler`)."""
        return self.pool

    def add(self, request_id: Hashable, prompt: list[int], params: SamplingParams) -> Request:
        r = Request(request_id, list(prompt), params, next(self._arrivals))
        self.waiting.append(r)
        return r

    def abort(self, request_id: Hashable) -> Request | None:
        """Removes a waiting or running request and releases its pages; None if it is not (or no longer) here."""
        for r in self.running:
            if r.request_id == request_id:
                self.finish(r, "abort")
                return r
        for r in self.waiting:
            if r.request_id == request_id:
                self.waiting.remove(r)
                if request_id in self.pool:  # waiting requests hold no pages; be safe
                    self.pool.free(request_id)
                r.status = Status.FINISHED
                r.finish_reason = "abort"
                return r
        return None

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt_newest(self) -> Request:
        victim = max(self.running, key=lambda r: r.arrival)
        self.running.remove(victim)
        self.pool.free(victim.request_id)
        victim.num_computed_tokens = 0
        victim.num_cached_pages = 0
        victim.draft_token_ids = []
        victim.num_unverified = 0
        victim.status = Status.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        return victim

    def _cached_prefix(self, r: Request) -> list[int]:
        """Cached pages a newly admitted request can start from: its longest cached chain of full pages,
        leaving at least its last token to compute."""
        if not self.enable_prefix_caching:
            return []
        G = self.pool.page_size
        n = (r.num_tokens - 1) // G
        if len(r.block_hashes) < n:
            r.block_hashes = page_hashes(r.all_token_ids[: n * G], G, r.block_hashes)
        return self.pool.cached_prefix(r.block_hashes[:n])

    def cache_computed(self, r: Request) -> None:
        """Registers the request's full pages whose tokens are now all computed (call after each step that
        computed some of its tokens). A page whose content is already cached elsewhere stays private."""
        if not self.enable_prefix_caching or r.request_id not in self.pool:
            return
        G = self.pool.page_size
        full = r.num_computed_tokens // G
        if r.num_cached_pages >= full:
            return
        if len(r.block_hashes) < full:
            r.block_hashes = page_hashes(r.all_token_ids[: full * G], G, r.block_hashes)
        for i in range(r.num_cached_pages, full):
            self.pool.cache_page(r.request_id, i, r.block_hashes[i])
        r.num_cached_pages = full

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
            if r.status is not Status.RUNNING or budget == 0 or len(r.output_token_ids) >= r.params.max_new_tokens:
                continue  # (the last: its final id is pending, async scheduling)
            remaining = r.num_tokens - r.num_computed_tokens
            n = min(remaining, budget)
            m = 0  # drafts verified after the last token, within the budget and the request's max_new_tokens
            if remaining == 1 and r.draft_token_ids:
                m = max(
                    0, min(len(r.draft_token_ids), budget - 1, r.params.max_new_tokens - len(r.output_token_ids) - 1)
                )
                n += m
            if n - m > 1:
                if prefills >= self.max_prefills:
                    continue
            upto = r.num_computed_tokens + n
            if r.num_unverified:  # the worst case of its step in flight, up to the last position it may need
                upto = max(upto, min(upto + r.num_unverified, len(r.prompt_token_ids) + r.params.max_new_tokens))
            while True:
                try:
                    self._grow(r, upto)
                    break
                except OutOfPages:
                    victim = self._preempt_newest()
                    preempted = True
                    out = [c for c in out if c.request is not victim]
                    if victim is r:
                        break
            if r.status is not Status.RUNNING:
                continue
            prefills += n - m > 1
            budget -= n
            out.append(ScheduledChunk(r, r.num_computed_tokens, n, m))
        # Waiting requests (FIFO), while the batch and the pages allow; none after a preemption, which would
        # only hand the freed pages back and forth.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            hits = self._cached_prefix(r)
            start = len(hits) * self.pool.page_size
            n = min(r.num_tokens - start, budget)
            if n > 1 and prefills >= self.max_prefills:
                break
            try:
                self.pool.allocate(r.request_id, start + n, cached_pages=hits)
            except OutOfPages:
                break
            self.waiting.popleft()
            r.status = Status.RUNNING
            r.num_computed_tokens = start
            r.num_cached_pages = len(hits)
            r.num_cached_tokens = start
            if self.enable_prefix_caching:
                self.prefix_cache_queries += r.num_tokens
                self.prefix_cache_hits += start
            self.running.append(r)
            prefills += n > 1
            budget -= n
            out.append(ScheduledChunk(r, start, n))
        return out

    def finish(self, r: Request, reason: str) -> None:
        """Ends a running request, or a preempted (waiting) one whose last pending id ended it."""
        r.status = Status.FINISHED
        r.finish_reason = reason
        if r in self.running:
            self.running.remove(r)
        else:
            self.waiting.remove(r)
        if r.request_id in self.pool:
            self.pool.free(r.request_id)


class DPScheduler:
    """Data-parallel attention: one `Scheduler` (and page pool) per DP rank, `max_num_seqs` split evenly over them;
    `token_budget` and `max_prefills` hold per rank (each rank's share of the step has its own static shape).

    New requests wait in one FIFO queue (`unassigned`). Each step, before the ranks schedule, the head of the queue
    goes to the rank with the fewest tokens (its running and waiting requests' tokens together), among the ranks
    with a free sequence slot and enough free pages for its tokens after those its own waiting requests need; ties
    go to the rank with more free pages, then the lower rank. The queue stops at a request no rank can take
    (FIFO, as the one-rank scheduler). An assigned request stays on its rank: its rank's scheduler runs it,
    preempts it when its rank's pages run out (the newest of that rank) and resumes it there."""

    def __init__(self, pools: list[PagePool], *, max_num_seqs: int, token_budget: int, max_prefills: int):
        dp = len(pools)
        if max_num_seqs < dp or max_num_seqs % dp:
            raise ValueError(f"max_num_seqs {max_num_seqs} does not divide over dp={dp} ranks (each needs >= 1 slot)")
        self.ranks = [
            Scheduler(p, max_num_seqs=max_num_seqs // dp, token_budget=token_budget, max_prefills=max_prefills)
            for p in pools
        ]
        self.max_num_seqs = max_num_seqs
        self.unassigned: deque[Request] = deque()
        self._arrivals = itertools.count()

    @property
    def dp(self) -> int:
        return len(self.ranks)

    @property
    def running(self) -> list[Request]:
        return [r for s in self.ranks for r in s.running]

    @property
    def waiting(self) -> list[Request]:
        return list(self.unassigned) + [r for s in self.ranks for r in s.waiting]

    @property
    def has_unfinished(self) -> bool:
        return bool(self.unassigned) or any(s.has_unfinished for s in self.ranks)

    @property
    def num_preemptions(self) -> int:
        return sum(s.num_preemptions for s in self.ranks)

    @property
    def prefix_cache_queries(self) -> int:
        return sum(s.prefix_cache_queries for s in self.ranks)

    @property
    def prefix_cache_hits(self) -> int:
        return sum(s.prefix_cache_hits for s in self.ranks)

    @property
    def enable_prefix_caching(self) -> bool:
        return self.ranks[0].enable_prefix_caching

    def pool_of(self, r: Request) -> PagePool:
        return self.ranks[r.dp_rank].pool

    def add(self, request_id: Hashable, prompt: list[int], params: SamplingParams) -> Request:
        r = Request(request_id, list(prompt), params, next(self._arrivals))
        self.unassigned.append(r)
        return r

    def abort(self, request_id: Hashable) -> Request | None:
        for r in self.unassigned:
            if r.request_id == request_id:
                self.unassigned.remove(r)
                r.status = Status.FINISHED
                r.finish_reason = "abort"
                return r
        for s in self.ranks:
            r = s.abort(request_id)
            if r is not None:
                return r
        return None

    def rank_load(self, rank: int) -> tuple[int, int]:
        """(tokens of the rank's running and waiting requests, its free pages less what its waiting ones need)."""
        s = self.ranks[rank]
        tokens = sum(r.num_tokens for r in s.running) + sum(r.num_tokens for r in s.waiting)
        reserved = sum(s.pool.pages_needed(r.num_tokens) for r in s.waiting)
        return tokens, s.pool.num_free_pages - reserved

    def _assign(self) -> None:
        while self.unassigned:
            r = self.unassigned[0]
            best = None
            for i, s in enumerate(self.ranks):
                if len(s.running) + len(s.waiting) >= s.max_num_seqs:
                    continue
                tokens, free = self.rank_load(i)
                if free < s.pool.pages_needed(r.num_tokens):
                    continue
                key = (tokens, -free, i)
                best = key if best is None or key < best else best
            if best is None:
                return
            self.unassigned.popleft()
            r.dp_rank = best[2]
            self.ranks[r.dp_rank].waiting.append(r)

    def schedule(self) -> list[ScheduledChunk]:
        """Every rank's chunks of this step (each chunk's `request.dp_rank` says whose)."""
        self._assign()
        return [c for s in self.ranks for c in s.schedule()]

    def cache_computed(self, r: Request) -> None:
        self.ranks[r.dp_rank].cache_computed(r)

    def finish(self, r: Request, reason: str) -> None:
        self.ranks[r.dp_rank].finish(r, reason)
