"""Serving benchmark in the manner of vLLM's benchmark_serving: a fixed, seeded trace of requests arriving as a
Poisson process, driven through the server's engine loop (`mla_jax.serve.engine_loop.AsyncEngine`, the layer
under the HTTP app: same thread, same continuous batching, no HTTP and no web packages needed).

    PYTHONPATH=. python3 bench/serving.py --out DIR      (GPU: writes DIR/serving-h200.json)
    PYTHONPATH=. python3 bench/serving.py --smoke        (tiny dims on a CPU in well under a minute; prints only)

Model: DeepSeek-V2-Lite shape, random bf16 weights. Trace: prompt and output lengths drawn from lognormal
distributions shaped like ShareGPT's (medians 128 prompt / 128 output tokens, long right tails, clipped to
[4, 1024] and [4, 512]; generated here, not ShareGPT data), random token ids; every request generates exactly its
output length (no stop token), as benchmark_serving does with ignore_eos. Two traces per rate: "unique" prompts,
and "shared": each prompt starts with one of 4 system prompts of 512 tokens (the prefix-sharing case), run with
prefix caching on and, as the baseline, off. The same seed gives the same trace on every run.

Per row (trace, prefix caching, request rate): request and token throughput, TTFT / TPOT / ITL mean, p50, p99
(TTFT from the request's submission to its first token reaching the event loop; TPOT the mean gap after the
first token per request; ITL every gap), the prefix cache hit rate, preemptions, and compiles during the run
(0: every step shape was compiled in the warm-up). A row starts only while --budget-min allows; results are
written after every row.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mla_jax import model  # noqa: E402
from mla_jax.bench.common import (  # noqa: E402
    add_common_args,
    bench_ceilings,
    float_list,
    resolve_impls,
    results_header,
    v2_lite_config,
    write_results,
)
from mla_jax.engine import Engine, EngineConfig  # noqa: E402
from mla_jax.sampling import SamplingParams  # noqa: E402
from mla_jax.serve.engine_loop import AsyncEngine  # noqa: E402


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    arrival: float  # seconds after the start
    prompt: list[int]
    output_len: int


@dataclasses.dataclass(frozen=True)
class TraceSpec:
    num_prompts: int
    input_median: int = 128
    input_sigma: float = 1.1
    input_range: tuple[int, int] = (4, 1024)
    output_median: int = 128
    output_sigma: float = 0.9
    output_range: tuple[int, int] = (4, 512)
    num_prefixes: int = 4
    prefix_len: int = 512


def _lognormal(rng, n, median, sigma, lo, hi) -> np.ndarray:
    return np.clip(np.round(rng.lognormal(math.log(median), sigma, n)), lo, hi).astype(int)


def make_trace(spec: TraceSpec, rate: float, *, shared: bool, vocab: int, seed: int) -> list[TraceRequest]:
    """The seeded trace: Poisson arrivals at `rate` requests/s (inf: all at once), ShareGPT-like lengths; with
    `shared`, each prompt is one of `num_prefixes` fixed system prompts followed by its own tokens. The lengths
    and unique tokens do not depend on `rate` or `shared` (same seed, same draws)."""
    rng = np.random.default_rng(seed)
    n = spec.num_prompts
    ins = _lognormal(rng, n, spec.input_median, spec.input_sigma, *spec.input_range)
    outs = _lognormal(rng, n, spec.output_median, spec.output_sigma, *spec.output_range)
    which = rng.integers(0, spec.num_prefixes, n)
    prefixes = rng.integers(0, vocab, (spec.num_prefixes, spec.prefix_len))
    bodies = [rng.integers(0, vocab, int(k)).tolist() for k in ins]
    gaps = rng.exponential(1.0, n)  # unit-rate gaps, scaled below: the same arrival pattern at every rate
    arrivals = np.zeros(n) if math.isinf(rate) else np.cumsum(gaps) / rate - gaps[0] / rate
    return [
        TraceRequest(float(arrivals[i]), (prefixes[which[i]].tolist() if shared else []) + bodies[i], int(outs[i]))
        for i in range(n)
    ]


def _pct(xs, q) -> float | None:
    return round(float(np.percentile(xs, q)) * 1e3, 3) if len(xs) else None


async def run_trace(ae: AsyncEngine, trace: list[TraceRequest]) -> dict:
    """Submits every request at its arrival time; returns the client-side measurements."""
    t0 = time.perf_counter()

    async def one(req: TraceRequest):
        await asyncio.sleep(max(0.0, t0 + req.arrival - time.perf_counter()))
        stream = ae.add_request(req.prompt, SamplingParams(max_new_tokens=req.output_len))
        times = []
        async for d in stream:
            times += [d.time] * len(d.token_ids)
        return stream, times

    results = await asyncio.gather(*(one(r) for r in trace))
    end = time.perf_counter()
    ttft = [s.ttft for s, _ in results]
    tpot = [s.tpot for s, _ in results if s.tpot is not None]
    itl = [b - a for _, ts in results for a, b in zip(ts, ts[1:])]
    out_tokens = sum(len(ts) for _, ts in results)
    in_tokens = sum(len(r.prompt) for r in trace)
    dur = end - t0
    return {
        "completed": len(results),
        "duration_s": round(dur, 3),
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": round(len(results) / dur, 3),
        "output_throughput": round(out_tokens / dur, 1),
        "total_token_throughput": round((in_tokens + out_tokens) / dur, 1),
        "mean_ttft_ms": round(float(np.mean(ttft)) * 1e3, 3),
        "p50_ttft_ms": _pct(ttft, 50),
        "p99_ttft_ms": _pct(ttft, 99),
        "mean_tpot_ms": round(float(np.mean(tpot)) * 1e3, 3) if tpot else None,
        "p50_tpot_ms": _pct(tpot, 50),
        "p99_tpot_ms": _pct(tpot, 99),
        "mean_itl_ms": round(float(np.mean(itl)) * 1e3, 3) if itl else None,
        "p50_itl_ms": _pct(itl, 50),
        "p99_itl_ms": _pct(itl, 99),
    }


def run_row(params, cfg, ec: EngineConfig, trace: list[TraceRequest]) -> dict:
    eng = Engine(params, cfg, ec)  # a fresh cache and prefix cache; compiled steps are shared across engines
    compiles = eng.counter.count

    async def main(eng):
        ae = AsyncEngine(eng)
        await ae.start()
        try:
            return await run_trace(ae, trace)
        finally:
            await ae.aclose()

    row = asyncio.run(main(eng))
    s = eng.scheduler
    row.update(
        prefix_cache_hit_rate=round(s.prefix_cache_hits / s.prefix_cache_queries, 4)
        if s.prefix_cache_queries
        else None,
        prefix_cache_hit_tokens=s.prefix_cache_hits,
        computed_tokens=eng.num_computed_tokens,
        preemptions=s.num_preemptions,
        steps=eng.steps,
        compiles_during_run=eng.counter.count - compiles,
    )
    assert eng.pool.num_free_pages == eng.pool.num_usable_pages, "pages leaked"
    del eng
    gc.collect()
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(
        ap, out_default=None, out_help="directory for serving-h200.json (default: print only)", budget_min=8.5
    )
    ap.add_argument(
        "--rates",
        type=float_list,
        default=(2.0, 8.0, 32.0, math.inf),
        help="request rates in requests/s, comma-separated ('inf': all at once)",
    )
    ap.add_argument("--num-prompts", type=int, default=200, help="requests per row, at most")
    ap.add_argument(
        "--duration",
        type=float,
        default=25.0,
        help="a row's requests arrive within about this many seconds: min(num-prompts, rate x duration)",
    )
    ap.add_argument(
        "--modes",
        default="unique,shared,shared-nocache",
        help="traces: unique prompts / shared system prompts (prefix caching on) / shared, caching off",
    )
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = resolve_impls(ap.parse_args(argv))
    t_start = time.perf_counter()
    backend = args.backend
    cfg = v2_lite_config(min(args.layers, 2) if args.smoke else args.layers, smoke=args.smoke)
    if args.smoke:
        spec = TraceSpec(
            num_prompts=min(args.num_prompts, 12),
            input_median=16,
            input_range=(2, 40),
            output_median=6,
            output_range=(2, 12),
            num_prefixes=2,
            prefix_len=32,
        )
        ec = EngineConfig(
            max_model_len=96,
            max_num_seqs=8,
            page_size=16,
            token_budget=64,
            max_prefills=2,
            decode_buckets=(8,),
            prefill_buckets=(64,),
            cache_dtype="fp32",
            backend=backend,
        )
        rates = (math.inf, 50.0) if args.rates == ap.get_default("rates") else args.rates
        dtype = jnp.float32
    else:
        spec = TraceSpec(num_prompts=args.num_prompts)
        longest = spec.prefix_len + spec.input_range[1] + spec.output_range[1]
        # few, coarse buckets so that the warm-up compiles every shape: decode padding costs little (weights
        # dominate), prefill chunks are 512 or 2048 tokens
        B = args.max_num_seqs
        ec = EngineConfig(
            max_model_len=1 << (longest - 1).bit_length(),
            max_num_seqs=B,
            page_size=64,
            token_budget=2048,
            max_prefills=4,
            decode_buckets=tuple(sorted({min(16, B), min(64, B), B})),
            prefill_buckets=(512, 2048),
            cache_dtype="bf16",
            backend=backend,
        )
        rates = args.rates
        dtype = jnp.bfloat16
    ec = dataclasses.replace(ec, gmm_impl=args.gmm)
    ceilings = bench_ceilings(args.smoke)
    res = results_header(ceilings)
    res["model"] = (
        f"DeepSeek-V2-Lite shape, random {'fp32' if args.smoke else 'bf16'} weights, "
        f"{cfg.num_hidden_layers} layers" + (" (smoke dims)" if args.smoke else "")
    )
    res["engine"] = {
        k: (list(v) if isinstance(v, tuple) else v)
        for k, v in dataclasses.asdict(ec).items()
        if k != "enable_prefix_caching"
    }  # per row
    res["trace"] = dataclasses.asdict(spec) | {
        "seed": args.seed,
        "duration_s": args.duration,
        "arrivals": "Poisson",
        "lengths": "lognormal (ShareGPT-like)",
    }
    res["note"] = (
        "client side is the engine loop's event loop (no HTTP); TTFT from submission to the first token "
        "on the event loop; outputs run to their drawn length (no stop token)"
    )
    print("ceilings", ceilings, flush=True)
    params = model.init_params(cfg, jax.random.key(0), dtype=dtype)
    jax.block_until_ready(params)

    warm = Engine(params, cfg, ec)
    c = warm.config
    print(
        f"engine: {c.num_pages} pages of {c.page_size}, max_model_len {c.max_model_len}, decode buckets "
        f"{c.decode_buckets}, prefill buckets {c.prefill_buckets}, backend {c.backend}",
        flush=True,
    )
    compile_s = warm.warmup(all_shapes=True)
    res["compile_s"] = round(compile_s, 1)
    print(f"warm-up compile (every step shape): {compile_s:.1f} s", flush=True)
    del warm
    gc.collect()

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("unique", "shared", "shared-nocache")]
    if bad:
        raise SystemExit(f"unknown --modes entry {bad[0]!r}")
    path = os.path.join(args.out, "serving-h200.json") if args.out else None
    header = (
        f"{'trace':<15}{'rate':>6}{'reqs':>6}{'req/s':>8}{'out tok/s':>11}{'TTFT p50':>10}{'p99':>9}"
        f"{'TPOT p50':>10}{'p99':>8}{'hit':>7}"
    )
    print(header, flush=True)
    for rate in rates:
        n = spec.num_prompts if math.isinf(rate) else max(1, min(spec.num_prompts, int(rate * args.duration)))
        for mode in modes:
            if (time.perf_counter() - t_start) / 60 > args.budget_min:
                res.setdefault("skipped", []).append({"trace": mode, "rate": rate, "reason": "time budget"})
                continue
            trace = make_trace(
                dataclasses.replace(spec, num_prompts=n),
                rate,
                shared=mode != "unique",
                vocab=cfg.vocab_size,
                seed=args.seed,
            )
            row = run_row(params, cfg, dataclasses.replace(ec, enable_prefix_caching=mode != "shared-nocache"), trace)
            row = {
                "trace": mode.split("-")[0],
                "prefix_caching": mode != "shared-nocache",
                "request_rate": "inf" if math.isinf(rate) else rate,
                "num_prompts": n,
            } | row
            res["rows"].append(row)
            hit = row["prefix_cache_hit_rate"]
            print(
                f"{mode:<15}{row['request_rate']:>6}{n:>6}{row['request_throughput']:>8.2f}"
                f"{row['output_throughput']:>11.1f}{row['p50_ttft_ms']:>10.1f}{row['p99_ttft_ms']:>9.1f}"
                f"{row['p50_tpot_ms'] or 0:>10.2f}{row['p99_tpot_ms'] or 0:>8.2f}"
                f"{'-' if hit is None else f'{hit:.2f}':>7}",
                flush=True,
            )
            if path:
                write_results(path, res)
    if not path:
        print("(no --out: nothing written)")


if __name__ == "__main__":
    main()
