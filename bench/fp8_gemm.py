"""Benchmark of the block-scaled fp8 GEMMs (pallas_kernels.fp8_matmul) against bf16 on one GPU.

    JAX_PLATFORMS=cuda,cpu PYTHONPATH=. python3 bench/fp8_gemm.py --out DIR [--budget-s 420] [--smoke]

Shapes: the linears of DeepSeek-V3 (q_a, kv_a, q_b, o_proj, shared-expert and dense-MLP gate/down) and
DeepSeek-V2-Lite (q_proj, kv_a, o_proj, dense gate; its dense down_proj, K = 10944, is not a multiple of 128:
`fp8_matmul_xla` rows), and the routed experts: a V3 EP-8 shard (32 local experts, D 7168, I 2048) and
V2-Lite (64 experts, D 2048, I 1408), gate [E, I, D] and down [E, D, I], rows spread uniformly over the
experts. M = 1 .. 16384 rows.

impl per row:
- "fp8": the W8A8 Mosaic GPU kernel, activation quantization (`quantize_act`, an XLA fusion) included;
- "bf16": dense: XLA's bf16 dot (cuBLAS); grouped: our Pallas grouped_matmul in bf16 (bench/moe.py's
  kernel), the bf16 path the model runs;
- "xla_fp8": dense only: XLA's fp8 dot (e4m3 x e4m3 -> bf16, one scale per tensor: cuBLASLt fp8 GEMM), the
  fastest fp8 XLA offers, though without DeepSeek's block scales (a speed reference, not the same numerics);
- "fp8_xla": shapes the kernel does not take: `fp8_matmul_xla` (dequantize + dot);
- "fp8_st{n}" (with --stages n,..): the kernel at ring depth n instead of `default_stages`.
Before timing, each fp8 shape is checked against `fp8_matmul_xla` (the same numerics in XLA): exit 1 on a
mismatch (rows get check_rel_err).

Rows (DIR/fp8-gemm-h200.json; --smoke: fp8-gemm-h200-smoke.json): op "fp8_gemm", model, name, kind
(dense/grouped), M, N, K, G (experts, grouped), impl, us (median), TFLOPs (2 M N K / time), TBps (weight
bytes / time: the decode roofline), frac_matmul (of the bf16 matmul ceiling), frac_copy, speedup_vs_bf16
(bf16 us / this us, same shape and M). Ceilings measured in the same run (mla_jax.bench.common).
--smoke: tiny shapes on a CPU under the Mosaic GPU interpreter (checks the plumbing only).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
import warnings

import numpy as np

warnings.filterwarnings("ignore", category=DeprecationWarning)
warnings.filterwarnings("ignore", message=".*[Tt]riton.*")

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from mla_jax.bench import common  # noqa: E402
from pallas_kernels import fp8_matmul as F  # noqa: E402
from pallas_kernels import grouped_matmul as gm  # noqa: E402

DENSE = [  # (model, name, N, K)
    ("v3", "q_a_proj", 1536, 7168),
    ("v3", "kv_a_proj_with_mqa", 576, 7168),
    ("v3", "q_b_proj", 24576, 1536),
    ("v3", "o_proj", 7168, 16384),
    ("v3", "shared_gate_proj", 2048, 7168),
    ("v3", "mlp_gate_proj", 18432, 7168),
    ("v3", "mlp_down_proj", 7168, 18432),
    ("v2-lite", "q_proj", 3072, 2048),
    ("v2-lite", "kv_a_proj_with_mqa", 576, 2048),
    ("v2-lite", "o_proj", 2048, 2048),
    ("v2-lite", "mlp_gate_proj", 10944, 2048),
    ("v2-lite", "mlp_down_proj", 2048, 10944),
]
GROUPED = [  # (model, name, G, N, K)
    ("v3-ep8", "experts_gate_proj", 32, 2048, 7168),
    ("v3-ep8", "experts_down_proj", 32, 7168, 2048),
    ("v2-lite", "experts_gate_proj", 64, 1408, 2048),
    ("v2-lite", "experts_down_proj", 64, 2048, 1408),
]
MS = (1, 16, 128, 512, 2048, 4096, 16384)
SMOKE_DENSE = [("smoke", "dense", 128, 256), ("smoke", "ragged_k", 128, 200)]
SMOKE_GROUPED = [("smoke", "grouped", 3, 128, 256)]
SMOKE_MS = (1, 70)
L2_BYTES = 64 << 20  # weights smaller than this cycle through 3 sets so L2 cannot hold them


def log(*a):
    print(*a, flush=True)


def _weights(key, lead, n, k, sets):
    out = []
    for s in range(sets):
        w = jax.random.normal(jax.random.fold_in(key, s), (*lead, n, k), jnp.float32) * k**-0.5
        wq, ws = F.quantize_weight_blocks(w)
        out.append((w.astype(jnp.bfloat16), wq, ws))
    return out


def _timed(fn, arg_sets, smoke):
    if smoke:
        return common.time_fn(fn, arg_sets, iters=1, reps=1, warmup=1)
    return common.time_fn(fn, arg_sets, iters=10, reps=5, warmup=2)


def _row(model, name, kind, m, n, k, g, impl, us, ceil, wbytes, **extra):
    r = dict(op="fp8_gemm", model=model, name=name, kind=kind, M=m, N=n, K=k, impl=impl)
    if g:
        r["G"] = g
    if us is not None:
        tf = 2 * m * n * k / (us * 1e-6) / 1e12
        tb = wbytes / (us * 1e-6) / 1e12
        r.update(us=round(us, 2), TFLOPs=round(tf, 2), TBps=round(tb, 3))
        if ceil.get("matmul_TFLOPs"):
            r["frac_matmul"] = round(tf / ceil["matmul_TFLOPs"], 3)
        if ceil.get("copy_TBps"):
            r["frac_copy"] = round(tb / ceil["copy_TBps"], 3)
    r.update(extra)
    return r


def _check(name, out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    rel = float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-6))
    good = bool(np.all(np.isfinite(out))) and rel <= 1e-2  # bf16 out vs float32 math: bf16 rounding
    log(f"check {name}: max|err|/max|ref| = {rel:.2e} {'ok' if good else 'FAIL'}")
    return good, rel


def _sweep_fns(stages, make):
    """{impl: jitted fn} of the --stages variants ("fp8_st{n}")."""
    return {f"fp8_st{n}": jax.jit(make(n)) for n in stages}


def bench_dense(shapes, ms, ceil, rows, smoke, deadline, stages=()):
    ok = True
    interp = smoke
    for model, name, n, k in shapes:
        if time.perf_counter() > deadline:
            log(f"budget spent: skipping {model} {name}")
            continue
        sets = 3 if n * k < L2_BYTES and not smoke else 1
        ws_ = _weights(jax.random.key(n * 7 + k), (), n, k, sets)
        wbytes = n * k  # fp8 weight bytes read per call (scales: 1/4096 of that)
        kernel_ok = F.unsupported_reason(n, k) is None
        fp8_fn = jax.jit(lambda x, w, s: F.fp8_matmul(x, w, s, interpret=interp))
        fp8_xla = jax.jit(lambda x, w, s: F.fp8_matmul_xla(x, w, s))
        sweep = _sweep_fns(stages, lambda st: lambda x, w, s: F.fp8_matmul(x, w, s, interpret=interp, stages=st))
        bf16_fn = jax.jit(lambda x, w: jnp.einsum("mk,nk->mn", x, w))
        xla8 = jax.jit(
            lambda x, w: jax.lax.dot_general(
                x.astype(jnp.float8_e4m3fn), w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16
            )
        )
        for m in ms:
            xs = [jax.random.normal(jax.random.key(m + s), (m, k), jnp.bfloat16) for s in range(sets)]
            base = dict(model=model, name=name, kind="dense", m=m, n=n, k=k, g=0, ceil=ceil, wbytes=wbytes)
            results = {}
            for impl in ("bf16", "fp8" if kernel_ok else "fp8_xla", "xla_fp8", *(sweep if kernel_ok else ())):
                if impl == "xla_fp8" and smoke:
                    continue
                try:
                    if impl == "bf16":
                        fn, args = bf16_fn, [(x, w[0]) for x, w in zip(xs, ws_)]
                    elif impl == "xla_fp8":
                        fn, args = xla8, [(x, w[1]) for x, w in zip(xs, ws_)]
                    else:
                        fn = {"fp8": fp8_fn, "fp8_xla": fp8_xla, **sweep}[impl]
                        args = [(x, w[1], w[2]) for x, w in zip(xs, ws_)]
                    extra = {}
                    if impl == "fp8" and m in (ms[0], ms[-1]):
                        good, rel = _check(f"{model} {name} M={m}", fn(*args[0]), fp8_xla(*args[0]))
                        ok &= good
                        extra["check_rel_err"] = round(rel, 5)
                    us = _timed(fn, args, smoke)
                    results[impl] = us
                    rows.append(_row(impl=impl, us=us, **base, **extra))
                except Exception as e:  # noqa: BLE001
                    log(f"{model} {name} M={m} {impl}: ERROR {type(e).__name__}: {str(e)[:300]}")
                    traceback.print_exc()
                    rows.append(_row(impl=impl, us=None, error=f"{type(e).__name__}: {str(e)[:300]}", **base))
            _speedups(rows, results)
            log(f"{model} {name} M={m}: " + ", ".join(f"{i} {u:.1f} us" for i, u in results.items()))
    return ok


def _speedups(rows, results):
    if "bf16" not in results:
        return
    for r in rows[-len(results) :]:
        if r.get("us") and r["impl"] != "bf16":
            r["speedup_vs_bf16"] = round(results["bf16"] / r["us"], 3)
    for r in rows[-len(results) :]:
        if r["impl"] == "bf16" and r.get("us"):
            r["speedup_vs_bf16"] = 1.0


def bench_grouped(shapes, ms, ceil, rows, smoke, deadline, stages=()):
    ok = True
    interp = smoke
    for model, name, g, n, k in shapes:
        if time.perf_counter() > deadline:
            log(f"budget spent: skipping {model} {name}")
            continue
        ((w16, wq, ws),) = _weights(jax.random.key(g * n + k), (g,), n, k, 1)
        fp8_fn = jax.jit(lambda x, w, s, gs: F.fp8_grouped_matmul(x, w, s, gs, interpret=interp))
        fp8_xla = jax.jit(lambda x, w, s, gs: F.fp8_grouped_matmul_xla(x, w, s, gs))
        bf16_fn = jax.jit(lambda x, w, gs: gm.grouped_matmul(x, w, gs, interpret=interp))
        sweep = _sweep_fns(
            stages, lambda st: lambda x, w, s, gs: F.fp8_grouped_matmul(x, w, s, gs, interpret=interp, stages=st)
        )
        for m in ms:
            rng = np.random.default_rng(m)
            gs = jnp.asarray(rng.multinomial(m, np.ones(g) / g).astype(np.int32))
            hit = int((np.asarray(gs) > 0).sum())
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
            base = dict(model=model, name=name, kind="grouped", m=m, n=n, k=k, g=g, ceil=ceil, wbytes=hit * n * k)
            results = {}
            for impl in ("bf16", "fp8", *sweep):
                try:
                    if impl == "bf16":
                        fn, args = bf16_fn, [(x, w16, gs)]
                    else:
                        fn, args = {"fp8": fp8_fn, **sweep}[impl], [(x, wq, ws, gs)]
                    extra = {"experts_hit": hit}
                    if impl == "fp8" and m in (ms[0], ms[-1]):
                        good, rel = _check(f"{model} {name} M={m}", fn(*args[0]), fp8_xla(*args[0]))
                        ok &= good
                        extra["check_rel_err"] = round(rel, 5)
                    us = _timed(fn, args, smoke)
                    results[impl] = us
                    rows.append(_row(impl=impl, us=us, **base, **extra))
                except Exception as e:  # noqa: BLE001
                    log(f"{model} {name} M={m} {impl}: ERROR {type(e).__name__}: {str(e)[:300]}")
                    traceback.print_exc()
                    rows.append(_row(impl=impl, us=None, error=f"{type(e).__name__}: {str(e)[:300]}", **base))
            _speedups(rows, results)
            log(f"{model} {name} M={m}: " + ", ".join(f"{i} {u:.1f} us" for i, u in results.items()))
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, Mosaic GPU interpreter (CPU check)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="no new shape starts after this")
    ap.add_argument("--ms", type=str, default=None, help="comma-separated M values (default 1..16384)")
    ap.add_argument("--stages", type=str, default="", help="also time these ring depths, e.g. 2,3,4 (fp8_st{n})")
    args = ap.parse_args()
    if args.smoke:
        os.environ.setdefault("NPROC", "8")
    t0 = time.perf_counter()
    deadline = t0 + args.budget_s
    ceil = common.measure_ceilings(small=args.smoke)
    log(f"ceilings: {ceil}")
    results = common.results_header(ceil)
    ms = tuple(int(v) for v in args.ms.split(",")) if args.ms else (SMOKE_MS if args.smoke else MS)
    rows = results["rows"]
    stages = tuple(int(v) for v in args.stages.split(",") if v)
    ok = bench_grouped(SMOKE_GROUPED if args.smoke else GROUPED, ms, ceil, rows, args.smoke, deadline, stages)
    ok &= bench_dense(SMOKE_DENSE if args.smoke else DENSE, ms, ceil, rows, args.smoke, deadline, stages)
    results["checks_passed"] = bool(ok)
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    name = "fp8-gemm-h200-smoke.json" if args.smoke else "fp8-gemm-h200.json"
    common.write_results(os.path.join(args.out, name), results)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
