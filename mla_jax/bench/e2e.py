"""End-to-end benchmark on the GPU: a DeepSeek-V2-Lite-shaped model with random bf16 (and/or block-FP8) weights.

    mla-jax bench --out DIR            (or: python3 -m mla_jax.bench.e2e --out DIR)
    python3 -m mla_jax.bench.e2e --weights bf16,fp8 --out DIR   (both models in one run, one after the other)
    mla-jax bench --smoke              (tiny dims on a CPU; prints the rows, writes nothing)

Decode step time and tokens/s at batch 1, 32, 128 with context 1k and 4k (the cache is filled with random rows,
every request reading its own pages), prefill throughput for 8 prompts of 2k tokens, warm-up compile time.
Each step time is set against its roofline: bytes of weights and KV the step must read over the copy bandwidth
measured in the same run. With --out, writes DIR/e2e-h200.json (`--model v3-slice`: DIR/e2e-v3-slice-h200.json,
DeepSeek-V3's shape cut to a few layers, all 256 experts; format: shared/notes/bench-results.md);
without it, only prints.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from mla_jax import attention, model
from mla_jax.bench.common import (
    BENCH_MODELS,
    decode_requests,
    measure_ceilings,
    profile_steps,
    res_meta,
    results_header,
    time_step,
    write_results,
)
from mla_jax.cache import KVCache, init_kv_cache_for
from mla_jax.checkpoint.fp8 import WEIGHTS, quantize_params
from mla_jax.config import DeepseekConfig
from mla_jax.engine import GPU_PAGE_SIZE, Engine, EngineConfig
from mla_jax.metadata import ScheduledRequest, build_metadata
from mla_jax.sampling import SamplingArrays, SamplingParams
from mla_jax.step import engine_step, step_batch
from pallas_kernels import grouped_matmul as gmm_kernel
from pallas_kernels.util import cdiv


def weight_bytes(params, cfg: DeepseekConfig, tokens: int) -> float:
    """Bytes of weights a step over `tokens` tokens must read: everything except routed experts and the
    embedding table, plus the expected number of distinct experts the tokens hit (E * (1 - (1 - k/E)^tokens))
    per MoE layer and one embedding row per token (the whole table when it is also the lm_head)."""
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
    total = nbytes(params)
    expert_bytes = nbytes(params["model"]["moe_layers"]["mlp"]["experts"])
    embed = params["model"]["embed_tokens"]["weight"]  # [vocab, D]
    embed_bytes = nbytes(embed)
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    hit = E * (1 - (1 - k / E) ** tokens)
    tied = "lm_head" not in params
    rows = embed_bytes if tied else min(tokens, embed.shape[0]) * embed_bytes / embed.shape[0]
    return total - expert_bytes - embed_bytes + expert_bytes * hit / E + rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="directory for e2e-h200.json (default: print only)")
    ap.add_argument("--backend", default=None, help="attention backend (default: the engine's for this GPU)")
    ap.add_argument(
        "--model",
        choices=tuple(BENCH_MODELS),
        default="v2-lite",
        help="v2-lite: DeepSeek-V2-Lite's shape; v3-slice: DeepSeek-V3's shape (128 heads, 256 experts), few layers",
    )
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: 27 for v2-lite, 2 for v3-slice)")
    ap.add_argument("--smoke", action="store_true", help="tiny dims and sizes: checks the script on a CPU")
    ap.add_argument(
        "--gmm",
        choices=("ragged_dot", "pallas"),
        default="pallas",
        help="MoE expert matmul (mla_jax.layers.expert_gmm)",
    )
    ap.add_argument(
        "--weights",
        default="bf16",
        help="bf16, fp8 (block-FP8 linears and experts, W8A8) or both in one run (bf16,fp8): rows get `weights`",
    )
    ap.add_argument(
        "--cache-dtype",
        default="bf16",
        help="latent cache: bf16, fp8 (e4m3 rows + a float32 scale per token) or both (bf16,fp8): rows get "
        "`cache_dtype` and `cache_tokens_per_gb` (what fits in the same memory)",
    )
    ap.add_argument("--batches", default=None, help="decode batch sizes (default 1,8,32,128; --smoke: 1,4)")
    ap.add_argument("--ctxs", default=None, help="decode contexts (default 1024,4096,32768; --smoke: 32,128)")
    ap.add_argument("--cache-gb", type=float, default=24.0, help="skip shapes whose cache would need more")
    ap.add_argument("--no-prefill", action="store_true", help="skip the prefill row")
    ap.add_argument("--no-engine", action="store_true", help="skip the Engine.step() rows (batch 1 and 32)")
    ap.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="trace 5 steps of every decode shape into DIR: rows gain kernels_per_step, and OUT gets "
        "e2e-profile-b{B}-h200.json (kernels per step part) for batch 1, 32 and 128 at ctx 4096",
    )
    ap.add_argument(
        "--gmm-tuning",
        default=None,
        metavar="JSON",
        help='an A/B of the grouped kernels\' tuning: {"KERNEL-WEIGHTS-ROUTING": [block_m, block_n, block_k, '
        "num_warps, num_stages, num_k_splits]} (KERNEL glu or down, WEIGHTS bf16 or fp8, ROUTING rows: copies in "
        "token order, or sorted) in place of `grouped_matmul.default_tuning`'s (a winner of bench/moe_decode.py's "
        "sweep, in the whole step); rows get `variant`",
    )
    args = ap.parse_args(argv)
    args.backend = args.backend or attention.default_backend_name()
    if args.gmm_tuning:
        _override_gmm_tuning(ap, args.gmm_tuning)
    weights = tuple(args.weights.split(","))
    if not weights or any(w not in WEIGHTS for w in weights) or len(set(weights)) != len(weights):
        ap.error(f"--weights {args.weights!r}: a comma-separated list of distinct {WEIGHTS}")

    caches = args.cache_dtype.split(",")
    if not caches or any(c not in ("bf16", "fp8") for c in caches) or len(set(caches)) != len(caches):
        ap.error(f"--cache-dtype {args.cache_dtype!r}: a comma-separated list of distinct bf16, fp8")
    make_config, default_layers, shape = BENCH_MODELS[args.model]
    args.layers = args.layers or default_layers
    cfg = make_config(args.layers, smoke=args.smoke)
    ceilings = measure_ceilings(small=args.smoke)
    res = results_header(ceilings)
    res["model"] = f"{shape} shape, random {'/'.join(weights)} weights, {args.layers} layers"
    res["weights"] = ",".join(weights)
    if "fp8" in weights:  # which fp8 GEMM the model ran: the Mosaic GPU kernels or XLA's dequantize + dot
        res["fp8_impl"] = "kernel" if jax.default_backend() == "gpu" else "xla"
    res["backend"] = args.backend
    res["gmm_impl"] = args.gmm
    print("ceilings", ceilings, flush=True)
    for w in weights:  # one model at a time (both at V2-Lite size would double the weights' memory)
        args.weights = w
        params = model.init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16)
        if w == "fp8":
            params = quantize_params(params)[0]
        jax.block_until_ready(params)
        for cd in args.cache_dtype.split(","):
            args.cache = cd
            _run_weights(params, cfg, args, res, ceilings)
        del params
        gc.collect()
    _finish(args, res)


def _run_weights(params, cfg, args, res, ceilings):
    """The decode, prefill and engine rows of one model (`args.weights`) into res["rows"]."""
    G = GPU_PAGE_SIZE
    S, P = 2048, 8
    if args.smoke:
        G, S, P = 16, 64, 2
    default_batches, default_ctxs = ("1,4", "32,128") if args.smoke else ("1,8,32,128", "1024,4096,32768")
    batches = tuple(map(int, (args.batches or default_batches).split(",")))
    ctxs = tuple(map(int, (args.ctxs or default_ctxs).split(",")))
    row_bytes = cache_row_bytes(cfg, args.cache)
    # Shapes whose cache fits next to the weights (batch 128 at 32k would need 130 GB). Contexts up to `base`
    # (4096) share one engine with max_model_len `base`, as the earlier rows did; each longer one gets its own.
    base = min(4096, max(ctxs))
    groups: dict[int, list[tuple[int, int]]] = {}
    for ctx in ctxs:
        for B in batches:
            if B * ctx * cfg.num_hidden_layers * row_bytes > args.cache_gb * 2**30:
                print(f"skipped batch {B} ctx {ctx}: its cache exceeds --cache-gb {args.cache_gb}", flush=True)
                continue
            groups.setdefault(max(ctx, base), []).append((B, ctx))
    for i, (max_len, shapes) in enumerate(sorted(groups.items())):
        first = i == 0  # its engine also runs the prefill row
        eng, compile_s = _engine(params, cfg, args, shapes, max(max_len, S) if first else max_len, G, (S, P), first)
        for B, ctx in shapes:
            res["rows"].append(_decode_row(eng, cfg, args, res, B, ctx, G, compile_s, ceilings, row_bytes, params))
            _finish(args, res, quiet=True)  # each row on disk as soon as measured
        if first and not args.no_prefill:
            res["rows"].append(_prefill_row(eng, cfg, args, S, P, G, compile_s, ceilings, params))
        for B in [b for b in (1, 32) if b in batches] if first and not args.no_engine else []:
            for mode in (True, False):  # the same compiled steps, scheduled both ways
                eng.async_scheduling = mode
                res["rows"].append(_engine_row(eng, cfg, B) | {"weights": args.weights})
        _finish(args, res, quiet=True)
        del eng
        gc.collect()  # the next engine's cache needs this one's memory back


def _engine(params, cfg, args, shapes, max_len, G, prefill, with_prefill):
    """An engine for these (batch, ctx) decode shapes (and the prefill of P prompts of S tokens), warmed up,
    its cache filled with random latent rows (decode reads only what seq_lens allow); (engine, compile s)."""
    S, P = prefill
    batches = sorted({B for B, _ in shapes}) or [1]
    pages = max([B * cdiv(ctx, G) for B, ctx in shapes] + [P * S // G if with_prefill else 0])
    ec = EngineConfig(
        max_model_len=max_len,
        max_num_seqs=max(batches),
        page_size=G,
        num_pages=pages + 1,
        token_budget=S * P,
        max_prefills=P,
        decode_buckets=tuple(batches),
        prefill_buckets=(S * P,),
        backend=args.backend,
        gmm_impl=args.gmm,
        cache_dtype=args.cache,
    )
    eng = Engine(params, cfg, ec)
    t0 = time.perf_counter()
    eng.warmup(prefill=with_prefill and not args.no_prefill)
    compile_s = time.perf_counter() - t0
    print(f"max_model_len {max_len}: warm-up compile ({len(batches)} decode buckets): {compile_s:.1f} s", flush=True)
    kv, ks = eng.cache.kv_c_and_k_pe_cache, eng.cache.kv_scale
    rows = jax.random.normal(jax.random.key(1), kv.shape, jnp.float32 if ks is not None else kv.dtype).astype(kv.dtype)
    if ks is not None:  # fp8 rows with per-token scales
        ks = jax.random.uniform(jax.random.key(2), ks.shape, ks.dtype, 0.01, 0.05)
    eng.cache = KVCache(rows, ks)
    return eng, compile_s


def _step_fn(eng, cfg, args, batch):
    """The engine's jitted step as the engine calls it (with its device token buffer), cache in and out; its
    `lower(cache)` lowers that same call."""
    kw = dict(backend=args.backend, batch_invariant=False, gmm_impl=args.gmm)

    def step(cache):
        t, _, cache, _ = engine_step(eng.params, cfg, cache, batch, eng.token_buffer, **kw)
        return t, cache

    step.lower = lambda cache: engine_step.lower(eng.params, cfg, cache, batch, eng.token_buffer, **kw)
    return step


def _decode_row(eng, cfg, args, res, B, ctx, G, compile_s, ceilings, row_bytes, params):
    """One decode step at batch B, every request at context ctx on its own pages: timed, optionally traced."""
    ppr = cdiv(ctx, G)
    reqs = decode_requests(B, ctx, ppr, cfg.vocab_size)
    md, _ = build_metadata(reqs, page_size=G, num_pages=eng.config.num_pages, shape=eng.batch_shape(B, 0))
    batch = jax.device_put(step_batch(md, SamplingArrays.build([], [], md.shape.num_logits)))
    step = _step_fn(eng, cfg, args, batch)
    step_s, _, cache = time_step(step, eng.cache, steps=10, reps=5, warmup=2)
    breakdown = None
    if args.profile:
        tag = ("" if args.weights == "bf16" else f"-{args.weights}") + ("" if args.cache == "bf16" else "-fp8cache")
        breakdown, cache = profile_steps(step, cache, step.lower, f"{args.profile}/b{B}-ctx{ctx}{tag}")
        breakdown["shape"] = dict(batch=B, ctx=ctx, backend=args.backend, gmm_impl=args.gmm, weights=args.weights)
        if args.out and B in (1, 32, 128) and ctx == 4096:
            model = "" if args.model == "v2-lite" else f"-{args.model}"
            write_results(f"{args.out}/e2e-profile{model}-b{B}{tag}-h200.json", {**res_meta(res), **breakdown})
    eng.cache = cache
    nbytes = weight_bytes(params, cfg, B) + B * ctx * row_bytes * cfg.num_hidden_layers
    row = _row("decode", B, ctx, B, step_s, nbytes, ceilings, args, compile_s)
    row["max_model_len"] = eng.config.max_model_len
    row["cache_dtype"] = args.cache
    row["cache_tokens_per_gb"] = round(1e9 / (row_bytes * cfg.num_hidden_layers))
    if breakdown and "kernels_per_step" in breakdown:
        row["kernels_per_step"] = breakdown["kernels_per_step"]
        row["device_busy_ms"] = round(breakdown["busy_us_per_step"] / 1e3, 3)
    print(row, flush=True)
    return row


def cache_row_bytes(cfg, cache_dtype: str) -> int:
    """Bytes a token takes in one layer's latent cache: bf16 2 x (L + R); fp8 L + R e4m3 and a float32 scale."""
    return 2 * cfg.cache_row_dim if cache_dtype == "bf16" else cfg.cache_row_dim + 4


