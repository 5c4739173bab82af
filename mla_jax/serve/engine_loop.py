"""The engine loop: one thread steps the `Engine` continuously; asyncio code submits requests and reads their
tokens as they come.

    engine = AsyncEngine(Engine(params, cfg, config))
    await engine.start()                                   # inside the event loop that will consume outputs
    stream = engine.add_request(prompt_ids, SamplingParams(...))
    async for delta in stream:                             # StepDelta per engine step that produced tokens
        ...
    stream.abort()                                         # e.g. the client went away: pages are freed

Only the engine thread touches the `Engine` (scheduler, pool, cache); the event loop hands it commands (add,
abort) through a queue, and the thread hands each step's outputs back in one `call_soon_threadsafe` call. The
thread does nothing per request but the engine's own host work: detokenization, stop strings and HTTP happen on
the event loop. Requests join at the next step and leave (finished or aborted) at any step. Validation
(`Engine.check_request`, which reads only the immutable config) runs in the caller, so a bad request raises
ValueError before it reaches the engine, and never disturbs the others.

If a step raises, the loop stops, every open stream raises `EngineDeadError`, and `healthy` turns False.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import threading
import time
from typing import Any, Hashable, Sequence

from mla_jax.engine import Engine, RequestOutput
from mla_jax.sampling import SamplingParams

THROUGHPUT_WINDOW_S = 10.0  # tokens/s gauges average over this many recent seconds


class EngineDeadError(RuntimeError):
    """The engine loop stopped (a step raised, or the server is shutting down)."""


@dataclasses.dataclass
class StepDelta:
    """What one engine step produced for one request."""

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    finished: bool
    finish_reason: str | None  # "stop" (a stop token) | "length" | "abort"
    num_cached_tokens: int
    time: float  # time.perf_counter() when the event loop received it


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot the engine thread publishes after every step (read from any thread)."""

    num_running: int = 0
    num_waiting: int = 0
    pages_used: int = 0  # pages held by requests (cached-but-unreferenced pages are free)
    pages_total: int = 0
    pages_cached: int = 0
    prefix_cache_queries: int = 0  # tokens looked up at admission
    prefix_cache_hits: int = 0  # tokens found cached
    num_preemptions: int = 0
    steps: int = 0
    generation_tokens: int = 0
    computed_tokens: int = 0  # tokens run through the model (prefill chunks and decodes; cache hits not counted)


class RequestStream:
    """The consumer side of one engine request: an async iterator of StepDelta, ending after the finished one.

    Several streams may share one queue (`AsyncEngine.add_request(queue=...)`: the n choices of one HTTP request);
    items are then (tag, StepDelta) and the owner reads the queue itself."""

    def __init__(
        self, engine: "AsyncEngine", request_id: Hashable, prompt_len: int, queue: asyncio.Queue | None, tag: Any
    ):
        self.engine = engine
        self.request_id = request_id
        self.prompt_len = prompt_len
        self.tag = tag
        self.shared = queue is not None
        self.queue: asyncio.Queue = queue if queue is not None else asyncio.Queue()
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        self.finished = False
        self.finish_reason: str | None = None

    def _put(self, item: StepDelta | BaseException) -> None:
        if isinstance(item, StepDelta):
            if item.token_ids:
                if self.first_token_time is None:
                    self.first_token_time = item.time
                self.last_token_time = item.time
                self.num_output_tokens += len(item.token_ids)
            self.num_cached_tokens = item.num_cached_tokens
            if item.finished:
                self.finished, self.finish_reason = True, item.finish_reason
        self.queue.put_nowait((self.tag, item) if self.shared else item)

    def __aiter__(self):
        return self

    async def __anext__(self) -> StepDelta:
        if self.shared:
            raise TypeError("a stream on a shared queue is read through that queue")
        if self.finished and self.queue.empty():
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def abort(self) -> None:
        """Stops the request (if it still runs) and frees its pages; safe to call more than once."""
        if not self.finished:
            self.finished, self.finish_reason = True, "abort"
        self.engine.abort(self.request_id)

    # Timing, as vLLM's benchmark reports it.
    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.num_output_tokens < 2 or self.first_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_output_tokens - 1)


