"""Prometheus metrics of the server (`GET /metrics`), named after vLLM's with the `mla_jax:` prefix.

Engine state is read from the engine thread's latest `EngineStats` snapshot at scrape time (running and waiting
requests, KV pages used, prefix cache counters, tokens, tokens/s over the last 10 s); per-request histograms
(time to first token, time per output token, end-to-end latency) and finished-request counts are recorded when a
choice ends. Each server has its own registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from mla_jax.serve.engine_loop import AsyncEngine, RequestStream

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
TPOT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


class _EngineCollector:
    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        s = self.engine.stats
        labels = ["model_name"]
        v = [self.model_name]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(f"mla_jax:{name}", doc, labels=labels)
            g.add_metric(v, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(f"mla_jax:{name}", doc, labels=labels)
            c.add_metric(v, value)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge("kv_cache_pages_used", "KV cache pages held by requests.", s.pages_used)
        yield gauge("kv_cache_pages_total", "Usable KV cache pages.", s.pages_total)
        yield gauge(
            "kv_cache_usage_perc",
            "Fraction of KV cache pages held by requests (1 = full).",
            s.pages_used / s.pages_total if s.pages_total else 0.0,
        )
        yield gauge("prefix_cache_pages", "KV cache pages in the prefix cache (held or evictable).", s.pages_cached)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield gauge(
            "prefix_cache_hit_rate",
            "prefix_cache_hits / prefix_cache_queries since start.",
            s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0,
        )
        yield counter("num_preemptions", "Requests preempted (pages ran out) since start.", s.num_preemptions)
        yield counter("engine_steps", "Engine steps run.", s.steps)
        yield counter("generation_tokens", "Output tokens generated.", s.generation_tokens)
        yield counter("computed_tokens", "Tokens run through the model (prefill and decode).", s.computed_tokens)
        yield counter("prompt_tokens", "Prompt tokens of accepted requests.", self.engine.num_prompt_tokens)
        yield gauge(
            "generation_tokens_per_second",
            "Output tokens per second over the last 10 s.",
            self.engine.generation_tokens_per_second(),
        )


class ServeMetrics:
    def __init__(self, engine: AsyncEngine, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        self.model_name = model_name
        kw = dict(labelnames=["model_name"], registry=self.registry)
        self.ttft = Histogram("mla_jax:time_to_first_token_seconds", "Time to first token.", buckets=TTFT_BUCKETS, **kw)
        self.tpot = Histogram(
            "mla_jax:time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            buckets=TPOT_BUCKETS,
            **kw,
        )
        self.e2e = Histogram(
            "mla_jax:e2e_request_latency_seconds", "Request latency, arrival to last token.", buckets=E2E_BUCKETS, **kw
        )
        self.finished = Counter(
            "mla_jax:request_success",
            "Finished requests (choices) by finish reason.",
            labelnames=["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.prompt_len = Histogram(
            "mla_jax:request_prompt_tokens",
            "Prompt tokens per request.",
            buckets=(16, 64, 256, 1024, 4096, 16384, 65536),
            **kw,
        )
        self.gen_len = Histogram(
            "mla_jax:request_generation_tokens",
            "Output tokens per request.",
            buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384),
            **kw,
        )

    def observe_request(
        self, stream: RequestStream, finish_reason: str | None, prompt_tokens: int, output_tokens: int
    ) -> None:
        m = self.model_name
        self.finished.labels(m, finish_reason or "unknown").inc()
        if stream.ttft is not None:
            self.ttft.labels(m).observe(stream.ttft)
            self.e2e.labels(m).observe(stream.last_token_time - stream.arrival_time)
        if stream.tpot is not None:
            self.tpot.labels(m).observe(stream.tpot)
        self.prompt_len.labels(m).observe(prompt_tokens)
        self.gen_len.labels(m).observe(output_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
