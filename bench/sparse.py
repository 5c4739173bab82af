"""Benchmark of DeepSeek-V3.2 sparse attention (DSA) on one GPU, ceilings in the same run.

    JAX_PLATFORMS=cuda,cpu PYTHONPATH=. python3 bench/sparse.py --out DIR [--only decode|e2e|threshold]
    PYTHONPATH=. python3 bench/sparse.py --smoke                              (tiny, interpreted, on a CPU)

(each section a few minutes on the H200: one section per 10-minute call, each into its own DIR)

(a) checks each sparse decode kernel (`impl`: "sm90", the Hopper kernel, where the device is one, and
    "triton", the portable one) against its float32 reference on the GPU cases of
    `pallas_kernels.testing.SPARSE_DECODE_GPU_CASES` (exits 1 on a mismatch), (b) measures the copy/matmul
    ceilings, then times:
- `decode`: token-sparse latent MQA (top-k 2048), one row per kernel (`impl`), against our dense paged decode
  (`Backend.mla_decode`, the backend's own kernel choice) at ctx 8k/32k/128k, N = 128 and 16 heads, bf16 and
  fp8 (+scale) caches, B = 32 decode rows, page 64: `us`, `dense_us`, `speedup_vs_dense`, the kernel's
  TFLOP/s (2 B N K (576 + 512)) and its fraction of FlashMLA's published sparse decode rate (410 TFLOP/s,
  fp8, H800: `frac_flashmla_410`), and the indexer of one layer (`indexer_us`: score kernel + top-k for the
  same rows over the same ctx, 64 heads x 128, index cache in the row's dtype) as a fraction of the sparse
  attention (`indexer_frac`);
- `indexer`: the indexer alone per (ctx, dtype): `us` (the backend's top-k: score kernel with its bin
  histogram + radix-select kernel), `unfused_us` (the path before it: score kernel + `lax.top_k`) and
  `speedup_vs_unfused`; the parts `score_us` (score kernel alone), `score_hist_us` (with the histogram),
  `lax_topk_us`, `select_us` per select tuning (scores per step x warps), `score_us_by_tuning` (block_k x
  warps x key blocks per program; the default 128 x 4 x auto is `score_us`); `exact`: the fused and every select
  tuning's top-k equal lax.top_k on the same scores at this size (a mismatch is logged and listed in
  `failures`);
- `e2e`: decode steps (B = 32, ctx 32k) of a V3.2-shaped model (random bf16 weights, `--layers` layers, the
  first dense, the rest MoE) through `step.jit_step`, sparse vs the same weights run dense (index_topk off);
- `prefill_threshold`: one sparse layer (`sparse.mla_paged_sparse`) on one prompt of S tokens (1k..8k), its
  prefill rows forced to masked dense MHA or to token-sparse MQA, per N; `threshold` is the longest S up to
  which MHA was faster at every S measured (the value for `mla_jax.attention.SPARSE_PREFILL_MHA_MAX_LEN[N]`;
  0: MQA won everywhere measured). MHA needing more than --mha-max-logits-gb of f32 logits is not run (mqa).
  `--only threshold` and `--only e2e` each take a few minutes.
Writes DIR/sparse-h200.json (rows with `kind`; decode rows carry impl, ctx, N, dtype, topk, us,
speedup_vs_dense).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import warnings

warnings.filterwarnings("ignore", category=DeprecationWarning)  # the Triton lowering warns per call

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from mla_jax import attention, model, sparse  # noqa: E402
from mla_jax.bench import common  # noqa: E402
from mla_jax.cache import init_kv_cache_for  # noqa: E402
from mla_jax.config import DEEPSEEK_V32, DeepseekConfig  # noqa: E402
from mla_jax.metadata import ScheduledRequest, build_metadata  # noqa: E402
from mla_jax.step import jit_step  # noqa: E402
from pallas_kernels import lightning_indexer as li  # noqa: E402
from pallas_kernels import mla_decode_sm90 as md90  # noqa: E402
from pallas_kernels import testing  # noqa: E402
from pallas_kernels.sparse_mla_decode import sparse_mla_decode_reference  # noqa: E402

SCALE = testing.DECODE_SCALE
FLASHMLA_SPARSE_TFLOPS = 410.0  # FlashMLA sparse decode, fp8 KV, H800 (README, 2025-09)
t_start = time.time()


def log(*a):
    print(f"[{time.time() - t_start:6.1f}s]", *a, flush=True)


def sparse_impls():
    """The sparse decode kernels timed (`impl`): the Hopper one on a Hopper GPU (or interpreted, --smoke), the
    portable one everywhere; each still declines the shapes it does not take (`Kernel.supports`)."""
    hopper = md90.is_sm90() or jax.default_backend() == "cpu"
    return [k for k in (attention.SPARSE_DECODE_SM90, attention.SPARSE_DECODE_TRITON) if hopper or k.name != "sm90"]


def check(cases) -> bool:
    ok = True
    for name, inputs, kernel, kind in cases:
        q, cache, table, ks, _, _ = testing.sparse_decode_inputs(1234, **inputs)
        l = inputs.get("l", 512)
        ref, ref_lse = sparse_mla_decode_reference(q, cache, table, scale=SCALE, kv_scale=ks, kv_lora_rank=l)
        for impl in sparse_impls():
            if (reason := impl.supports(q, cache, table, kv_lora_rank=l)) is not None:
                log(f"check {name} {impl.name}: declines ({reason})")
                continue
            try:
                out, lse = impl.fn(q, cache, table, scale=SCALE, kv_scale=ks, kv_lora_rank=l, **kernel)
                lse_tol = testing.decode_gpu_tolerance(kind)[1]
                testing.assert_decode_close(out, lse, ref, ref_lse, kind, lse_tol=lse_tol)
                log(f"check {name} {impl.name}: ok")
            except AssertionError as e:
                ok = False
                log(f"check {name} {impl.name}: FAIL {e}")
    return ok


def pool(key, b, max_ctx, g, width, dtype):
    """A cache pool holding b requests of max_ctx tokens in random pages (+1 spare), and their block tables."""
    ppr = max_ctx // g
    num_pages = b * ppr + 1
    k = jax.random.split(key, 3)
    bt = jax.random.permutation(k[0], num_pages)[: b * ppr].reshape(b, ppr).astype(jnp.int32)
    x = jax.random.normal(k[1], (num_pages, g, width), jnp.float32)
    if dtype == "fp8":
        return bt, (x * 2).astype(jnp.float8_e4m3fn), jax.random.uniform(k[2], (num_pages, g), jnp.float32, 0.1, 0.5)
    return bt, x.astype(jnp.bfloat16), None


def topk_slots(key, bt, ctx, topk, g):
    """i32[B, 1, K]: K distinct positions spread over [0, ctx) per row (one in each ctx/K stretch), as slots."""
    b = bt.shape[0]
    stride = ctx // topk
    pos = jnp.arange(topk)[None, :] * stride + jax.random.randint(key, (b, topk), 0, stride)
    return (jnp.take_along_axis(bt, pos // g, axis=1) * g + pos % g).astype(jnp.int32)[:, None, :]


def bench_decode(args, backend, res, ceilings):
    B, G, K, L, R = args.batch, args.page, args.topk, args.l, args.r
    max_ctx = max(args.ctxs)
    H_I, D_I = args.index_heads, args.index_dim
    interpret = jax.default_backend() == "cpu"
    # jitted once (a shape seen again, e.g. the sparse decode at every ctx, is not compiled again)
    fused = jax.jit(lambda q, w, c, bt, sl, ks: backend.indexer_topk(q, w, c, bt, sl, scale=D_I**-0.5, k=K, k_scale=ks))
    logits_fn = jax.jit(
        lambda q, w, c, bt, sl, ks: li.indexer_logits(q, w, c, bt, sl, scale=D_I**-0.5, k_scale=ks, interpret=interpret)
    )
    with_hist = jax.jit(
        lambda q, w, c, bt, sl, ks: li._logits_impl(
            q,
            w,
            c,
            bt,
            sl,
            ks,
            scale=D_I**-0.5,
            interpret=interpret,
            block_k=None,
            num_warps=None,
            num_stages=None,
            histogram=True,
            width=1024,
        )
    )
    lax_topk = jax.jit(lambda x: li.topk_from_logits(x, K))
    unfused = jax.jit(lambda *a: li.topk_from_logits(logits_fn(*a), K))  # the path before the select kernel
    score_tuned = {
        bw: jax.jit(
            lambda q, w, c, bt, sl, ks, bw=bw: li.indexer_logits(
                q,
                w,
                c,
                bt,
                sl,
                scale=D_I**-0.5,
                k_scale=ks,
                interpret=interpret,
                block_k=bw[0],
                num_warps=bw[1],
                blocks_per_program=bw[2],
            )
        )
        for bw in args.score_tunings
    }
    select = {
        wn: jax.jit(
            lambda x, h, sl, wn=wn: li._select_impl(x, h, sl, k=K, interpret=interpret, width=wn[0], num_warps=wn[1])
        )
        for wn in args.select_tunings
    }
    dense = jax.jit(lambda q, c, bt, sl, ks: backend.mla_decode(q, c, bt, sl, scale=SCALE, kv_scale=ks, kv_lora_rank=L))
    sparse_fns = {
        impl: jax.jit(lambda q, c, t, ks, impl=impl: impl.fn(q, c, t, scale=SCALE, kv_scale=ks, kv_lora_rank=L))
        for impl in sparse_impls()
    }
    for dtype in args.dtypes:
        bt_full, cache, ks = pool(jax.random.key(1), B, max_ctx, G, L + R, dtype)
        _, icache, iks = pool(jax.random.key(2), B, max_ctx, G, D_I, dtype)
        qi = jax.random.normal(jax.random.key(3), (B, H_I, D_I), jnp.bfloat16)
        wi = jax.random.normal(jax.random.key(4), (B, H_I), jnp.float32) * H_I**-0.5
        for ctx in args.ctxs:
            bt = bt_full[:, : ctx // G]
            sl = jnp.full((B,), ctx, jnp.int32)
            iargs = [(qi, wi, icache, bt, sl, iks)]
            idx_us = common.time_fn(fused, iargs, iters=args.iters, reps=args.reps)
            score_us = common.time_fn(logits_fn, iargs, iters=args.iters, reps=args.reps)
            score_sweep = {
                f"{bw[0]}x{bw[1]}w_bpp{bw[2] or 'auto'}": round(
                    common.time_fn(f, iargs, iters=args.iters, reps=args.reps), 2
                )
                for bw, f in score_tuned.items()
            }
            hist_us = common.time_fn(with_hist, iargs, iters=args.iters, reps=args.reps)
            unfused_us = common.time_fn(unfused, iargs, iters=args.iters, reps=args.reps)
            lg, hist = with_hist(*iargs[0])
            topk_us = common.time_fn(lax_topk, [(lg,)], iters=args.iters, reps=args.reps)
            sweep = {
                f"{wn[0]}x{wn[1]}w": round(common.time_fn(f, [(lg, hist, sl)], iters=args.iters, reps=args.reps), 2)
                for wn, f in select.items()
            }
            # exact on the device at this size: the select kernel == lax.top_k on the same scores
            want = np.asarray(li.topk_from_logits(lg[:, : bt.shape[1] * G], K))
            exact = bool((np.asarray(fused(*iargs[0])) == want).all())
            exact &= all(bool((np.asarray(f(lg, hist, sl))[:, : want.shape[1]] == want).all()) for f in select.values())
            del lg, hist
            row = dict(kind="indexer", B=B, ctx=ctx, dtype=dtype, topk=K, H_I=H_I, D_I=D_I, us=round(idx_us, 2))
            row |= dict(score_us=round(score_us, 2), score_hist_us=round(hist_us, 2), select_us=sweep)
            row |= dict(score_us_by_tuning=score_sweep)
            row |= dict(lax_topk_us=round(topk_us, 2), unfused_us=round(unfused_us, 2))
            row |= dict(speedup_vs_unfused=round(unfused_us / idx_us, 2), exact=exact)
            row["frac_copy"] = round(
                B * ctx * (D_I * (1 if dtype == "fp8" else 2)) / (score_us * 1e-6) / 1e12 / ceilings["copy_TBps"], 3
            )
            res["rows"].append(row)
            log(row)
            if not exact:
                log(f"INDEXER TOP-K NOT EXACT at ctx {ctx} {dtype}")
                res.setdefault("failures", []).append(f"indexer top-k not exact at ctx {ctx} {dtype}")
            for n in args.heads:
                q = jax.random.normal(jax.random.key(5), (B, 1, n, L + R), jnp.bfloat16)
                dense_us = common.time_fn(dense, [(q, cache, bt, sl[:, None], ks)], iters=args.iters, reps=args.reps)
                tables = [(q, cache, topk_slots(jax.random.key(10 + i), bt, ctx, K, G), ks) for i in range(3)]
                for impl, sparse_fn in sparse_fns.items():
                    if (reason := impl.supports(*tables[0][:3], kv_lora_rank=L)) is not None:
                        log(f"decode {impl.name} declines N={n} {dtype}: {reason}")
                        continue
                    us = common.time_fn(sparse_fn, tables, iters=args.iters, reps=args.reps)
                    tflops = 2 * B * n * K * (L + L + R) / (us * 1e-6) / 1e12
                    row_bytes = (L + R) * (1 if dtype == "fp8" else 2) + (4 if dtype == "fp8" else 0)
                    row = dict(kind="decode", impl=impl.name, B=B, ctx=ctx, N=n, dtype=dtype, topk=K, page=G)
                    row |= dict(us=round(us, 2), dense_us=round(dense_us, 2), speedup_vs_dense=round(dense_us / us, 2))
                    row |= dict(TFLOPs=round(tflops, 1), frac_matmul=round(tflops / ceilings["matmul_TFLOPs"], 3))
                    row |= dict(frac_flashmla_410=round(tflops / FLASHMLA_SPARSE_TFLOPS, 3))
                    row |= dict(TBps=round(B * K * row_bytes / (us * 1e-6) / 1e12, 3))
                    row |= dict(indexer_us=round(idx_us, 2), indexer_frac=round(idx_us / us, 2))
                    res["rows"].append(row)
                    log(row)
        del cache, icache


def v32_config(args, *, heads=None, layers=None, dense_mlp=False) -> DeepseekConfig:
    d = {**DEEPSEEK_V32, "num_hidden_layers": layers or args.layers, "first_k_dense_replace": 1}
    if heads:
        d["num_attention_heads"] = d["num_key_value_heads"] = heads
    if dense_mlp:
        d |= dict(first_k_dense_replace=d["num_hidden_layers"], intermediate_size=2048, vocab_size=4096)
    if args.smoke:
        d |= dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=64,
            moe_intermediate_size=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            q_lora_rank=32,
            kv_lora_rank=64,
            qk_rope_head_dim=16,
            qk_nope_head_dim=16,
            v_head_dim=16,
            index_n_heads=4,
            index_head_dim=32,
        )
    d["index_topk"] = args.topk
    return DeepseekConfig.from_dict(d)


def random_cache(cfg, num_pages, g, key):
    c = init_kv_cache_for(cfg, num_pages, g, dtype="bf16")
    k = jax.random.split(key, 2)
    c = dataclasses.replace(c, kv_c_and_k_pe_cache=jax.random.normal(k[0], c.kv_c_and_k_pe_cache.shape, jnp.bfloat16))
    if c.index_k_cache is not None:
        c = dataclasses.replace(c, index_k_cache=jax.random.normal(k[1], c.index_k_cache.shape, jnp.bfloat16))
    return c


def time_steps(params, cfg, cache, md, backend, steps):
    for _ in range(2):
        logits, cache = jit_step(params, cfg, cache, md, backend=backend)
    jax.block_until_ready(logits)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(steps):
            logits, cache = jit_step(params, cfg, cache, md, backend=backend)
        jax.block_until_ready(logits)
        times.append((time.perf_counter() - t0) / steps)
    return float(np.median(times)), cache


def bench_e2e(args, backend_name, res):
    cfg = v32_config(args)
    B, ctx, G = args.batch, args.e2e_ctx, args.page
    params = model.init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16)
    ppr = ctx // G
    reqs = common.decode_requests(B, ctx, ppr, cfg.vocab_size)
    num_pages = B * ppr + 1
    md = build_metadata(reqs, page_size=G, num_pages=num_pages)[0].to_device()
    for mode, c in (("sparse", cfg), ("dense", dataclasses.replace(cfg, index_topk=None))):
        cache = random_cache(c, num_pages, G, jax.random.key(1))
        step_s, cache = time_steps(params, c, cache, md, backend_name, args.steps)
        del cache
        row = dict(
            kind="e2e", mode=mode, batch=B, ctx=ctx, phase="decode", layers=cfg.num_hidden_layers, topk=args.topk
        )
        row |= dict(step_ms=round(step_s * 1e3, 3), tokens_per_s=round(B / step_s, 1))
        res["rows"].append(row)
        log(row)
    sp, dn = res["rows"][-2], res["rows"][-1]
    sp["speedup_vs_dense"] = round(dn["step_ms"] / sp["step_ms"], 2)


def bench_threshold(args, backend_name, res):
    """One sparse layer (`sparse.mla_paged_sparse`: projections, indexer, attention, o_proj) on one prompt of S
    tokens, with the prefill rows forced to masked dense MHA or to token-sparse MQA. The layer alone (not the
    model step) keeps the compiles short; MHA over more than MHA_MAX_LOGITS_GB of f32 logits is not run."""
    base = attention.BACKENDS[backend_name]
    paths = {
        "mha": dataclasses.replace(base, name="_mha", sparse_prefill_mha_max_len=1 << 30),
        "mqa": dataclasses.replace(base, name="_mqa", sparse_prefill_mha_max_len=0),
    }
    G = args.page
    res["threshold"] = {}
    for n in args.heads:
        cfg = v32_config(args, heads=n, layers=1, dense_mlp=True)
        params = model.init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16)
        p = model.layer_params(params, cfg, 0)["self_attn"]
        best, mha_won_so_far = 0, True
        for s in args.prefill_lens:
            reqs = [ScheduledRequest(list(range(1, s + 1)), 0, list(range(1, 1 + s // G)))]
            md = build_metadata(reqs, page_size=G, num_pages=s // G + 1)[0].to_device()
            rows = sparse.token_rows(md)
            K = sparse.topk_budget(cfg, md, G)
            none = np.full((md.shape.num_tokens, K), -1, np.int32)  # (a constant: shared layers read it)
            x = jax.random.normal(jax.random.key(2), (md.shape.num_tokens, cfg.hidden_size), jnp.bfloat16)
            cache = random_cache(cfg, s // G + 1, G, jax.random.key(1))
            t = {}
            for path, be in paths.items():
                if path == "mha" and n * s * s * 4 / 2**30 > args.mha_max_logits_gb:
                    t[path] = None
                    continue
                # weights and metadata as arguments (closed over, they would be constants of the program)
                fn = jax.jit(
                    lambda p, x, c, md, rows, be=be: sparse.mla_paged_sparse(
                        p, cfg, x, md, c, (none, none), jnp.int32(0), be, rows
                    )[0]
                )
                args_ = [(p, x, cache, md, rows)]
                t[path] = common.time_fn(fn, args_, iters=args.steps, reps=3, warmup=2) / 1e3
            mha_ms = None if t["mha"] is None else round(t["mha"], 3)
            faster = "mqa" if t["mha"] is None or t["mqa"] <= t["mha"] else "mha"
            row = dict(kind="prefill_threshold", N=n, S=s, topk=args.topk, mha_ms=mha_ms, mqa_ms=round(t["mqa"], 3))
            row |= dict(faster=faster, scope="one sparse layer")
            res["rows"].append(row)
            log(row)
            mha_won_so_far &= faster == "mha"
            if mha_won_so_far:
                best = s
            del cache
        res["threshold"][str(n)] = best
        log(f"SPARSE_PREFILL_MHA_MAX_LEN[{n}] = {best}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="directory for sparse-h200.json (default: print only)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpreted kernels: checks the script on a CPU")
    ap.add_argument("--backend", default=None, help="attention backend (default: the engine's for this device)")
    ap.add_argument("--only", default="decode,e2e,threshold", help="sections to run")
    ap.add_argument("--layers", type=int, default=2, help="layers of the e2e model (first dense, rest MoE)")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--mha-max-logits-gb", type=float, default=8.0, help="threshold: skip MHA above this")
    args = ap.parse_args(argv)
    only = set(args.only.split(","))
    if args.smoke:
        args.backend = args.backend or "pallas"  # the kernels, interpreted
        args.ctxs, args.heads, args.dtypes, args.topk, args.batch, args.page = (
            (256, 512),
            (16,),
            ("bf16", "fp8"),
            64,
            2,
            16,
        )
        args.l, args.r, args.index_heads, args.index_dim = 128, 64, 4, 32  # (the Hopper kernel's smallest L, R)
        args.e2e_ctx, args.prefill_lens, args.iters, args.reps, args.steps, args.layers = 128, (32, 128), 2, 2, 1, 2
        args.select_tunings = ((16, 4), (32, 4))
        args.score_tunings = ((32, 4, 1), (32, 4, 2))
    else:
        args.backend = args.backend or attention.default_backend_name()
        args.ctxs, args.heads, args.dtypes, args.topk, args.batch, args.page = (
            (8192, 32768, 131072),
            (128, 16),
            ("bf16", "fp8"),
            2048,
            32,
            64,
        )
        args.l, args.r, args.index_heads, args.index_dim = 512, 64, 64, 128
        args.e2e_ctx, args.prefill_lens, args.iters, args.reps, args.steps = 32768, (1024, 2048, 4096, 8192), 10, 5, 5
        args.select_tunings = ((1024, 4), (2048, 4), (2048, 8), (4096, 8))  # (scores per step, warps)
        # (block_k, warps, blocks per program; None = the default ~4 programs per SM); the default is 128 x 4 x
        # None; 128 x 4 x 1 is the layout measured before (one block per program)
        args.score_tunings = ((128, 4, 1), (64, 4, None), (256, 4, None), (256, 8, None), (128, 4, 4))
    backend = attention.get_backend(args.backend)
    log(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, backend {args.backend}")
    if not args.no_check:
        cases = testing.SPARSE_DECODE_CASES[::5] if args.smoke else testing.SPARSE_DECODE_GPU_CASES
        if not check(cases):
            log("sparse decode kernel FAILS its reference: not timing")
            sys.exit(1)
    ceilings = common.measure_ceilings(small=args.smoke)
    log("ceilings", ceilings)
    res = common.results_header(ceilings)
    res["backend"] = args.backend
    res["flashmla_sparse_decode_TFLOPs"] = FLASHMLA_SPARSE_TFLOPS
    if "decode" in only:
        bench_decode(args, backend, res, ceilings)
    if "e2e" in only:
        bench_e2e(args, args.backend, res)
    if "threshold" in only:
        bench_threshold(args, args.backend, res)
    log("done")
    if args.out:
        common.write_results(f"{args.out}/sparse-h200.json", res)
    else:
        print("not written (no --out)", flush=True)


if __name__ == "__main__":
    main()