class AsyncEngine:
    """Runs an Engine on its own thread and bridges it to one asyncio event loop."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.loop: asyncio.AbstractEventLoop | None = None
        self._commands: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._streams: dict[Hashable, RequestStream] = {}  # event-loop side only
        self._ids = itertools.count()
        self.error: BaseException | None = None
        self.stats = EngineStats(pages_total=engine.pool.num_usable_pages)
        self.num_prompt_tokens = 0  # requests' prompt tokens (event-loop side)
        self._recent: collections.deque = collections.deque()  # (time, generation tokens, computed tokens)

    # ---- lifecycle -----------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Starts the engine thread; outputs go to the running event loop."""
        if self._thread is not None:
            raise RuntimeError("already started")
        self.loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="mla-jax-engine", daemon=True)
        self._thread.start()

    def stop_thread(self, timeout: float = 30.0) -> None:
        """Stops the engine thread after its current step and waits for it (safe from any thread)."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self.error is None:
            self.error = EngineDeadError("the engine was shut down")

    def shutdown(self, timeout: float = 30.0) -> None:
        """`stop_thread`, then open streams raise EngineDeadError. Call it from the event loop's thread (or once
        the loop is gone): streams belong to the loop."""
        self.stop_thread(timeout)
        for s in list(self._streams.values()):
            s._put(EngineDeadError("the engine was shut down"))
        self._streams.clear()

    async def aclose(self, timeout: float = 30.0) -> None:
        """`shutdown` from a coroutine, without blocking the event loop while the thread finishes its step."""
        await asyncio.get_running_loop().run_in_executor(None, self.stop_thread, timeout)
        self.shutdown(timeout)

    @property
    def healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_open_streams(self) -> int:
        return len(self._streams)

    # ---- requests (event loop) ---------------------------------------------------------------------------
    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        request_id: Hashable | None = None,
        queue: asyncio.Queue | None = None,
        tag: Any = None,
    ) -> RequestStream:
        """Validates (ValueError) and queues a request; its outputs arrive on the returned stream."""
        if not self.healthy:
            raise EngineDeadError(f"the engine is not running{f': {self.error}' if self.error else ''}")
        prompt = self.engine.check_request(prompt_ids, params)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = RequestStream(self, request_id, len(prompt), queue, tag)
        self._streams[request_id] = stream
        self.num_prompt_tokens += len(prompt)
        self._commands.append(("add", request_id, prompt, params))
        self._wake.set()
        return stream

    def abort(self, request_id: Hashable) -> None:
        """Stops a request at the next step boundary and frees its pages; no more outputs are delivered for it."""
        if self._streams.pop(request_id, None) is not None:
            self._commands.append(("abort", request_id))
            self._wake.set()

    # ---- the engine thread ---------------------------------------------------------------------------------
    def _apply_commands(self) -> None:
        while self._commands:
            cmd = self._commands.popleft()
            if cmd[0] == "add":
                _, rid, prompt, params = cmd
                try:
                    self.engine.add_request(prompt, params, rid)
                except ValueError as e:  # checked already; would only fail on a race we do not have
                    self.loop.call_soon_threadsafe(self._fail, rid, e)
            else:
                self.engine.abort(cmd[1])

    def _run(self) -> None:
        try:
            while not self._stop:
                self._apply_commands()
                if not self.engine.has_unfinished:
                    self._publish_stats(0)
                    self._wake.wait()
                    self._wake.clear()
                    continue
                outs = self.engine.step()
                self._publish_stats(sum(len(o.new_token_ids) for o in outs))
                if outs:
                    self.loop.call_soon_threadsafe(self._deliver, outs)
        except BaseException as e:  # a failed step leaves the donated cache unusable: stop for good
            self.error = e
            if self.loop is not None and not self.loop.is_closed():
                self.loop.call_soon_threadsafe(self._fail_all, e)

    def _publish_stats(self, new_tokens: int) -> None:
        eng = self.engine
        s, pool, old = eng.scheduler, eng.pool, self.stats
        self.stats = EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            pages_used=pool.num_held_pages,
            pages_total=pool.num_usable_pages,
            pages_cached=pool.num_cached_pages,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            steps=eng.steps,
            generation_tokens=old.generation_tokens + new_tokens,
            computed_tokens=eng.num_computed_tokens,
        )
        if new_tokens:
            now = time.perf_counter()
            self._recent.append((now, new_tokens))
            while self._recent and self._recent[0][0] < now - THROUGHPUT_WINDOW_S:
                self._recent.popleft()

    def generation_tokens_per_second(self) -> float:
        """Output tokens per second over the last THROUGHPUT_WINDOW_S seconds."""
        now = time.perf_counter()
        recent = [n for t, n in list(self._recent) if t >= now - THROUGHPUT_WINDOW_S]
        return sum(recent) / THROUGHPUT_WINDOW_S

    # ---- delivery (event loop) -----------------------------------------------------------------------------
    def _deliver(self, outs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        for o in outs:
            stream = self._streams.get(o.request_id)
            if stream is None:  # aborted meanwhile
                continue
            k = len(o.new_token_ids)
            stream._put(
                StepDelta(
                    token_ids=list(o.new_token_ids),
                    logprobs=o.logprobs[-k:] if o.logprobs is not None and k else None,
                    top_logprobs=o.top_logprobs[-k:] if o.top_logprobs is not None and k else None,
                    finished=o.finished,
                    finish_reason=o.finish_reason,
                    num_cached_tokens=o.num_cached_tokens,
                    time=now,
                )
            )
            if o.finished:
                del self._streams[o.request_id]

    def _fail(self, request_id: Hashable, error: BaseException) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream._put(error)

    def _fail_all(self, error: BaseException) -> None:
        err = EngineDeadError(f"engine step failed: {type(error).__name__}: {error}")
        for rid in list(self._streams):
            self._fail(rid, err)