def _prefill_row(eng, cfg, args, S, P, G, compile_s, ceilings, params):
    """P prompts of S new tokens in one step."""
    reqs = [
        ScheduledRequest(
            list(np.random.default_rng(p).integers(0, cfg.vocab_size, S)),
            0,
            list(range(1 + p * (S // G), 1 + (p + 1) * (S // G))),
        )
        for p in range(P)
    ]
    md, _ = build_metadata(
        reqs,
        page_size=G,
        num_pages=eng.config.num_pages,
        workspace_rows=eng.workspace_rows,
        shape=eng.batch_shape(0, S * P),
    )
    batch = jax.device_put(step_batch(md, SamplingArrays.build([], [], md.shape.num_logits)))
    step = _step_fn(eng, cfg, args, batch)
    step_s, _, eng.cache = time_step(step, eng.cache, steps=1, reps=3, warmup=1)
    row = _row("prefill", P, S, S * P, step_s, weight_bytes(params, cfg, S * P), ceilings, args, compile_s)
    print(row, flush=True)
    return row


def _override_gmm_tuning(ap, spec: str) -> None:
    """--gmm-tuning: `grouped_matmul.default_tuning` answers the named calls with the given tuning (a benchmark's
    A/B of a candidate default; the kernels are the same code)."""
    try:
        table = {k: tuple(int(v) for v in vs) for k, vs in json.loads(spec).items()}
    except (ValueError, TypeError, AttributeError) as e:
        ap.error(f"--gmm-tuning {spec!r}: {e}")
    for key, tun in table.items():
        parts = key.split("-")
        if (
            len(tun) != 6
            or len(parts) != 3
            or parts[0] not in ("glu", "down")
            or parts[1] not in WEIGHTS
            or parts[2] not in ("rows", "sorted")
        ):
            ap.error(f"--gmm-tuning: {key!r}: {list(tun)} is not KERNEL-WEIGHTS-ROUTING: 6 ints")
    default = gmm_kernel.default_tuning

    def tuned(m, n, k, g, dtype, sms=None, *, by_row=False, glu=False, fp8=False):
        key = f"{'glu' if glu else 'down'}-{'fp8' if fp8 else 'bf16'}-{'rows' if by_row else 'sorted'}"
        return table.get(key) or default(m, n, k, g, dtype, sms, by_row=by_row, glu=glu, fp8=fp8)

    gmm_kernel.default_tuning = tuned


def _row(phase, batch, ctx, tokens, step_s, nbytes, ceilings, args, compile_s) -> dict:
    """A result row: the step time against its roofline (`nbytes` read at copy bandwidth)."""
    roof = nbytes / (ceilings["copy_TBps"] * 1e12)
    return dict(
        batch=batch,
        ctx=ctx,
        phase=phase,
        weights=args.weights,
        step_ms=round(step_s * 1e3, 3),
        tokens_per_s=round(tokens / step_s, 1),
        roofline_ms=round(roof * 1e3, 3),
        x_roofline=round(step_s / roof, 2),
        compile_s=round(compile_s, 1),
    ) | ({"variant": f"gmm-tuning {args.gmm_tuning}"} if args.gmm_tuning else {})


def _engine_row(eng, cfg, B, steps: int = 40) -> dict:
    """`Engine.step()` at batch B (short prompts, greedy), with the engine's scheduling (async by default): wall
    per step, the time it blocked on sampled ids, and the rest (host work: scheduler, metadata, outputs, launch)."""
    eng.cache = init_kv_cache_for(cfg, eng.config.num_pages, eng.config.page_size, dtype=eng.config.cache_dtype)
    rng = np.random.default_rng(0)
    for _ in range(B):
        eng.add_request(rng.integers(0, cfg.vocab_size, 16).tolist(), SamplingParams(max_new_tokens=steps + 8))
    while any(r.num_computed_tokens < 16 for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()  # the prefills
    eng.step()
    wait0, t0 = eng.device_wait_s, time.perf_counter()
    for _ in range(steps):
        eng.step()
    wall = (time.perf_counter() - t0) / steps
    wait = (eng.device_wait_s - wait0) / steps
    eng.run()  # finish the requests
    row = dict(
        batch=B,
        phase="engine",
        async_scheduling=eng.async_scheduling,
        step_ms=round(wall * 1e3, 3),
        wait_ms=round(wait * 1e3, 3),
        host_ms=round((wall - wait) * 1e3, 3),
    )
    print(row, flush=True)
    return row


def _finish(args, res, quiet: bool = False) -> None:
    if args.out:
        name = "e2e-h200.json" if args.model == "v2-lite" else f"e2e-{args.model}-h200.json"
        write_results(f"{args.out}/{name}", res)
    elif not quiet:
        print("not written (no --out)", flush=True)


if __name__ == "__main__":
    main()
